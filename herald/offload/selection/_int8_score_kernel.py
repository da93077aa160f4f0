"""Triton kernel of the int8 scoring (:func:`herald.offload.selection.compact_device.int8_scores`
describes it). Imported lazily: only a process that runs the Triton path needs Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_scores(
    x_ptr,  # [n, HKV, G, D] float32 queries
    q8_ptr,  # [n, HKV, >= s_max, D] int8 keys (rows of the store's slots)
    sc_ptr,  # [n, HKV, >= s_max] float32 scales
    len_ptr,  # [n] int32 ranked positions per request
    out_ptr,  # [n, HKV, G, s_max] float32 scores
    s_max,
    stride_qn,
    stride_qh,
    stride_sn,
    stride_sh,
    scale,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program: BLOCK_S positions of one (request, KV head), every query row of the head;
    ``score = (x . q8) * s * scale``, -inf at positions past the request's length."""
    nh = tl.program_id(0)
    r = nh // HKV
    h = nh % HKV
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    length = tl.load(len_ptr + r)
    live = offs_s < length
    base = r.to(tl.int64) * stride_qn + h.to(tl.int64) * stride_qh
    k = tl.load(q8_ptr + base + offs_s[:, None].to(tl.int64) * D + offs_d[None, :],
                mask=live[:, None], other=0).to(tl.float32)  # fmt: skip
    sbase = r.to(tl.int64) * stride_sn + h.to(tl.int64) * stride_sh
    s = tl.load(sc_ptr + sbase + offs_s, mask=live, other=0.0) * scale
    for g in tl.static_range(G):
        xg = tl.load(x_ptr + ((r * HKV + h) * G + g) * D + offs_d)
        dot = tl.sum(k * xg[None, :], axis=1)
        val = tl.where(live, dot * s, float("-inf"))
        obase = ((r.to(tl.int64) * HKV + h) * G + g) * s_max
        tl.store(out_ptr + obase + offs_s, val, mask=offs_s < s_max)
