"""Dense KV storage: every layer's K and V for ``num_slots`` requests, on one device.

Per layer one K and one V tensor ``[num_slots, num_kv_heads, capacity, head_dim]``; a running
request owns one slot (given out by :class:`herald.kv.manager.KVManager`), and its token at
absolute position p sits at row p. Read and written by
:class:`herald.attention.slots.SlotAttention`.
"""

from __future__ import annotations

import torch


class DenseKVCache:
    """Preallocated dense K/V for ``num_slots`` requests of up to ``capacity`` tokens each.

    Args:
        num_layers, num_kv_heads, head_dim: the model's.
        num_slots: requests held at once.
        capacity: tokens per request (prompt + generation, rounded up to whole blocks).
        device, dtype: where and how the cache lives (bf16 on GPU in production).
        layers: how many leading layers are stored (default all; the others are None in
            :attr:`k` / :attr:`v`).
        move_all_rows: :meth:`move_slot` copies whole slots, not just the committed rows.

    Raises:
        torch.OutOfMemoryError (CUDA) when the cache does not fit; the message is the allocator's.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
        layers: int | None = None,
        move_all_rows: bool = False,
    ) -> None:
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        stored = num_layers if layers is None else layers
        # NOTE: zero-filled, not empty: masked-out keys still multiply their V rows by a zero
        # probability, and 0 * NaN from uninitialised memory would poison the output.
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        for i in range(stored):
            self.k[i] = torch.zeros(shape, device=device, dtype=dtype)
            self.v[i] = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots = num_slots
        self.capacity = capacity
        self.move_all_rows = move_all_rows

    def tensors(self) -> list[torch.Tensor]:
        """Every stored K and V tensor."""
        return [t for t in self.k + self.v if t is not None]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` rows (every row with ``move_all_rows``) of slot ``src``
        into slot ``dst``, on the current stream (ordered after the forwards that wrote them)."""
        for t in self.tensors():
            rows = t.shape[2] if self.move_all_rows else length
            t[dst, :, :rows].copy_(t[src, :, :rows])
