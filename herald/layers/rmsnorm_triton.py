"""RMSNorm in one Triton kernel whose rows do not depend on each other, for any batch.

:func:`herald.layers.rmsnorm.rms_norm` under ``torch.compile`` (or eagerly) reduces each row's
squares with a kernel that Inductor (or ATen) picks per shape: a new token count can get another
block size, warp count or split of the reduction, decided by heuristics on the row count or by
timing candidates at the first call, so a row's last bits can depend on how many rows share the
call, i.e. on a request's batch mates and even on the host. Here one program normalises one row,
and the launch configuration depends only on the row's length: a row's result is the same bits
whatever else the call holds (batch invariance by construction, as a server needs).

The math is :func:`~herald.layers.rmsnorm.rms_norm`'s: float32 mean of squares, ``rsqrt``, cast to
the activation dtype, then the weight in the promoted dtype (one rounding of an exact float32
product, as PyTorch's); the sum of squares runs in another order, so values can differ from the
eager function's by rounding. On by default (``HERALD_TRITON=auto``) for bf16/fp16 activations on
CUDA; ``HERALD_TRITON=0`` turns it off, float32 activations use it only with ``all``.
"""

from __future__ import annotations

import torch

from herald.layers.moe_triton import interpreting, triton_enabled

MAX_DIM = 16384
"""Longest row one program holds in registers (the models' widest norm is 4,096)."""


def rms_norm_triton_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when the kernel suits the call: CUDA (or the interpreter), Triton enabled for the
    dtype (bf16/fp16 by default, float32 only with ``HERALD_TRITON=all``), a 1-D weight as long
    as the last dim, at most :data:`MAX_DIM`."""
    half = x.dtype in (torch.bfloat16, torch.float16)
    if not (x.is_cuda or interpreting()) or not triton_enabled(everywhere=not half):
        return False
    dim = x.shape[-1]
    return x.dtype.is_floating_point and weight.shape == (dim,) and 0 < dim <= MAX_DIM


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`~herald.layers.rmsnorm.rms_norm` of ``x`` [..., dim]; returns a new contiguous
    tensor in ``promote_types(x.dtype, weight.dtype)``."""
    from herald.layers import _rmsnorm_kernel as kern

    dim = x.shape[-1]
    # [outer, inner, dim] with strides: a view for the usual layouts, among them the per-head
    # QK-norm's [bs, L, heads, head_dim] slices of a fused projection's output
    x3 = x.reshape(-1, x.shape[-2] if x.dim() >= 3 else 1, dim)
    if x3.stride(2) != 1:
        x3 = x3.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    block = max(16, 1 << (dim - 1).bit_length())
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8  # by the row's length only
    kern.rms_norm_rows[(rows,)](
        x3, weight.contiguous(), out, x3.shape[1], x3.stride(0), x3.stride(1), dim, eps,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    return out
