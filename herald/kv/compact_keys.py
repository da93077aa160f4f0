"""The CPU pool's compact copy of K: int8 keys with one float32 scale per (token, KV head).

Held beside the bf16 pages (:class:`~herald.kv.cpu_pool.CpuKVPool` with ``first_pass="int8"``)
in the same page layout, so the compact selection pass
(:mod:`herald.offload.selection.compact_cpu`) streams it like K: per pool layer
``q8 [num_pages, Hkv, page_size, D]`` int8 and ``scales [num_pages, Hkv, page_size]`` float32.
A page's copy is recomputed from its bf16 K whenever the pool's K pages are written: the
offloading engine's writers (the prefill, each block's draft and commit) call
:func:`herald.offload.selection.compact_cpu.update_compact` (the native quantizer, on the
selection kernel's threads), :meth:`CpuKVPool.write_block` calls :meth:`CompactKeys.update`
(this module's PyTorch quantizer, :func:`quantize_keys`: the same bits).

Scale in float32, not bf16: 4 bytes per (token, KV head) instead of 2 is 1.5% of the pass's
bytes at head_dim 128, and the proof of the residual bound needs no rounding-direction care.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

RESIDUAL = 0.5 + 2.0**-12
"""``|k - s * q8| <= RESIDUAL * s`` for every element (:func:`quantize_keys`)."""

FIRST_PASS_KINDS = ("none", "int8")
"""Values of ``OffloadConfig.first_pass`` / ``CpuKVPool(first_pass=...)``."""


def compact_bytes_per_page(
    num_layers: int, num_kv_heads: int, page_size: int, head_dim: int
) -> int:
    """Bytes of the int8 copy of one page (every layer): ``D + 4`` per (token, KV head)."""
    return num_layers * num_kv_heads * page_size * (head_dim + 4)


def quantize_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 keys ``[..., D]`` -> int8 ``q8 [..., D]`` and float32 scales ``[...]``.

    ``s = fl(max|k| / 127)``, ``q8 = clamp(round_half_even(fl(k / s)), -127, 127)`` in float32
    (q8 = 0 where s = 0); the native quantizer computes the same bits. A non-finite row gets a
    non-finite scale and q8 = 0 (the selection then runs the exact kernel, which reports it).

    Proof of ``|k - s q8| <= RESIDUAL s``: s = (m / 127)(1 + d1), t = k / s, fl(t) = t(1 + d2),
    |d1|, |d2| <= u = 2**-24 (one float32 rounding each; a subnormal s has |d1| <= 2**-10 since
    m >= 2**-133, the smallest bf16). Then |t| <= 127 / (1 - 2**-10) < 127.2 and |fl(t)| < 127.5,
    so rounding to the nearest integer lands in [-127, 127] (the clamp never changes it) and
    ``|t - q8| <= 1/2 + u |t| < 1/2 + 2**-17``; times s: ``|k - s q8| <= s (1/2 + 2**-17) <=
    RESIDUAL s``.
    """
    kf = k.float()
    s = kf.abs().amax(dim=-1) / 127.0
    ok = (s > 0) & torch.isfinite(s)
    safe = torch.where(ok, s, torch.ones_like(s))
    q8 = torch.round(kf / safe.unsqueeze(-1)).clamp_(-127, 127)
    q8 = torch.where(ok.unsqueeze(-1), q8, 0.0)
    return q8.to(torch.int8), s


class CompactKeys:
    """int8 K and float32 scales of every pool page and layer (zeros until written).

    Args: the pool's ``num_layers``, ``num_pages``, ``num_kv_heads``, ``page_size``,
    ``head_dim``. Raises the CPU allocator's error when the memory is not there.
    """

    def __init__(
        self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int
    ) -> None:
        shape = (num_layers, num_pages, num_kv_heads, page_size)
        self.q8 = torch.zeros((*shape, head_dim), dtype=torch.int8)
        self.scales = torch.zeros(shape, dtype=torch.float32)
        self.nbytes = self.q8.nbytes + self.scales.nbytes

    def k8_pages(self, layer: int) -> torch.Tensor:
        """``[num_pages, Hkv, page_size, D]`` int8 of pool layer ``layer`` (a view)."""
        return self.q8[layer]

    def scale_pages(self, layer: int) -> torch.Tensor:
        """``[num_pages, Hkv, page_size]`` float32 of pool layer ``layer`` (a view)."""
        return self.scales[layer]

    def update(self, storage: torch.Tensor, pages: Sequence[int] | torch.Tensor) -> None:
        """Re-quantize pages ``pages`` of every layer from the pool ``storage`` ``[L, 2, pages,
        Hkv, P, D]`` bf16 (K at index 0) with :func:`quantize_keys`. NOTE: the caller has
        finished writing those K pages (host writes, or device copies waited for)."""
        idx = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        if idx.numel():
            q8, s = quantize_keys(storage[:, 0, idx])
            self.q8[:, idx], self.scales[:, idx] = q8, s


def compact_fraction(head_dim: int) -> float:
    """Bytes the compact pass streams per (token, KV head) over the exact pass's (bf16 K)."""
    return (head_dim + 4) / (2 * head_dim) if head_dim else math.nan
