"""The Triton block attention (herald.attention.block_kernel) against SDPA with the slot
backend's masks: in the Triton interpreter on the CPU, and on the GPU in bf16 with bit-for-bit
batch invariance, the draft group's block half equal to a plain step, and CUDA-graph replay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from herald.attention.masks import block_causal_chunk_mask, draft_group_mask, key_mask
from herald.attention.sdpa import sdpa_folded, sdpa_gqa
from herald.layers.moe_triton import triton_available


def _reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: torch.Tensor,
    slot0: int,
    draft: int,
    causal: int = 0,
) -> torch.Tensor:
    bs, length = q.shape[:2]
    kv_len = int(prefix.max()) + length
    keys = k[slot0 : slot0 + bs, :, :kv_len].float()
    vals = v[slot0 : slot0 + bs, :, :kv_len].float()
    if causal:
        rows = []
        for i in range(bs):
            mask = block_causal_chunk_mask(int(prefix[i]), length, causal, kv_len, q.device)
            rows.append(sdpa_gqa(q[i : i + 1].float(), keys[i : i + 1], vals[i : i + 1], mask))
        return torch.cat(rows)
    if not draft:
        return sdpa_folded(q.float(), keys, vals, key_mask(prefix, length, kv_len))
    qb, qd = q[:, :draft].float().contiguous(), q[:, draft:].float().contiguous()
    ob = sdpa_folded(qb, keys, vals, key_mask(prefix, draft, kv_len))
    od = sdpa_folded(qd, keys, vals, draft_group_mask(prefix, draft, kv_len))
    return torch.cat([ob, od], dim=1)


def _general_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: torch.Tensor, slot0: int,
    block: int, block_n: int, rows: int,
) -> torch.Tensor:  # fmt: skip
    """A block-causal chunk through the general kernel (per-key visibility tests, the chunk
    length a compile-time constant), which prefill chunks ran before their own kernel."""
    import math

    from herald.attention import _block_kernel as kern
    from herald.attention.block_kernel import query_tile

    bs, length, hq, d = q.shape
    hkv = k.shape[1]
    qt = query_tile(hq, hkv, length, block, rows)
    out = torch.empty_like(q)
    kern.block_attention[(bs, hkv, length // qt)](
        q, k, v, out, prefix.int(), slot0, d**-0.5 * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        L=length, DRAFT_B=0, CAUSAL_B=block, G=hq // hkv, QT=qt, D=d, BLOCK_N=block_n,
    )  # fmt: skip
    return out


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_block_kernel import _general_causal, _reference
    from herald.attention.block_kernel import block_attention
    torch.manual_seed(0)
    hq, hkv, d, cap, b = 8, 2, 32, 200, 16
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 3e-3)):
        k = torch.randn(5, hkv, cap, d).to(dtype)
        v = torch.randn(5, hkv, cap, d).to(dtype)
        prefix = torch.tensor([0, 37, 150])
        for draft in (0, b):
            length = 2 * b if draft else b
            q = torch.randn(3, length, hq, d).to(dtype)
            out = block_attention(q, k, v, prefix.int(), slot_offset=1, draft_block=draft,
                                  block_n=16)
            ref = _reference(q, k, v, prefix, 1, draft)
            err = (out.float() - ref).abs().max().item()
            assert out.dtype == dtype and err < tol, (dtype, draft, err)
            # keys split in chunks of 32 (7 over the capacity, some past every row's keys;
            # a draft group's chunk can hold none of its visible keys)
            split = block_attention(q, k, v, prefix.int(), slot_offset=1, draft_block=draft,
                                    block_n=16, split_keys=32)
            err = (split.float() - ref).abs().max().item()
            assert split.dtype == dtype and err < tol, (dtype, draft, "split", err)
            for i in range(3):  # a row alone in its slot: the same bits as in the batch
                alone = block_attention(q[i : i + 1], k, v, prefix[i : i + 1].int(),
                                        slot_offset=1 + i, draft_block=draft, block_n=16,
                                        split_keys=32)
                assert torch.equal(alone, split[i : i + 1]), (dtype, draft, i)
        q = torch.randn(3, 3 * b, hq, d).to(dtype)  # a block-causal prefill chunk of 3 blocks
        out = block_attention(q, k, v, prefix.int(), slot_offset=1, causal_block=b, block_n=16)
        err = (out.float() - _reference(q, k, v, prefix, 1, 0, causal=b)).abs().max().item()
        assert err < tol, (dtype, "causal", err)
        # the prefill kernel does the general kernel's operations (the interpreter fuses no
        # multiply-add: the same bits), for any chunk length and tile; keys ending mid-chunk
        # (37 + 16 rows), and in the store's last slot up to its last row (168 + 32 = 200)
        last = torch.tensor([0, 37, 168])
        for length, rows, bn, pre, s0 in ((3 * b, 16, 16, prefix, 1), (b, 8, 32, prefix, 1),
                                          (2 * b, 32, 16, last, 2)):
            qc = torch.randn(3, length, hq, d).to(dtype)
            fast = block_attention(qc, k, v, pre.int(), slot_offset=s0, causal_block=b,
                                   block_n=bn, rows=rows)
            general = _general_causal(qc, k, v, pre, s0, b, bn, rows)
            assert torch.equal(fast, general), (dtype, length, rows, bn)
            ref = _reference(qc, k, v, pre, s0, 0, causal=b)
            assert (fast.float() - ref).abs().max().item() < tol, (dtype, length, "ref")
    print("ok")
    """
)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_block_attention_matches_sdpa_in_the_triton_interpreter() -> None:
    script = _INTERPRETER_SCRIPT.format(tests=os.path.dirname(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def _store(slots: int, cap: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (slots, 4, cap, 128)
    k = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    return k, v


@pytest.mark.gpu
@torch.no_grad()
def test_block_attention_matches_sdpa_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaDA2.0-mini heads (16 query, 4 KV, 128 dim), sparse-pool and dense lengths (the
    9,000-row store is above SMALL_STORE_KEYS: the kernel serves it only with HERALD_TRITON=all),
    keys unsplit and split in chunks of 4,096."""
    from herald.attention.block_kernel import (
        SMALL_STORE_KEYS,
        block_attention,
        block_attention_available,
    )

    q_small = torch.empty(1, 32, 16, 128, device="cuda", dtype=torch.bfloat16)
    small = torch.empty(1, 4, SMALL_STORE_KEYS, 128, device="cuda", dtype=torch.bfloat16)
    big = torch.empty(1, 4, SMALL_STORE_KEYS + 1, 128, device="cuda", dtype=torch.bfloat16)
    assert block_attention_available(q_small, small)  # the default: sparse-pool sized stores
    assert not block_attention_available(q_small, big)
    # prefill chunks: the kernel on any store by default (auto) and with triton, unless
    # HERALD_TRITON=0; never with sdpa
    assert block_attention_available(q_small, big, prefill=True)
    monkeypatch.setenv("HERALD_PREFILL_ATTENTION", "triton")
    assert block_attention_available(q_small, big, prefill=True)
    monkeypatch.setenv("HERALD_TRITON", "0")
    assert not block_attention_available(q_small, big, prefill=True)
    monkeypatch.setenv("HERALD_PREFILL_ATTENTION", "auto")
    assert not block_attention_available(q_small, big, prefill=True)
    monkeypatch.setenv("HERALD_TRITON", "all")
    monkeypatch.setenv("HERALD_PREFILL_ATTENTION", "sdpa")
    assert not block_attention_available(q_small, big, prefill=True)
    monkeypatch.setenv("HERALD_PREFILL_ATTENTION", "auto")
    monkeypatch.setenv("HERALD_TRITON", "all")  # from here on: the kernel on every store
    assert block_attention_available(q_small, big, prefill=True)

    k, v = _store(8, 9000)
    prefix = torch.tensor([0, 1, 1703, 511, 8000, 4096, 33, 7000], device="cuda")
    for draft in (0, 32):
        length = 64 if draft else 32
        q = torch.randn(8, length, 16, 128, device="cuda", dtype=torch.bfloat16)
        assert block_attention_available(q, k)
        ref = _reference(q, k, v, prefix, 0, draft)
        for split in (0, 4096):
            out = block_attention(q, k, v, prefix.int(), draft_block=draft, split_keys=split)
            assert (out.float() - ref).abs().max().item() < 2e-2, (draft, split)
    q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)  # prefill chunks
    pre = torch.tensor([0, 4096], device="cuda")
    ref = _reference(q, k, v, pre, 0, 0, causal=32)
    out = block_attention(q, k, v, pre.int(), causal_block=32)
    assert (out.float() - ref).abs().max().item() < 2e-2
    # the prefill kernel against the general kernel (compiled, its unmasked chunks may fuse a
    # multiply-add the general kernel's masking prevents: close, not always equal bits)
    general = _general_causal(q, k, v, pre, 0, 32, 64, 64)
    assert (out.float() - general.float()).abs().max().item() < 1e-2
    big = block_attention(q, k, v, pre.int(), causal_block=32, rows=128, block_n=128, num_warps=8)
    assert (big.float() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1024])  # one program per row's keys; keys in chunks
@torch.no_grad()
def test_block_attention_is_batch_invariant_and_the_draft_block_equals_a_plain_step(
    split: int,
) -> None:
    from herald.attention.block_kernel import block_attention

    k, v = _store(6, 6000, seed=1)
    prefix = torch.tensor([5000, 17, 1703, 2048, 64, 4095], device="cuda", dtype=torch.int32)
    q = torch.randn(6, 64, 16, 128, device="cuda", dtype=torch.bfloat16)
    plain = block_attention(q[:, :32], k, v, prefix, split_keys=split)
    draft = block_attention(q, k, v, prefix, draft_block=32, split_keys=split)
    assert torch.equal(draft[:, :32], plain)  # the draft never changes the block's numbers
    for i in range(6):  # each row alone, in its own slot, equals the row in the batch
        alone = block_attention(
            q[i : i + 1, :32], k, v, prefix[i : i + 1], slot_offset=i, split_keys=split
        )
        assert torch.equal(alone, plain[i : i + 1]), i
    if split:
        ref = _reference(q, k, v, prefix.long(), 0, 32)
        assert (draft.float() - ref).abs().max().item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0, 1024])
@torch.no_grad()
def test_block_attention_replays_in_a_cuda_graph_for_new_lengths(split: int) -> None:
    from herald.attention.block_kernel import block_attention

    k, v = _store(4, 4096, seed=2)
    prefix = torch.tensor([10, 200, 3000, 64], device="cuda", dtype=torch.int32)
    q = torch.randn(4, 32, 16, 128, device="cuda", dtype=torch.bfloat16)
    block_attention(q, k, v, prefix, split_keys=split)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block_attention(q, k, v, prefix, split_keys=split)
    for new in ([11, 4000, 0, 2047], [3000, 3000, 3000, 3000]):
        prefix.copy_(torch.tensor(new, device="cuda", dtype=torch.int32))
        graph.replay()
        assert torch.equal(out, block_attention(q, k, v, prefix, split_keys=split)), new


def test_prefill_attention_switch() -> None:
    """HERALD_PREFILL_ATTENTION: auto by default, case-insensitive, an unknown value named; on
    CPU tensors the kernel is never chosen, whatever the switch says."""
    from herald.attention.block_kernel import block_attention_available
    from herald.env import parse

    assert parse({}).prefill_attention == "auto"
    assert parse({"HERALD_PREFILL_ATTENTION": " Triton "}).prefill_attention == "triton"
    with pytest.raises(ValueError, match="HERALD_PREFILL_ATTENTION='flash'"):
        parse({"HERALD_PREFILL_ATTENTION": "flash"})
    q = torch.zeros(1, 64, 16, 128, dtype=torch.bfloat16)
    store = torch.zeros(1, 4, 256, 128, dtype=torch.bfloat16)
    assert not block_attention_available(q, store, prefill=True)
