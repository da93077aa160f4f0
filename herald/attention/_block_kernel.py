"""Triton kernel of the block attention (:mod:`herald.attention.block_kernel` describes it).

Imported lazily: only a process that runs the Triton path needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_attention(
    q_ptr,  # [bs, L, Hq, D]
    k_ptr,  # [slots, Hkv, cap, D]
    v_ptr,  # [slots, Hkv, cap, D]
    o_ptr,  # [bs, L, Hq, D]
    prefix_ptr,  # [bs] int32: rows already in the store before this call's tokens
    slot_offset,
    qk_scale,  # head_dim ** -0.5 * log2(e)
    stride_qb,
    stride_ql,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_kn,
    stride_vs,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_ol,
    stride_oh,
    L: tl.constexpr,  # query positions per row
    DRAFT_B: tl.constexpr,  # 0: plain; B: positions [B, 2B) are the draft group
    CAUSAL_B: tl.constexpr,  # 0: plain; B: block-causal over the L positions (a prefill chunk)
    G: tl.constexpr,  # query heads per KV head
    QT: tl.constexpr,  # query positions per program (divides B in draft mode)
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.program_id(2) * QT
    p = tl.load(prefix_ptr + row)
    lo_end, hi_start, hi_end = _visible_keys(p, t0, L, DRAFT_B, CAUSAL_B)
    loop_end = tl.maximum(lo_end, hi_end)

    offs_m = tl.arange(0, QT * G)  # folded query rows: position-major, then head in group
    pos = t0 + offs_m // G
    head = kvh * G + offs_m % G
    offs_d = tl.arange(0, D)
    q = tl.load(_rows(q_ptr, row, pos, head, offs_d, stride_qb, stride_ql, stride_qh))
    slot = (slot_offset + row).to(tl.int64)
    k_base = k_ptr + slot * stride_ks + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh.to(tl.int64) * stride_vh

    m_i = tl.full((QT * G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QT * G,), dtype=tl.float32)
    acc = tl.zeros((QT * G, D), dtype=tl.float32)
    for start in range(0, loop_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < loop_end
        k = tl.load(
            k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
            mask=in_range[None, :],
            other=0.0,
        )  # [D, BLOCK_N]
        s = tl.dot(q, k) * qk_scale
        vis = (offs_n < lo_end) | ((offs_n >= hi_start) & (offs_n < hi_end))
        s = tl.where(vis[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(
            v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :],
            mask=in_range[:, None],
            other=0.0,
        )  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = _rows(o_ptr, row, pos, head, offs_d, stride_ob, stride_ol, stride_oh)
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty))


@triton.jit
def _visible_keys(p, t0, L: tl.constexpr, DRAFT_B: tl.constexpr, CAUSAL_B: tl.constexpr):
    """Keys a tile starting at query position ``t0`` sees: ``[0, lo_end)`` and
    ``[hi_start, hi_end)``, for a row with ``p`` rows already in its store."""
    lo_end = p + L
    hi_start = p * 0
    hi_end = p * 0
    if DRAFT_B > 0:
        draft = t0 >= DRAFT_B  # the tile is the draft group: prefix + the draft rows only
        lo_end = tl.where(draft, p, p + DRAFT_B)  # the block: prefix + block, as a plain step
        hi_start = tl.where(draft, p + DRAFT_B, 0)
        hi_end = tl.where(draft, p + 2 * DRAFT_B, 0)
    if CAUSAL_B > 0:
        lo_end = p + (t0 // CAUSAL_B + 1) * CAUSAL_B  # earlier blocks and the tile's own block
    return lo_end, hi_start, hi_end


@triton.jit
def _rows(base, row, pos, head, offs_d, stride_b, stride_l, stride_h):
    """Pointers to the folded rows (position, head) of batch row ``row`` of a [bs, L, H, D]
    tensor."""
    return (
        base + row.to(tl.int64) * stride_b + pos[:, None] * stride_l
        + head[:, None] * stride_h + offs_d[None, :]
    )  # fmt: skip
