"""The fused Triton MoE (herald.layers.moe_triton): the alignment on the CPU, the kernels in the
Triton interpreter (CPU, float32/float16), and on the GPU at full LLaDA2.0-mini shapes, including
bit-for-bit batch invariance and CUDA-graph replay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from herald.bench.moe import H200_SMEM_BYTES, smem_bytes
from herald.layers.moe import SparseMoE, experts_reference
from herald.layers.moe_triton import (
    BLOCK_K,
    BLOCK_M,
    TILE_TABLE,
    align_by_expert,
    experts_fused,
    fused_available,
    padded_rows,
    tile_configs,
    triton_available,
)


def _routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(1, 8, 32, 4), (37, 4, 8, 16)])
@pytest.mark.parametrize("method", ["sort", "count"])
def test_align_by_expert_groups_rows_in_order_with_padding(
    tokens: int, top_k: int, experts: int, block_m: int, method: str
) -> None:
    idx = _routing(tokens, top_k, experts, seed=tokens)
    rows, tile_expert = align_by_expert(idx, experts, block_m, method=method)
    n = tokens * top_k
    assert rows.numel() == padded_rows(n, experts, block_m)
    assert rows.numel() % block_m == 0 and tile_expert.numel() == rows.numel() // block_m
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n))  # every (token, slot) row exactly once
    flat = idx.reshape(-1)
    seen_experts = []
    for t, e in enumerate(tile_expert.tolist()):
        tile_rows = rows[t * block_m : (t + 1) * block_m]
        tile_rows = tile_rows[tile_rows < n]
        if e < 0:
            assert tile_rows.numel() == 0
            continue
        assert tile_rows.numel() > 0  # no tile of pure padding inside the used range
        assert (flat[tile_rows.long()] == e).all()
        seen_experts.append(e)
    assert seen_experts == sorted(seen_experts)  # experts in order, each group contiguous
    for e in range(experts):
        own = rows[(rows < n)][flat[rows[rows < n].long()] == e]
        assert own.tolist() == sorted(own.tolist())  # (token, slot) order kept within an expert


@pytest.mark.parametrize("seed", range(6))
def test_both_alignments_are_the_same(seed: int) -> None:
    """The sort-free alignment gives the sort's result bit for bit, including skewed routings
    (every row to a few experts) and unused experts."""
    g = torch.Generator().manual_seed(seed)
    tokens, top_k, experts = int(torch.randint(1, 300, (1,), generator=g)), 4, 16
    idx = _routing(tokens, top_k, experts, seed=seed)
    if seed % 2:  # skewed: only experts 0-4
        idx = idx % 5
    for block_m in (1, 4, 16, 64):
        a = align_by_expert(idx, experts, block_m, method="sort")
        b = align_by_expert(idx, experts, block_m, method="count")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="method must be"):
        align_by_expert(idx, experts, method="radix")


def test_tile_configs_keep_the_numerics_fixed_and_fit_in_shared_memory() -> None:
    """Per token count only block_n, warps and stages change: block_m and block_k (the order of
    each row's sum) are 64 for every T, and every table entry fits the H200's shared memory."""
    assert BLOCK_M == BLOCK_K == 64
    limits = [limit for limit, _, _ in TILE_TABLE]
    assert limits[-1] is None and all(isinstance(v, int) for v in limits[:-1])
    assert limits[:-1] == sorted(limits[:-1])  # type: ignore[type-var]
    for tokens in (*range(0, 5000, 7), 512, 513, 1536, 1537, 10**6):
        gate_up, down = tile_configs(tokens)
        for cfg in (gate_up, down):
            assert (cfg.block_m, cfg.block_k) == (64, 64), (tokens, cfg)
    for _, gate_up, down in TILE_TABLE:
        assert smem_bytes(gate_up, "gate_up") <= H200_SMEM_BYTES, gate_up
        assert smem_bytes(down, "down") <= H200_SMEM_BYTES, down
    # The thresholds and configs measured on the H200 (the comment above TILE_TABLE):
    # T -> (gate/up, down) as (block_n, num_warps, num_stages).
    small, mid, large = (
        ((128, 8, 3), (128, 4, 4)),
        ((128, 8, 5), (64, 4, 3)),
        ((256, 8, 3), (256, 8, 5)),
    )
    expected = {1: small, 32: small, 512: small, 513: mid, 1024: mid, 1536: mid, 1537: large}
    expected |= {2560: large, 4096: large}
    for tokens, want in expected.items():
        got = tuple((c.block_n, c.num_warps, c.num_stages) for c in tile_configs(tokens))
        assert got == want, tokens


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from herald.layers.moe import experts_reference
    from herald.layers.moe_triton import TileConfig, experts_fused
    torch.manual_seed(0)
    cfg = TileConfig(block_n=32, num_warps=4, num_stages=1, block_m=16, block_k=32)
    E, H, I = 8, 64, 64
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        wgu = (torch.randn(E, 2 * I, H) / 8).to(dtype)
        wd = (torch.randn(E, H, I) / 8).to(dtype)
        for tokens, top_k in ((1, 4), (37, 4), (9, 1)):
            x = torch.randn(tokens, H).to(dtype)
            idx = torch.stack([torch.randperm(E)[:top_k] for _ in range(tokens)])
            y = experts_fused(x, idx, wgu, wd, gate_up_config=cfg, down_config=cfg)
            ref = experts_reference(x.float(), idx, wgu.float(), wd.float())
            assert y.shape == ref.shape and y.dtype == dtype
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < tol, (dtype, tokens, top_k, err)
    # The default launch configs (tile_configs: block_m = block_k = 64) of each table row.
    E, H, I = 2, 128, 128
    wgu, wd = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 8
    for tokens in (3, 600, 1600):
        x = torch.randn(tokens, H)
        idx = torch.randint(0, E, (tokens, 1))
        y = experts_fused(x, idx, wgu, wd)
        ref = experts_reference(x, idx, wgu, wd)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (tokens, err)
    print("ok")
    """
)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_fused_kernels_match_reference_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def _full_size_moe() -> SparseMoE:
    """LLaDA2.0-mini's MoE block (H 2048, I 512, 256 experts, top-8 of 8 groups keep 4), bf16."""
    moe = SparseMoE(
        2048, 512, 256, 8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        num_shared_experts=1, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.02)
    return moe


@pytest.mark.gpu
@torch.no_grad()
def test_fused_matches_reference_on_cuda_full_size_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_TRITON", "all")  # the fused path is opt-in (herald.env)
    moe = _full_size_moe()
    for tokens in (1, 32, 1024, 4096):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        assert fused_available(x, moe.experts_gate_up)
        assert moe.experts_impl(x) is experts_fused  # auto picks it under HERALD_TRITON=all
        idx, _ = moe.route(x)
        ref = experts_reference(x, idx, moe.experts_gate_up, moe.experts_down).float()
        out = experts_fused(x, idx, moe.experts_gate_up, moe.experts_down).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (tokens, err)


@pytest.mark.gpu
@torch.no_grad()
def test_fused_rows_are_batch_invariant_bit_for_bit() -> None:
    """A token's expert outputs do not depend on which, or how many, tokens share the call."""
    moe = _full_size_moe()
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    idx, _ = moe.route(x)
    full = experts_fused(x, idx, moe.experts_gate_up, moe.experts_down)
    for lo, hi in ((0, 1), (100, 132), (7, 1031), (2048, 2560)):
        part = experts_fused(x[lo:hi], idx[lo:hi], moe.experts_gate_up, moe.experts_down)
        assert torch.equal(part, full[lo:hi]), (lo, hi)


@pytest.mark.gpu
@torch.no_grad()
def test_fused_moe_replays_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static shapes, no host sync: a captured MoE forward replays the eager result for new
    inputs (and so new routings)."""
    monkeypatch.setenv("HERALD_TRITON", "all")
    moe = _full_size_moe()
    x = torch.randn(2560, 2048, device="cuda", dtype=torch.bfloat16)
    moe(x)  # warm-up: compile and first launches outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x)
        with torch.cuda.graph(graph, stream=stream):
            out = moe(x)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed),
                            device="cuda", dtype=torch.bfloat16))  # fmt: skip
        graph.replay()
        assert torch.equal(out, moe(x)), seed
