"""Rotary position embedding (RoPE), full or partial, NeoX / HF ``rotate_half`` style.

docs/MODELS.md §2 (SDAR: all 128 head dims, theta 1e6; LLaDA2: the first ``rotary_dim`` = 64 of
128 dims, theta 6e5, the rest passed through). ``inv_freq`` is computed in float32 exactly as
the HF default rope init does; a float32 cos/sin table over positions ``0..max_positions-1`` is
precomputed once and indexed by a ``[bs, L]`` positions tensor; the gathered cos/sin are cast to the
activation dtype before they multiply q/k, as in HF.

One :class:`RotaryEmbedding` is shared by all layers of a model. Its table is a non-persistent
buffer (never in a checkpoint); after building a model on the ``meta`` device and materialising it,
call :meth:`RotaryEmbedding.reset_table`.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.layers.fusion import cuda_compiled


def rope_inv_freq(
    rotary_dim: int, base: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """``1 / base ** (arange(0, rotary_dim, 2) / rotary_dim)``: [rotary_dim // 2] float32."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (base**exponent)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: ``cat(-x[..., d/2:], x[..., :d/2])`` (pairs (i, i + d/2))."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@cuda_compiled
def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up cos/sin for ``positions`` ([bs, L]) in the fp32 tables and rotate q and k."""
    cos = cos_table[positions].to(q.dtype).unsqueeze(2)  # [bs, L, 1, rotary_dim]
    sin = sin_table[positions].to(q.dtype).unsqueeze(2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x``; pass the rest through unchanged.

    Args:
        x: [bs, L, heads, head_dim].
        cos, sin: [bs, L, 1, rotary_dim] in ``x.dtype``; ``rotary_dim <= head_dim``, even.

    Returns:
        [bs, L, heads, head_dim] in ``x.dtype``.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE over the first ``rotary_dim`` dims of each head, positions ``< max_positions``.

    Table memory: ``2 * max_positions * rotary_dim * 4`` bytes (32 MiB for 32768 x 128).
    """

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(
        self,
        rotary_dim: int,
        base: float,
        max_positions: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.base = base
        self.max_positions = max_positions
        empty = torch.empty(max_positions, rotary_dim, dtype=torch.float32, device=device)
        self.register_buffer("cos_table", empty, persistent=False)
        self.register_buffer("sin_table", empty.clone(), persistent=False)
        if self.cos_table.device.type != "meta":
            self.reset_table()

    @torch.no_grad()
    def reset_table(self, max_positions: int | None = None) -> None:
        """(Re)compute the float32 cos/sin tables on the buffers' device.

        Call after ``to_empty()`` (meta -> real device), or with a larger ``max_positions`` to serve
        longer sequences than ``max_position_embeddings`` (the formula extrapolates, as HF's does).
        """
        if max_positions is not None:
            self.max_positions = max_positions
        device = self.cos_table.device
        inv_freq = rope_inv_freq(self.rotary_dim, self.base, device)
        t = torch.arange(self.max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv_freq)  # [P, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rotary_dim]
        self.cos_table = emb.cos()
        self.sin_table = emb.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply RoPE to q and k.

        Args:
            positions: [bs, L] int64 absolute positions, each ``< max_positions`` (not checked:
                checking would synchronise with the GPU; CUDA reports an out-of-range index as a
                device-side assert).
            q: [bs, L, num_heads, head_dim]; k: [bs, L, num_kv_heads, head_dim]; same dtype.

        Returns:
            (q, k) rotated, same shapes and dtype.
        """
        return rope_qk(q, k, positions, self.cos_table, self.sin_table)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base}, max_positions={self.max_positions}"
