"""Triton kernel of the zero-copy fetch (:mod:`herald.offload.gpu_fetch` describes it).

Imported lazily: only a process that runs the Triton path needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fetch_rows(
    k_src,  # [num_pages, Hkv, PAGE, D]: one layer of the (device-mapped) CPU pool
    v_src,
    table_ptr,  # [n, max_pages] int32
    idx_ptr,  # [n, Hkv, k_max] int32 positions
    nsel_ptr,  # [n] int32
    k_dst,  # [slots, Hkv, cap, D]: the idle pool's layer
    v_dst,
    total,  # n * Hkv * tiles
    tiles,  # tiles of ROWS rows per (request, head)
    rows,  # rows written per (request, head): gathered below num_selected, zeros above
    stride_page,
    stride_head,
    stride_table,
    stride_ir,
    stride_ih,
    stride_ds,
    stride_dh,
    stride_dn,
    HKV: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
):
    d = tl.arange(0, D)
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        r = t // (HKV * tiles)
        h = (t // tiles) % HKV
        j = (t % tiles) * ROWS + tl.arange(0, ROWS)
        take = j < tl.load(nsel_ptr + r)
        pos = tl.load(idx_ptr + r * stride_ir + h * stride_ih + j, mask=take, other=0)
        page = tl.load(table_ptr + r * stride_table + pos // PAGE, mask=take, other=0)
        src = page.to(tl.int64) * stride_page + h * stride_head + (pos % PAGE) * D
        dst = r.to(tl.int64) * stride_ds + h * stride_dh + j.to(tl.int64) * stride_dn
        keep = (j < rows)[:, None]
        kv = tl.load(k_src + src[:, None] + d[None, :], mask=take[:, None], other=0.0)
        tl.store(k_dst + dst[:, None] + d[None, :], kv, mask=keep)
        vv = tl.load(v_src + src[:, None] + d[None, :], mask=take[:, None], other=0.0)
        tl.store(v_dst + dst[:, None] + d[None, :], vv, mask=keep)
