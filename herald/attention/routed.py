"""The offloading engine's backend: the first layers attend over their dense store, the rest over
the active GPU sparse pool (HERALD §IV-B1: the first layers keep their full KV on the GPU)."""

from __future__ import annotations

import torch

from herald.attention.slots import SlotAttention


class RoutedAttention:
    """Layers ``< num_dense`` -> ``dense``; the others -> ``sparse``."""

    def __init__(self, num_dense: int, dense: SlotAttention | None, sparse: SlotAttention) -> None:
        self.num_dense, self.dense, self.sparse = num_dense, dense, sparse

    def prepare(
        self, starts: list[int], pool_prefix: list[int], length: int, draft_group: bool = False
    ) -> None:
        """Describe the next forward: dense rows start at the absolute block starts, sparse-pool
        rows after each slot's selected rows and last completed block (``pool_prefix``)."""
        if self.dense is not None:
            self.dense.prepare(starts, length, draft_group=draft_group)
        self.sparse.prepare(pool_prefix, length, draft_group=draft_group)

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if layer_id < self.num_dense:
            assert self.dense is not None
            return self.dense.forward(layer_id, q, k, v)
        return self.sparse.forward(layer_id, q, k, v)
