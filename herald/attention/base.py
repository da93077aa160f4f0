"""The attention backend interface: what a decoder layer calls for attention over the KV cache.

A model never owns attention over the KV cache: each decoder layer computes post-RoPE ``q, k, v``
and hands them to the :class:`AttentionBackend` its engine supplies, which decides what the
queries see (a dense cache, a GPU sparse pool, a no-cache block-causal mask). The backends:

==============================  =================================================================
:mod:`herald.attention.slots`   per-slot KV stores: the dense cache and the GPU sparse pools; one
                                block, a block-causal prefill chunk, or a block with its draft
                                group (:mod:`herald.attention.masks` has the masks)
:mod:`herald.attention.routed`  the offloading engine's layers: dense store for the first layers,
                                sparse pool for the rest
``block_causal``                the no-cache reference decoder's full re-forward
``prefix_tail``                 a few queries over a store's prefix plus a tail block (the
                                retrieval stream's representative query on the dense layers)
==============================  =================================================================

To add a backend: implement ``forward`` below in a new module of this package, and have the
engine pass it to ``model(input_ids, positions, backend)``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Attention over whatever KV the engine keeps, for one layer at a time."""

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attend the current tokens' queries to the engine's KV plus the current tokens' own KV.

        Args:
            layer_id: decoder layer index, 0-based.
            q: [bs, L, num_heads, head_dim], after QK-norm and RoPE, model dtype, model device.
            k, v: [bs, L, num_kv_heads, head_dim], after K-norm and RoPE (k), model dtype/device.
                The backend may store them (e.g. into a KV cache) before attending.

        Returns:
            [bs, L, num_heads, head_dim], same dtype and device as ``q``. Softmax scale is
            ``head_dim ** -0.5``; query head ``h`` uses KV head
            ``h // (num_heads // num_kv_heads)``.
        """
        ...


class QueryRecorder:
    """Wraps a backend and keeps each layer's queries (the first block's exact selection).

    ``q[layer_id]``: the last forward's queries of that layer as the layer passed them,
    ``[bs, L, num_heads, head_dim]`` (post QK-norm and RoPE, model dtype and device; the
    offloading engine's first selection: ``bs`` 1, ``L`` the block size B). The tensor itself,
    not a copy: under CUDA graphs it is a graph's static buffer, which the next forward of that
    shape overwrites. Keys and values are not kept."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.q: dict[int, torch.Tensor] = {}
        """layer_id -> [bs, L, num_heads, head_dim], the layer's last queries."""

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.q[layer_id] = q
        return self.inner.forward(layer_id, q, k, v)
