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

    offs_m, pos, head, offs_d, q, k_base, v_base = _load_tile(
        q_ptr, k_ptr, v_ptr, row, kvh, t0, slot_offset, stride_qb, stride_ql, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh, QT * G, G, D,
    )  # fmt: skip

    m_i, l_i, acc = _attend_keys(
        q, k_base, v_base, offs_d, 0, loop_end, lo_end, hi_start, hi_end, qk_scale,
        stride_kn, stride_vn, QT * G, D, BLOCK_N,
    )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptrs = _rows(o_ptr, row, pos, head, offs_d, stride_ob, stride_ol, stride_oh)
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["slot_offset"])
def block_causal_prefill(
    q_ptr,  # [bs, L, Hq, D]
    k_ptr,  # [slots, Hkv, cap, D]
    v_ptr,  # [slots, Hkv, cap, D]
    o_ptr,  # [bs, L, Hq, D]
    prefix_ptr,  # [bs] int32: rows already in the store before this chunk
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
    CAUSAL_B: tl.constexpr,  # the diffusion block: QT divides it
    G: tl.constexpr,
    QT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A block-causal prefill chunk: :func:`block_attention` with ``CAUSAL_B``, without the chunk
    length or the slot among the compile-time constants (one compilation serves every chunk
    length and slot) and without per-key visibility tests. A tile lies inside one block, so all
    its rows see the same keys ``[0, prefix + (block + 1) * B)``: the chunks before the last run
    unmasked and only the last one checks the range. The chunks, their order and each chunk's
    operations are :func:`_attend_keys`'s (the Triton interpreter gives the same bits); compiled
    for a GPU, an unmasked chunk's scale and max subtraction may fuse into one multiply-add,
    so the last bits can differ from the general kernel's block-causal mode."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.program_id(2) * QT
    end = tl.load(prefix_ptr + row) + (t0 // CAUSAL_B + 1) * CAUSAL_B
    full = end - end % BLOCK_N

    offs_m, pos, head, offs_d, q, k_base, v_base = _load_tile(
        q_ptr, k_ptr, v_ptr, row, kvh, t0, slot_offset, stride_qb, stride_ql, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh, QT * G, G, D,
    )  # fmt: skip
    m_i = tl.full((QT * G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QT * G,), dtype=tl.float32)
    acc = tl.zeros((QT * G, D), dtype=tl.float32)
    for s0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _key_chunk(
            q, k_base, v_base, offs_d, s0, end, m_i, l_i, acc, qk_scale, stride_kn, stride_vn,
            BLOCK_N, False,
        )  # fmt: skip
    if full < end:
        m_i, l_i, acc = _key_chunk(
            q, k_base, v_base, offs_d, full, end, m_i, l_i, acc, qk_scale, stride_kn, stride_vn,
            BLOCK_N, True,
        )  # fmt: skip
    o_ptrs = _rows(o_ptr, row, pos, head, offs_d, stride_ob, stride_ol, stride_oh)
    tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))


@triton.jit
def _key_chunk(
    q, k_base, v_base, offs_d, s0, end, m_i, l_i, acc, qk_scale, stride_kn, stride_vn,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of :func:`block_causal_prefill` over keys ``[s0, s0 + BLOCK_N)``,
    every one visible (``MASKED``: only those below ``end``). The same operations as one turn
    of :func:`_attend_keys`' loop when every key of the chunk is visible (up to the contraction
    of ``s * scale - m`` into a multiply-add, which the masked ``where`` there prevents)."""
    offs_n = s0 + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :]
    if MASKED:
        in_range = offs_n < end
        k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale
        s = tl.where(in_range[None, :], s, float("-inf"))
    else:
        k = tl.load(k_ptrs)
        s = tl.dot(q, k) * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    pr = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if MASKED:  # noqa: SIM108 (one branch is compiled: MASKED is a constant)
        v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc


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
def _attend_keys(
    q, k_base, v_base, offs_d, start, end, lo_end, hi_start, hi_end, qk_scale,
    stride_kn, stride_vn, QG: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax of the ``QG`` folded query rows ``q`` over keys ``[start, end)`` of one
    (slot, KV head) (``k_base``/``v_base``), those outside the visible ranges masked: the running
    max ``m`` (log2 units), the sum ``l`` and the unnormalised output ``acc`` [QG, D], float32.
    Keys are read in chunks of ``BLOCK_N`` from ``start``, the same chunks whatever the batch."""
    m_i = tl.full((QG,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QG,), dtype=tl.float32)
    acc = tl.zeros((QG, D), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_N):
        offs_n = s0 + tl.arange(0, BLOCK_N)
        in_range = offs_n < end
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
    return m_i, l_i, acc


@triton.jit
def _load_tile(
    q_ptr, k_ptr, v_ptr, row, kvh, t0, slot_offset, stride_qb, stride_ql, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh, QG: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr,
):  # fmt: skip
    """A program's tile: its ``QG`` folded query rows (position-major, then head in the group)
    from query position ``t0`` of batch row ``row``, their positions and heads, the head-dim
    offsets, the rows' queries [QG, D], and the bases of the (slot, KV head)'s keys and values."""
    offs_m = tl.arange(0, QG)
    pos = t0 + offs_m // G
    head = kvh * G + offs_m % G
    offs_d = tl.arange(0, D)
    q = tl.load(_rows(q_ptr, row, pos, head, offs_d, stride_qb, stride_ql, stride_qh))
    slot = (slot_offset + row).to(tl.int64)
    k_base = k_ptr + slot * stride_ks + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh.to(tl.int64) * stride_vh
    return offs_m, pos, head, offs_d, q, k_base, v_base


@triton.jit
def _rows(base, row, pos, head, offs_d, stride_b, stride_l, stride_h):
    """Pointers to the folded rows (position, head) of batch row ``row`` of a [bs, L, H, D]
    tensor."""
    return (
        base + row.to(tl.int64) * stride_b + pos[:, None] * stride_l
        + head[:, None] * stride_h + offs_d[None, :]
    )  # fmt: skip


@triton.jit
def block_attention_split(
    q_ptr,  # [bs, L, Hq, D]
    k_ptr,  # [slots, Hkv, cap, D]
    v_ptr,  # [slots, Hkv, cap, D]
    part_ptr,  # [bs, Hkv, tiles, splits, QT * G, D] float32: each split's unnormalised output
    ml_ptr,  # [bs, Hkv, tiles, splits, QT * G, 2] float32: each split's running max and sum
    prefix_ptr,  # [bs] int32
    slot_offset,
    qk_scale,
    n_splits,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_kn,
    stride_vs,
    stride_vh,
    stride_vn,
    L: tl.constexpr,
    DRAFT_B: tl.constexpr,
    G: tl.constexpr,
    QT: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,  # keys per split, a multiple of BLOCK_N
):
    """One split of :func:`block_attention`'s keys: ``[split * SPLIT_N, (split + 1) * SPLIT_N)``
    of a (row, KV head, query tile); the online softmax's state goes to the workspace, and
    :func:`block_attention_combine` merges the splits in order."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    t0 = tile * QT
    p = tl.load(prefix_ptr + row)
    lo_end, hi_start, hi_end = _visible_keys(p, t0, L, DRAFT_B, 0)
    start = split * SPLIT_N
    end = tl.minimum(start + SPLIT_N, tl.maximum(lo_end, hi_end))
    if start < end:  # splits past the row's keys are never read by the combine
        offs_m, pos, head, offs_d, q, k_base, v_base = _load_tile(
            q_ptr, k_ptr, v_ptr, row, kvh, t0, slot_offset, stride_qb, stride_ql, stride_qh,
            stride_ks, stride_kh, stride_vs, stride_vh, QT * G, G, D,
        )  # fmt: skip
        m_i, l_i, acc = _attend_keys(
            q, k_base, v_base, offs_d, start, end, lo_end, hi_start, hi_end, qk_scale,
            stride_kn, stride_vn, QT * G, D, BLOCK_N,
        )  # fmt: skip
        idx = (row * tl.num_programs(1) + kvh).to(tl.int64) * tl.num_programs(2) + tile * n_splits
        idx = idx + split
        tl.store(part_ptr + (idx * QT * G + offs_m)[:, None] * D + offs_d[None, :], acc)
        tl.store(ml_ptr + (idx * QT * G + offs_m) * 2, m_i)
        tl.store(ml_ptr + (idx * QT * G + offs_m) * 2 + 1, l_i)


@triton.jit
def block_attention_combine(
    part_ptr,
    ml_ptr,
    o_ptr,  # [bs, L, Hq, D]
    prefix_ptr,
    n_splits,
    stride_ob,
    stride_ol,
    stride_oh,
    L: tl.constexpr,
    DRAFT_B: tl.constexpr,
    G: tl.constexpr,
    QT: tl.constexpr,
    D: tl.constexpr,
    SPLIT_N: tl.constexpr,
):
    """Merges a (row, KV head, query tile)'s splits in split order (the same order whatever the
    batch), then normalises and stores the output rows."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    t0 = tile * QT
    p = tl.load(prefix_ptr + row)
    lo_end, hi_start, hi_end = _visible_keys(p, t0, L, DRAFT_B, 0)
    used = tl.cdiv(tl.maximum(lo_end, hi_end), SPLIT_N)
    offs_m = tl.arange(0, QT * G)
    offs_d = tl.arange(0, D)
    base = ((row * tl.num_programs(1) + kvh).to(tl.int64) * tl.num_programs(2) + tile) * n_splits
    m_i = tl.full((QT * G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QT * G,), dtype=tl.float32)
    acc = tl.zeros((QT * G, D), dtype=tl.float32)
    for split in range(0, used):
        rows = (base + split) * QT * G + offs_m
        m_s = tl.load(ml_ptr + rows * 2)
        l_s = tl.load(ml_ptr + rows * 2 + 1)
        a_s = tl.load(part_ptr + rows[:, None] * D + offs_d[None, :])
        m_new = tl.maximum(m_i, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        beta = tl.exp2(m_s - m_use)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    pos = t0 + offs_m // G
    head = kvh * G + offs_m % G
    o_ptrs = _rows(o_ptr, row, pos, head, offs_d, stride_ob, stride_ol, stride_oh)
    tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))
