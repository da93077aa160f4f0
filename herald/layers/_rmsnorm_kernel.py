"""Triton kernel of the row-wise RMSNorm (:mod:`herald.layers.rmsnorm_triton` describes it).

Imported lazily: only a process that runs the Triton path needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_rows(
    x_ptr,  # [outer, inner, dim], last dim contiguous (e.g. [tokens, heads, head_dim] slabs)
    w_ptr,  # [dim]
    y_ptr,  # [outer * inner, dim], contiguous
    inner,
    stride_outer,
    stride_inner,
    dim,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < dim
    src = (row // inner) * stride_outer + (row % inner) * stride_inner
    x = tl.load(x_ptr + src + cols, mask=live, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    # the activation dtype first, then the weight in the output's (promoted) dtype
    xn = (xf * r).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, (xn * w).to(y_ptr.dtype.element_ty), mask=live)
