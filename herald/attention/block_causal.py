"""Block-causal attention without a cache: the no-cache reference decoder's backend.

Every denoising step of :func:`herald.engine.reference.reference_generate` re-forwards the whole
canvas up to the end of the current block; tokens attend within their block and to earlier
blocks only (docs/ARCHITECTURE.md, "Block diffusion decoding").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from herald.attention.masks import block_causal_mask


class BlockCausalAttention:
    """AttentionBackend for a full re-forward (batch of one canvas, no KV kept)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        mask = block_causal_mask(q.shape[1], self.block_size, q.device)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            enable_gqa=True,
        )
        return o.transpose(1, 2)
