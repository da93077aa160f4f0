"""HERALD with the int8 copy of K on the model's device (first_pass="int8-gpu"): the scoring's
top-k is the top-k of the int8 importances (checked against a float64 reference, up to its
near-ties), the attention over the selected rows and the tail is softmax attention, the device
copy follows every committed block, and the engine's selections are the rule's on its own KV
(budget 1.0 equals dense: test_offload.py's MODES)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import recorded_engine

from herald.config import OffloadConfig
from herald.kv.compact_keys import quantize_keys
from herald.models.registry import build_model, get_preset
from herald.offload.selection.compact_device import (
    DeviceCompactKeys,
    attend_selected_and_tail,
    select_int8,
)

NEAR_TIE = 1e-4  # relative: importances this close to the k-th are either side's (float32 sums)


def _int8_importance(x: torch.Tensor, keys: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Float64 spec: ``x`` [G, D] query rows of one KV head, ``keys`` [S, D] (quantized to
    int8 and back), ``tail`` [T, D] exact -> importance of the S prefix positions."""
    q8, s = quantize_keys(keys)
    deq = q8.double() * s.double()[:, None]
    both = torch.cat([deq, tail.double()])
    p = torch.softmax(x.double() @ both.T / math.sqrt(x.shape[-1]), dim=-1)
    return p.sum(0)[: keys.shape[0]]


def _check_topk(picked: torch.Tensor, imp: torch.Tensor, k: int) -> None:
    """``picked`` (ascending, -1 padded) holds k positions: every one the spec ranks clearly
    above the k-th, none it ranks clearly below."""
    got = picked[picked >= 0]
    assert got.numel() == k and bool((got[1:] > got[:-1]).all())
    if k == 0:
        return
    kth = torch.topk(imp, k).values[-1]
    must = set((imp > kth * (1 + NEAR_TIE)).nonzero().flatten().tolist())
    may = set((imp >= kth * (1 - NEAR_TIE)).nonzero().flatten().tolist())
    chosen = set(got.tolist())
    assert must <= chosen <= may


@pytest.mark.parametrize("chunk_bytes", [None, 1])  # 1: one request per chunk
def test_select_int8_is_the_int8_importance_top_k(chunk_bytes, monkeypatch) -> None:
    import herald.offload.selection.compact_device as cd

    if chunk_bytes is not None:
        monkeypatch.setattr(cd, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    hkv, gq, d, t, max_len = 2, 4, 32, 8, 300
    prefix = [250, 0, 37, 300, 16]
    budgets = [13, 0, 37, 40, 1]  # a full selection (k = prefix), none, one
    n = len(prefix)
    store = DeviceCompactKeys([3], n, hkv, max_len, d, torch.device("cpu"))
    keys = torch.randn(n, hkv, max_len, d, generator=g).bfloat16()
    for i in range(n):
        store.write(3, i, 0, keys[i])
    q = (2 * torch.randn(n, hkv * gq, d, generator=g)).bfloat16()
    tail = torch.randn(n, hkv, t, d, generator=g).bfloat16()
    idx = select_int8(q, store, 3, 0, prefix, budgets, tail)
    assert idx.dtype == torch.int32 and idx.shape == (n, hkv, max(budgets))
    for i in range(n):
        for h in range(hkv):
            x = q[i, h * gq : (h + 1) * gq]
            imp = _int8_importance(x, keys[i, h, : prefix[i]], tail[i, h])
            _check_topk(idx[i, h], imp, budgets[i])
    assert torch.equal(idx[2, :, :37], torch.arange(37).expand(hkv, 37).int())  # k = prefix


def test_select_int8_keeps_most_of_the_exact_top_k() -> None:
    """Against the exact (bf16 keys) importance: the int8 rule is approximate, not arbitrary."""
    g = torch.Generator().manual_seed(1)
    hkv, gq, d, s, k = 1, 4, 64, 2000, 100
    store = DeviceCompactKeys([0], 1, hkv, s, d, torch.device("cpu"))
    keys = torch.randn(1, hkv, s, d, generator=g).bfloat16()
    store.write(0, 0, 0, keys[0])
    q = (3 * torch.randn(1, gq, d, generator=g)).bfloat16()
    tail = torch.randn(1, hkv, 4, d, generator=g).bfloat16()
    idx = select_int8(q, store, 0, 0, [s], [k], tail)
    both = torch.cat([keys[0, 0], tail[0, 0]]).double()
    exact = torch.softmax(q[0].double() @ both.T / math.sqrt(d), -1).sum(0)[:s]
    top = set(torch.topk(exact, k).indices.tolist())
    assert len(top & set(idx[0, 0].tolist())) >= 0.9 * k


def test_attend_selected_and_tail_is_softmax_attention() -> None:
    g = torch.Generator().manual_seed(2)
    n, hkv, gq, m, t, d = 3, 2, 2, 9, 5, 16
    q = torch.randn(n, hkv * gq, d, generator=g).bfloat16()
    ks, vs = (torch.randn(n, hkv, m, d, generator=g).bfloat16() for _ in range(2))
    kt, vt = (torch.randn(n, hkv, t, d, generator=g).bfloat16() for _ in range(2))
    counts = [9, 0, 4]
    pad = torch.arange(m)[None, :] >= torch.tensor(counts)[:, None]
    ks[1] = float("nan")  # excluded rows never reach the output
    vs[1] = float("nan")
    out = attend_selected_and_tail(q, ks, vs, pad, kt, vt)
    for i, c in enumerate(counts):
        for h in range(hkv * gq):
            kv = h // gq
            kk = torch.cat([ks[i, kv, :c], kt[i, kv]]).double()
            vv = torch.cat([vs[i, kv, :c], vt[i, kv]]).double()
            p = torch.softmax(q[i, h].double() @ kk.T / math.sqrt(d), -1)
            torch.testing.assert_close(out[i, h].double(), p @ vv, rtol=1e-5, atol=1e-5)


def test_store_write_move_and_blocks() -> None:
    g = torch.Generator().manual_seed(3)
    store = DeviceCompactKeys([2, 3], 3, 2, 64, 8, torch.device("cpu"))
    blocks = torch.randn(2, 3, 2, 16, 8, generator=g).bfloat16()  # [L', n, Hkv, B, D]
    store.write_blocks(blocks, [0, 16, 48])
    q8, s = quantize_keys(blocks)
    assert torch.equal(store.q8[3][1, :, 16:32], q8[1, 1])
    assert torch.equal(store.scales[2][2, :, 48:64], s[0, 2])
    store.move_slot(2, 0, 64)
    assert torch.equal(store.q8[2][0], store.q8[2][2])
    assert store.nbytes == 2 * 3 * 2 * 64 * (8 + 4)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="output_mode='selected'"):
        OffloadConfig.for_mode("herald", output_mode="full", first_pass="int8-gpu")
    with pytest.raises(ValueError, match="representative query"):
        OffloadConfig.for_mode("mage", first_pass="int8-gpu")
    with pytest.raises(ValueError, match="first_pass must be one of"):
        OffloadConfig.for_mode("herald", first_pass="int4")


@pytest.mark.parametrize(
    "lookahead,device",
    [("draft", "cpu"), ("off", "cpu"), pytest.param("draft", "cuda", marks=pytest.mark.gpu)],
)
def test_engine_selects_by_the_int8_rule_and_the_copy_follows_the_kv(
    lookahead: str, device: str
) -> None:
    """On CUDA with Triton the selected rows come by the GPU fetch from device positions."""
    config = get_preset("tiny-llada2")
    model = build_model(config, device=device, dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (100, 40)]
    cfg = OffloadConfig.for_mode(
        "herald", kv_budget=0.25, lookahead=lookahead, first_pass="int8-gpu"
    )
    eng, recorder = recorded_engine(model, config, cfg, prompts)
    pool, hkv = eng.cpu_pool, config.num_kv_heads
    store = eng.policy.keys  # type: ignore[attr-defined]
    assert isinstance(store, DeviceCompactKeys) and pool.compact is None
    # its bytes count in the engine's KV usage and its start-up line names it
    assert eng.usage().gpu_kv_bytes == eng.pool.num_bytes + eng.dense.num_bytes + store.nbytes
    assert "first pass int8-gpu: int8 copy of K" in eng.describe()
    try:
        checked, synced = _check_engine(eng, recorder, store, hkv, config.head_dim, device)
    finally:
        eng.close()  # (a failed check must not leave the pool's pinned pages registered)
    assert checked >= 4 and synced >= 4


def _check_engine(eng, recorder, store, hkv: int, head_dim: int, device: str) -> tuple[int, int]:
    pool, b = eng.cpu_pool, eng.block_size
    checked, seen, synced = 0, set(), 0
    while eng.has_unfinished():
        eng.step()
        for i, (req, st) in enumerate(zip(eng.batch.requests, eng.batch.starts(), strict=True)):
            pages = torch.tensor(pool.pages(req.request_id)[: st // b], dtype=torch.long)
            k = pool.storage[:, 0, pages].transpose(1, 2)  # [L', Hkv, pages, B, D]
            k = k.reshape(k.shape[0], hkv, -1, head_dim)
            # quantized where the copy is (CUDA divides by a scalar as a product with its
            # reciprocal: last-bit differences from the CPU's quotient)
            q8, s = quantize_keys(k.to(device))
            for li, layer in enumerate(store.layers):  # positions [0, block start)
                assert torch.equal(store.q8[layer][i, :, :st], q8[li])
                assert torch.equal(store.scales[layer][i, :, :st], s[li])
            synced += 1
        for job in recorder.jobs:
            if id(job) in seen or not job.done.is_set():
                continue
            seen.add(id(job))
            for layer, (q, idx) in job.recorded.items():
                pl = layer - eng.num_dense
                for r, pre in enumerate(job.prefix_lens):
                    npg = pre // b  # the prefix's pages; the tail from the job (device)
                    pg = job.page_table[r, :npg].long()
                    kk = pool.k_pages(pl)[pg].transpose(0, 1).reshape(hkv, npg * b, -1)
                    tail = job.tail_kv[store.layers.index(layer), 0, r].cpu()  # [Hkv, B, D]
                    k_sel = job.num_selected[r]
                    gq = q.shape[2] // hkv
                    for h in range(hkv):
                        x = q[r, 0, h * gq : (h + 1) * gq]
                        # the spec quantizes where the copy is (as the store check above)
                        imp = _int8_importance(
                            x.to(device), kk[h].to(device), tail[h].to(device)
                        ).cpu()
                        _check_topk(idx[r, h].cpu(), imp, k_sel)
                    checked += 1
    return checked, synced


def test_generate_flag_reaches_the_engine(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``herald generate --first-pass int8-gpu``: the device scoring runs, and at budget 1.0
    (every position selected) the tokens are dense's."""
    import herald.offload.retrieval_device as rd
    from herald.cli import main

    calls = []
    real = rd.select_int8
    monkeypatch.setattr(rd, "select_int8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    base = ["generate", "--prompt", "def main():\n" * 20, "--max-new-tokens", "64", "--quiet"]
    assert main([*base, "--mode", "dense", "--dtype", "bf16"]) == 0
    dense = capsys.readouterr().out
    argv = [*base, "--mode", "herald", "--kv-budget", "1.0", "--first-pass", "int8-gpu"]
    assert main(argv) == 0
    assert capsys.readouterr().out == dense and calls


_TRITON_CASES = """
import torch
from herald.offload.selection.compact_device import int8_scores
g = torch.Generator().manual_seed(5)
for n, hkv, gq, d, s_max, lens in [(3, 2, 4, 32, 150, [150, 0, 77]), (1, 1, 1, 16, 64, [1]),
                                    (2, 4, 2, 128, 130, [129, 130])]:
    x = torch.randn(n, hkv, gq, d, generator=g)
    q8 = torch.randint(-127, 128, (n, hkv, s_max + 7, d), generator=g).to(torch.int8)
    sc = torch.rand(n, hkv, s_max + 7, generator=g)
    ln = torch.tensor(lens)
    got = int8_scores(x, q8, sc, ln, s_max, d ** -0.5)  # the interpreter takes the kernel
    ref = x.double() @ q8[:, :, :s_max].double().transpose(-1, -2)
    ref = ref * sc[:, :, None, :s_max].double() * d ** -0.5
    live = (torch.arange(s_max)[None, :] < ln[:, None])[:, None, None, :].expand_as(ref)
    assert torch.isinf(got[~live]).all() and (got[~live] < 0).all()
    torch.testing.assert_close(got[live].double(), ref[live], rtol=1e-5, atol=1e-4)
# a head_dim that is no power of two takes the PyTorch path
x, q8, sc = torch.randn(1, 1, 2, 48), torch.ones(1, 1, 9, 48, dtype=torch.int8), torch.ones(1, 1, 9)
got = int8_scores(x, q8, sc, torch.tensor([9]), 9, 1.0)
torch.testing.assert_close(got, x.sum(-1, keepdim=True).expand(1, 1, 2, 9))
print("ok")
"""


def test_int8_score_kernel_in_the_triton_interpreter() -> None:
    import os
    import subprocess
    import sys

    from herald.layers.moe_triton import triton_available

    if not triton_available():
        pytest.skip("Triton not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _TRITON_CASES], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_int8_scores_torch_path_masks_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import herald.offload.selection.compact_device as cd

    monkeypatch.setattr(cd, "CHUNK_BYTES", 1)  # one request per chunk
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 2, 16, generator=g)
    q8 = torch.randint(-127, 128, (3, 2, 40, 16), generator=g).to(torch.int8)
    sc = torch.rand(3, 2, 40, generator=g)
    got = cd.int8_scores(x, q8, sc, torch.tensor([30, 0, 5]), 30, 0.25)
    ref = (x @ q8[:, :, :30].float().transpose(-1, -2)) * sc[:, :, None, :30] * 0.25
    assert torch.isinf(got[1]).all() and torch.isinf(got[2, :, :, 5:]).all()
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[2, :, :, :5], ref[2, :, :, :5])
