"""The contract between model definitions and the engines that run them.

A model owns its weights and the per-token math (embedding, QKV projection, QK-norm, RoPE,
o_proj, FFN, final norm, LM head). It never owns attention over the KV cache: each decoder layer
hands its post-RoPE ``q, k, v`` to an :class:`~herald.attention.base.AttentionBackend`
supplied by the engine, which decides what the queries see (a dense cache, a sparse pool, a
no-cache block-causal mask, ...).
This split lets one model definition serve the dense engine, the offloading engines and the
reference decoders unchanged.

Engines that need to interleave work between layers (the HERALD retrieval stream runs the CPU
selection kernel between a layer's QKV and its FFN) call :meth:`DecoderLayer.qkv` and
:meth:`DecoderLayer.finish` directly instead of :meth:`BlockDiffusionLM.forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.attention.base import AttentionBackend

__all__ = ["AttentionBackend", "BlockDiffusionLM", "DecoderLayer"]


class DecoderLayer(nn.Module):
    """One pre-norm transformer block, split at the attention call.

    ``forward(x) == finish(x, attn(qkv(x)))`` for any attention backend.
    """

    layer_id: int

    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_layernorm -> q/k/v projection -> QK-norm -> RoPE.

        Args:
            hidden: [bs, L, hidden_size], the layer input (residual stream).
            positions: [bs, L] int64 absolute token positions (RoPE).

        Returns:
            q [bs, L, num_heads, head_dim], k and v [bs, L, num_kv_heads, head_dim].
        """
        raise NotImplementedError

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post_attention_layernorm -> FFN (dense or MoE) + residual.

        Args:
            hidden: [bs, L, hidden_size], the same tensor that was passed to :meth:`qkv`.
            attn_out: [bs, L, num_heads, head_dim] from the attention backend.

        Returns:
            [bs, L, hidden_size], the next layer's input.
        """
        raise NotImplementedError

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        q, k, v = self.qkv(hidden, positions)
        return self.finish(hidden, attn.forward(self.layer_id, q, k, v))


class BlockDiffusionLM(nn.Module):
    """A block dLLM: embedding, ``layers`` (ModuleList of :class:`DecoderLayer`), final norm, head.

    Logits at position ``i`` predict the token at position ``i`` (no shift), for both architectures
    (docs/MODELS.md §1).
    """

    layers: nn.ModuleList

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[bs, L] int64 token ids -> [bs, L, hidden_size] in the model dtype."""
        raise NotImplementedError

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm: [..., hidden_size] -> [..., hidden_size]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on *normed* hidden states: [..., hidden_size] -> [..., vocab_size] float32."""
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Run all layers; returns the final-normed hidden states [bs, L, hidden_size].

        Call :meth:`compute_logits` on the positions whose logits are needed (the LM head is the
        largest matmul at small batch; commit forwards skip it entirely).
        """
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden, positions, attn)
        return self.final_norm(hidden)
