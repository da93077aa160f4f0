"""RMSNorm as the HF Qwen3 / BailingMoeV2 reference computes it (docs/MODELS.md §1).

The normalisation runs in float32 and the result is cast back to the activation dtype *before* the
multiply by the weight: ``w * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)``. Used for the
pre-attention / post-attention norms, the final norm, and the per-head QK-norm (over ``head_dim``).
"""

from __future__ import annotations

import torch
from torch import nn

from herald.layers.fusion import cuda_compiled
from herald.layers.rmsnorm_triton import rms_norm_triton, rms_norm_triton_available


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` and scale by ``weight``.

    On CUDA with herald's Triton kernels (the default for bf16/fp16), one kernel whose rows do not
    depend on the call's other rows (:mod:`herald.layers.rmsnorm_triton`); elsewhere
    :func:`rms_norm_reference` (fused by ``torch.compile`` on CUDA).

    Args:
        x: [..., dim], any float dtype.
        weight: [dim], normally the same dtype as ``x``.
        eps: added to the mean square before the rsqrt.

    Returns:
        [..., dim] in ``x.dtype`` (type promotion with ``weight`` applies, as in HF).
    """
    if rms_norm_triton_available(x, weight):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


@cuda_compiled
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in PyTorch, op for op as the HF reference."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    """``weight`` [dim] (initialised to ones); see :func:`rms_norm`."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
