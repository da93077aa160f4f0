"""GPU sparse KV pools, double-buffered (HERALD §IV-B1).

Per offloaded layer, per request slot, per KV head, a pool of ``capacity`` rows laid out as

    [ selected rows (k_r) | last completed block (B or 0) | current block (B) | draft (B) ]

The denoising steps of block n read and write the *active* buffer (the commit forward writes the
clean block's KV into its current-block rows); the retrieval stream writes block n+1's selected
rows into the *idle* one. At the block boundary, after waiting for the retrieval stream's
completion event, the engine copies the completed block into the idle buffer's last-block rows
and :meth:`swap` exchanges the two.
"""

from __future__ import annotations

import torch


class GpuSparseKVPool:
    """Two buffers of ``[num_slots, num_kv_heads, capacity, head_dim]`` K and V per pooled layer.

    Args:
        layers: the model layer ids held here (the offloaded layers, e.g. ``range(2, L)``).
        num_model_layers: L, so :meth:`store` can return per-model-layer lists (None elsewhere).
        num_slots, num_kv_heads, capacity, head_dim: see the module docstring; capacity is rows.
        device, dtype: where the pools live (the model's device and dtype).
    """

    def __init__(
        self,
        layers: list[int],
        num_model_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (len(layers), num_slots, num_kv_heads, capacity, head_dim)
        # NOTE: zero-filled: masked-out rows still meet a zero probability, and 0 * NaN from
        # uninitialised memory would poison the output.
        self._k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)]
        self._v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)]
        self.layers = list(layers)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.num_model_layers = num_model_layers
        self.num_slots, self.capacity = num_slots, capacity
        self.active = 0

    @property
    def idle(self) -> int:
        return 1 - self.active

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    def swap(self) -> None:
        """Make the idle buffer active. Call only after the retrieval stream finished writing it
        and no forward still reads the old active buffer (both fenced by the engine)."""
        self.active = self.idle

    def k(self, buffer: int, layer: int) -> torch.Tensor:
        """[num_slots, Hkv, capacity, D] K of model layer ``layer`` in ``buffer`` (0/1)."""
        return self._k[buffer][self._index[layer]]

    def v(self, buffer: int, layer: int) -> torch.Tensor:
        return self._v[buffer][self._index[layer]]

    def all_k(self, buffer: int) -> torch.Tensor:
        """[num_pooled_layers, num_slots, Hkv, capacity, D] K of every pooled layer in ``buffer``
        (pooled layers in :attr:`layers` order; a view, no copy)."""
        return self._k[buffer]

    def all_v(self, buffer: int) -> torch.Tensor:
        """Like :meth:`all_k`, for V."""
        return self._v[buffer]

    def store(self, buffer: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per-model-layer K and V lists of ``buffer`` (None for layers not pooled)."""
        ks: list[torch.Tensor | None] = [None] * self.num_model_layers
        vs: list[torch.Tensor | None] = [None] * self.num_model_layers
        for layer, i in self._index.items():
            ks[layer], vs[layer] = self._k[buffer][i], self._v[buffer][i]
        return ks, vs

    def move_slot(self, src: int, dst: int, length: int = 0) -> None:
        """Copy slot ``src`` into slot ``dst`` in both buffers, every row (slot compaction by
        the KV manager; ``length``, the request's committed tokens, is not needed here)."""
        for t in self._k + self._v:
            t[:, dst].copy_(t[:, src])
