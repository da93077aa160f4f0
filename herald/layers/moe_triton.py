"""Fused MoE experts in Triton: rows aligned per expert on the GPU, two grouped GEMMs with fused
epilogues. Same contract as :func:`herald.layers.moe.experts_reference` (docs/MODELS.md §6).

For T tokens routed to K experts each (E experts, hidden H, expert intermediate I):

1. **align** (:func:`align_by_expert`, torch ops, no host sync, static shapes): the T*K (token,
   slot) rows sorted by expert (stable) and each expert's group padded to a multiple of
   ``BLOCK_M``, so every tile of ``BLOCK_M`` positions belongs to one expert. ``rows`` [P] int32
   holds the (token, slot) row of each position (``T*K`` marks padding) and ``tile_expert``
   [P / BLOCK_M] int32 the expert of each tile (-1 past the last one). P depends on T, K and E
   only, so the launches have the same shapes for every routing (CUDA-graph safe).
2. **gate/up + SwiGLU**: per tile, the x rows gathered by token, both halves of the expert's
   ``w_gate_up`` [2I, H] multiplied in one pass (two float32 accumulators), and
   ``silu(gate) * up`` written once in the model dtype to ``act`` [P, I]. Neither the sorted
   copy of x nor the [T*K, 2I] gate/up product exists in memory.
3. **down**: the ``act`` tile times the expert's ``w_down`` [H, I], stored straight to its
   (token, slot) row of ``out`` [T*K, H]: the unsort is the store's address, not a gather.

The weighted sum over the K slots stays in :func:`herald.layers.moe.combine_experts` (float32, in
slot order): an atomic combine inside the down GEMM would add the slots in whatever order the
tiles finish, so a token's rounding would change from run to run.

Batch invariance: a row's result depends only on its token and its expert. Every row's sum over
H (or I) runs in ``BLOCK_K`` chunks in one fixed order, never split across programs, with the
same ``BLOCK_M`` and ``BLOCK_K`` for every token count; the tuned choices (tile width over N,
warps, pipeline stages), which :func:`tile_configs` picks per token count from a small table
measured on the H200 (:data:`TILE_TABLE`), change how the work is spread, not the order of any
row's sum. The GPU tests check it bit for bit, across the table's rows.

The GEMMs here differ from the reference in one rounding: SwiGLU is applied to the float32
accumulators, where the reference rounds gate and up to the model dtype first.

``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (float16/float32; the interpreter's bf16
dot is not exact), which the CPU tests use with small tiles.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from herald.env import settings

BLOCK_M = 64  # rows per tile: fixed (see batch invariance above)
BLOCK_K = 64  # reduction chunk: fixed (see batch invariance above)


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of one GEMM. ``block_m`` and ``block_k`` fix the numerics; the rest
    only the speed."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M
    block_k: int = BLOCK_K


@functools.cache
def triton_available() -> bool:
    """Triton imports (it ships with CUDA builds of torch; CPU CI may lack it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """The Triton interpreter is on (kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_enabled(everywhere: bool = False) -> bool:
    """Triton is present and ``HERALD_TRITON`` (:mod:`herald.env`) allows it: not ``0``, and
    ``all`` when ``everywhere`` (the kernels not yet measured faster than the library path)."""
    mode = settings().triton
    return mode != "0" and (mode == "all" or not everywhere) and triton_available()


def fused_available(x: torch.Tensor, w_gate_up: torch.Tensor) -> bool:
    """True when the fused path suits ``x``: CUDA bf16/fp16, ``HERALD_TRITON=all`` (on the H200
    it measured no faster than ``grouped_mm`` at the engines' token counts, results/forward/),
    H and I multiples of ``BLOCK_K``."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and triton_enabled(True)):
        return False
    hidden, inter = w_gate_up.shape[2], w_gate_up.shape[1] // 2
    return hidden % BLOCK_K == 0 and inter % BLOCK_K == 0


def padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Positions after padding every expert's group to ``block_m``: an upper bound that holds for
    any routing of ``num_rows`` rows over ``num_experts`` experts."""
    bound = num_rows + num_experts * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_by_expert(
    idx: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, *, method: str = "sort"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) rows grouped by expert, each group padded to ``block_m``.

    Args:
        idx: [T, K] int64 expert ids.
        method: how a row finds its place in its expert's group: ``"sort"`` (a stable sort of
            the ids) or ``"count"`` (no sort: a running count of each expert's rows, a cumsum
            over a [T*K, E] one-hot). The same result either way; which is faster on the GPU
            is for ``python -m herald.bench.moe --sweep`` to show.

    Returns:
        ``rows`` [P] int32 (row ``t*K + k`` at each position, ``T*K`` at padding) and
        ``tile_expert`` [P // block_m] int32 (-1 for tiles past the last expert's group), with
        P = :func:`padded_rows`. Within an expert, rows keep their (token, slot) order.
    """
    if method not in ("sort", "count"):
        raise ValueError(f"method must be 'sort' or 'count', got {method!r}")
    num_rows = idx.numel()
    flat = idx.reshape(-1)
    dev = idx.device
    # Per row to place: its expert, its rank in that expert's group and its (token, slot) row.
    if method == "sort":
        counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        order = flat.to(torch.int32).argsort(stable=True)  # int32 keys halve the radix passes
        expert = flat[order]
        rank = torch.arange(num_rows, device=dev) - (counts.cumsum(0) - counts)[expert]
        row = order.to(torch.int32)
    else:  # a row's rank: the earlier rows routed to its expert (inclusive cumsum, minus one)
        onehot = torch.nn.functional.one_hot(flat, num_experts).to(torch.int32)
        running = onehot.cumsum(0, dtype=torch.int32)  # [rows, E]: each expert's count so far
        counts = onehot.sum(0, dtype=torch.int64)
        expert = flat
        rank = running.gather(1, flat[:, None]).squeeze(1).to(torch.int64) - 1
        row = torch.arange(num_rows, device=dev, dtype=torch.int32)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    total = padded_rows(num_rows, num_experts, block_m)
    rows = torch.full((total,), num_rows, dtype=torch.int32, device=dev)
    rows[pad_start[expert] + rank] = row
    tile_start = torch.arange(0, total, block_m, device=dev)
    tile_expert = torch.searchsorted(pad_end, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return rows, tile_expert.to(torch.int32)


# Launch configs per token count, measured on the H200 for LLaDA2.0-mini's shapes (E 256, top-8,
# H 2048, I 512, bf16; ``python -m herald.bench.moe --sweep --sweep-block-m 64 --sweep-block-k 64``,
# each GEMM's launch timed alone). Best gate/up and down launch (ms) at block_m = block_k = 64:
#   T   32: gate_up n128 w8 s3 0.165,                  down n128 w4 s4 0.085
#   T 1024: gate_up n128 w8 s5 0.270 (n256 w8 s3 same), down n64  w4 s3 0.154
#   T 2560: gate_up n256 w8 s3 0.362,                  down n256 w8 s5 0.244
#   T 4096: gate_up n256 w8 s3 0.415,                  down n256 w8 s5 0.307
# With the T 32 pair at every T (the one global config before this table), the whole of
# experts_fused took 0.446 / 0.636 / 0.827 / 0.991 ms at T 32 / 1024 / 2560 / 4096.
# Rows: (largest token count, gate/up config, down config); the last row takes every larger T.
# Only block_n, warps and stages vary: block_m and block_k stay BLOCK_M and BLOCK_K for every T
# (batch invariance), and every config fits the H200's 232,448 B of shared memory per block
# (herald.bench.moe.smem_bytes; tests/models/test_moe_triton.py checks both). The choice depends
# on the token count alone, which is static under CUDA-graph capture.
TILE_TABLE: tuple[tuple[int | None, TileConfig, TileConfig], ...] = (
    (
        512,
        TileConfig(block_n=128, num_warps=8, num_stages=3),
        TileConfig(block_n=128, num_warps=4, num_stages=4),
    ),
    (
        1536,
        TileConfig(block_n=128, num_warps=8, num_stages=5),
        TileConfig(block_n=64, num_warps=4, num_stages=3),
    ),
    (
        None,
        TileConfig(block_n=256, num_warps=8, num_stages=3),
        TileConfig(block_n=256, num_warps=8, num_stages=5),
    ),
)


def tile_configs(num_tokens: int) -> tuple[TileConfig, TileConfig]:
    """The (gate/up, down) launch configs of :data:`TILE_TABLE` for ``num_tokens`` tokens."""
    for limit, gate_up, down in TILE_TABLE:
        if limit is None or num_tokens <= limit:
            # block_m and block_k fix each row's sum: one value for every token count.
            assert gate_up.block_m == down.block_m == BLOCK_M
            assert gate_up.block_k == down.block_k == BLOCK_K
            return gate_up, down
    raise AssertionError("the last row of TILE_TABLE takes every token count")


def experts_fused(
    x: torch.Tensor,
    idx: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    gate_up_config: TileConfig | None = None,
    down_config: TileConfig | None = None,
) -> torch.Tensor:
    """Every (token, slot) expert output: [T, H] x [T, K] ids -> [T, K, H] in ``x.dtype``.

    ``w_gate_up`` [E, 2I, H] (gate rows then up rows), ``w_down`` [E, H, I], contiguous. No host
    sync. The configs default to :func:`tile_configs` for T tokens; tests pass small tiles.
    """
    default_gu, default_dn = tile_configs(idx.shape[0])
    gu = gate_up_config or default_gu
    dn = down_config or default_dn
    if gu.block_m != dn.block_m:
        raise ValueError("both GEMMs must use the same block_m (one alignment)")
    num_tokens, top_k = idx.shape
    x = x.contiguous()
    rows, tile_expert = align_by_expert(idx, w_gate_up.shape[0], gu.block_m)
    act = launch_gate_up(x, w_gate_up, rows, tile_expert, top_k, gu)
    out = launch_down(act, w_down, rows, tile_expert, num_tokens * top_k, dn)
    return out.view(num_tokens, top_k, w_gate_up.shape[2])


def launch_gate_up(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    rows: torch.Tensor,
    tile_expert: torch.Tensor,
    top_k: int,
    cfg: TileConfig,
) -> torch.Tensor:
    """The gate/up GEMM with its SwiGLU epilogue over rows aligned by :func:`align_by_expert`
    (with ``cfg.block_m``): ``act`` [P, I] in ``x.dtype``. Separate so the benchmark can time
    each GEMM alone."""
    from herald.layers import _moe_kernels as kern

    hidden, inter = w_gate_up.shape[2], w_gate_up.shape[1] // 2
    act = x.new_empty(rows.numel(), inter)
    kern.gate_up_swiglu[(tile_expert.numel(), -(-inter // cfg.block_n))](
        x, w_gate_up, act, rows, tile_expert, x.shape[0] * top_k, hidden, inter,
        **_meta(cfg, TOP_K=top_k),
    )  # fmt: skip
    return act


def launch_down(
    act: torch.Tensor,
    w_down: torch.Tensor,
    rows: torch.Tensor,
    tile_expert: torch.Tensor,
    num_rows: int,
    cfg: TileConfig,
) -> torch.Tensor:
    """The down GEMM, each row stored at its (token, slot) row: ``out`` [num_rows, H]."""
    from herald.layers import _moe_kernels as kern

    hidden, inter = w_down.shape[1], w_down.shape[2]
    out = act.new_empty(num_rows, hidden)
    kern.down[(tile_expert.numel(), -(-hidden // cfg.block_n))](
        act, w_down, out, rows, tile_expert, num_rows, hidden, inter, **_meta(cfg)
    )
    return out


def _meta(cfg: TileConfig, **extra: Any) -> dict[str, Any]:
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        **extra,
    }
