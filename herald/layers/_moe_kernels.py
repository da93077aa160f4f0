"""Triton kernels of the fused MoE (:mod:`herald.layers.moe_triton` describes the layout).

Imported lazily: only a process that runs the fused path needs Triton. Both kernels take a 2-D
grid (tile, column block); the tile index varies fastest, so the tiles that share an expert's
weight columns run side by side and read them from L2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_up_swiglu(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    act_ptr,  # [P, I] out: silu(x @ gate.T) * (x @ up.T)
    rows_ptr,  # [P] int32 (token, slot) row per position; num_rows marks padding
    tile_expert_ptr,  # [P // BLOCK_M] int32, -1 = unused tile
    num_rows,
    hidden,
    inter,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m)
    valid = row < num_rows
    tok = tl.where(valid, row // TOP_K, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = offs_n < inter
    x_ptrs = x_ptr + tok[:, None].to(tl.int64) * hidden + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * 2 * inter * hidden
    wg_ptrs = w_base + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]  # [BK, BN]
    wu_ptrs = wg_ptrs + inter * hidden
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, hidden, BLOCK_K):  # hidden % BLOCK_K == 0 (checked by the caller)
        a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
        bg = tl.load(wg_ptrs, mask=col_ok[None, :], other=0.0)
        bu = tl.load(wu_ptrs, mask=col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * inter + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def down(
    act_ptr,  # [P, I]
    w_ptr,  # [E, H, I]
    out_ptr,  # [T*K, H] out, row = token * K + slot
    rows_ptr,
    tile_expert_ptr,
    num_rows,
    hidden,
    inter,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.load(rows_ptr + offs_m)
    valid = row < num_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = offs_n < hidden
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * inter + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * hidden * inter
    w_ptrs = w_base + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, inter, BLOCK_K):  # inter % BLOCK_K == 0 (checked by the caller)
        a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    safe_row = tl.where(valid, row, 0)
    out_ptrs = out_ptr + safe_row[:, None].to(tl.int64) * hidden + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
