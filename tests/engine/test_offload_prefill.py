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
