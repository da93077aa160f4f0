"""The offloading engine's prefill: a prompt's KV reaches its CPU pages chunk by chunk."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from herald.config import OffloadConfig, SamplingParams
from herald.models.registry import build_model, get_preset
from herald.offload.prefill import PromptPrefill
from herald.offload.selection.compact_cpu import update_compact


def _check_pages(prefill: PromptPrefill, req) -> None:
    """The request's CPU pages hold exactly its prompt's offloaded-layer KV (and, if the pool
    keeps one, their int8 copy is that of a fresh quantization of the pages)."""
    core = prefill.core
    b, nd = core.block_size, core.num_dense
    nblk = req.layout.num_prefill_tokens // b
    if nblk == 0:
        return  # a prompt within its first block: no prefill
    pages = torch.tensor(core.kv.pages(req.request_id)[:nblk], dtype=torch.long)
    store = core.cpu_pool.storage  # [L', 2, pages, Hkv, B, D]
    hkv, d = store.shape[3], store.shape[5]
    for pl in range(store.shape[0]):
        for kv, temp in enumerate((prefill.tk, prefill.tv)):
            rows = temp[nd + pl][0, :, : nblk * b].view(hkv, nblk, b, d).transpose(0, 1)
            assert torch.equal(store[pl, kv, pages], rows.cpu().to(store.dtype)), (pl, kv)
    compact = core.cpu_pool.compact
    if compact is not None:
        q8, scales = compact.q8[:, pages].clone(), compact.scales[:, pages].clone()
        update_compact(core.cpu_pool, pages)
        assert torch.equal(compact.q8[:, pages], q8)
        assert torch.equal(compact.scales[:, pages], scales)


@pytest.mark.parametrize(
    "device,first_pass",
    [("cpu", "none"), ("cpu", "int8"), pytest.param("cuda", "none", marks=pytest.mark.gpu)],
)
def test_prompt_kv_reaches_the_cpu_pages_chunk_by_chunk(monkeypatch, device, first_pass):
    """Prompts prefilled 32 tokens per forward, 64 per block boundary, beside decoding rows (so
    a prompt's chunks run over several boundaries, with copies left in flight between them):
    at each join, the request's pages equal its prompt's KV, bit for bit; every request is
    checked, and a request aborted mid-prefill gives back its pages."""
    config = get_preset("tiny-llada2")
    model = build_model(config, device=device, dtype=torch.bfloat16, seed=1)
    checked: list[str] = []
    finish = PromptPrefill.finish

    def finish_and_check(self, req, slot):
        out = finish(self, req, slot)
        _check_pages(self, req)
        checked.append(req.request_id)
        return out

    monkeypatch.setattr(PromptPrefill, "finish", finish_and_check)
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.5, selection_threads=2,
                                 first_pass=first_pass)  # fmt: skip
    eng = make_engine(model, config, cfg, max_batch_size=2, max_seq_len=512,
                      prefill_chunk_tokens=32, max_prefill_tokens=64)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=40, num_denoise_steps=2, ignore_eos=True)
    reqs = [eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), params)
            for n in (300, 45, 400, 7)]  # fmt: skip
    extra = eng.add_request(torch.randint(0, 256, (460,), generator=g).tolist(), params)
    while eng.has_unfinished():
        eng.step()
        prefilling = eng.scheduler.prefilling
        if prefilling is not None and prefilling.request is extra and prefilling.pos >= 128:
            eng.abort(extra)
    eng.close()
    assert sorted(checked) == sorted(r.request_id for r in reqs)
    assert all(len(r.output_ids) == 40 for r in reqs)
    assert extra.output_ids == [] and eng.cpu_pool.num_used_pages == 0


class _Recorder:
    """Keeps every layer's queries of one forward."""

    def __init__(self, inner) -> None:
        self.inner, self.q = inner, {}

    def forward(self, layer_id, q, k, v):
        self.q[layer_id] = q
        return self.inner.forward(layer_id, q, k, v)


@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2"])
def test_first_block_queries_from_the_last_chunk_equal_a_forward_of_their_own(monkeypatch, preset):
    """The first selection's B queries, taken as the last rows of the prompt's last prefill
    forward, equal (to rounding) those of a forward of the first block alone over the prefilled
    prompt, and select the same rows, for prompts whose last piece is a whole chunk, a part of
    one, and a single block."""
    from herald.offload.selection.gpu_topk import select_topk_rows

    config = get_preset(preset)
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=2)
    seen: list[int] = []
    finish = PromptPrefill.finish

    def finish_and_compare(self, req, slot):
        out = finish(self, req, slot)
        core, b = self.core, self.core.block_size
        s = req.layout.num_prefill_tokens
        rec = _Recorder(self.temp)
        self.temp.prepare([s], b)
        core.model(core.batch.fresh_block(req)[0][None], torch.arange(s, s + b)[None], rec)
        k, last = core.budget_for(s), b
        for layer in core.pool.layers:
            got, want = self.first_q[layer][0].float(), rec.q[layer][0].float()
            err = (got - want).abs().max()
            assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (layer, err)
            keys = self.tk[layer][0]
            rows = [select_topk_rows(q[layer][0], keys, s + b, last + b, k)
                    for q in (self.first_q, rec.q)]  # fmt: skip
            assert torch.equal(rows[0].sort(-1).values, rows[1].sort(-1).values), layer
        seen.append(s)
        return out

    monkeypatch.setattr(PromptPrefill, "finish", finish_and_compare)
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.25, selection_threads=2)
    eng = make_engine(model, config, cfg, max_batch_size=3, max_seq_len=512,
                      prefill_chunk_tokens=128)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(max_new_tokens=32, num_denoise_steps=2, ignore_eos=True)
    for n in (256 + 5, 300, 40):  # last piece: a whole 128-token chunk; one block; the prompt
        eng.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), params)
    while eng.has_unfinished():
        eng.step()
    eng.close()
    assert sorted(seen) == [32, 256, 288]
