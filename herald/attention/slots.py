"""The slot backend: attention over per-slot KV stores (the dense cache and the GPU sparse pools).

A store is, per layer, one K and one V tensor ``[num_slots, num_kv_heads, capacity, head_dim]``.
The batch of a forward is always slots ``slot_offset .. slot_offset + bs - 1``, so attention reads
a plain view with no gather (the KV manager keeps running requests in slots ``0..n-1``).

Each forward writes the current tokens' K/V into the store *before* attending, so a denoising step
of a block attends to the row's prefix plus the block itself, bidirectionally, in one SDPA call.
Those rows hold the noisy block's KV until the commit forward on the clean block overwrites them;
the engine advances the prefix only after the commit forward.
"""

from __future__ import annotations

import torch

from herald.attention.block_kernel import block_attention, block_attention_available
from herald.attention.masks import draft_group_mask, key_mask
from herald.attention.sdpa import padded_kv_len, sdpa_block_causal, sdpa_folded
from herald.config import check_kv_pad


class SlotAttention:
    """AttentionBackend over per-slot KV stores, for one batched forward at a time.

    ``k[layer]`` / ``v[layer]`` are ``[num_slots, num_kv_heads, capacity, head_dim]`` (``None`` for
    layers this backend does not serve). Batch row i uses slot ``slot_offset + i``; its current
    tokens are written at store rows ``[prefix[i], prefix[i] + L)`` before attending, and attend to
    rows ``[0, prefix[i] + L)``. For the dense cache ``prefix`` is the absolute block start; for a
    GPU sparse pool it is the number of rows already there (selected rows + last completed block).

    Modes (:meth:`prepare`):
    - one block (L = B): bidirectional inside the block (denoising step, commit forward);
    - ``block_size`` with L > B: block-causal inside the chunk (prefill);
    - ``draft_group``: L = 2B, the block then its draft (HERALD §IV-A1). Both write their K/V
      (the draft right after the block, rows ``[p + B, p + 2B)``); block queries see
      ``[0, p + B)`` exactly as in a plain denoising step, draft queries see ``[0, p)`` and the
      draft, not the block.

    ``kv_pad`` (0 = off): attend over the batch's longest row rounded up to a multiple of
    ``kv_pad`` keys, every row masked to its own, instead of exactly the longest row. A batched
    attention's reduction order depends on the key length, so otherwise a row's result can differ
    by a bf16 ulp with its batch mates; with a multiple of the kernel's key block (512 for
    PyTorch's CPU flash attention) each row's keys land in the same blocks whatever the batch:
    results are batch-invariant, and the attention shape changes once per ``kv_pad`` tokens rather
    than every block (cuDNN plans per shape). Costs up to ``kv_pad - 1`` masked keys per call.
    Prefill chunks (block-causal) are not padded.

    On CUDA with Triton, denoising steps, commits and draft groups over small stores (the sparse
    pools; every store with ``HERALD_TRITON=all``) run
    :func:`herald.attention.block_kernel.block_attention` instead of SDPA: each row over exactly
    its own keys, batch-invariant without padding (``kv_pad`` then only sizes the store).
    Prefill chunks of whole blocks, more than one, take its block-causal kernel as
    ``HERALD_PREFILL_ATTENTION`` says; a one-block chunk is a denoising step's shape and follows
    the steps' rule.
    """

    def __init__(
        self, k: list[torch.Tensor | None], v: list[torch.Tensor | None], kv_pad: int = 0
    ) -> None:
        check_kv_pad(kv_pad)
        self.set_store(k, v)
        self.kv_pad = kv_pad
        self._slots = slice(0, 0)
        self._length = 0
        self._kv_len = 0
        self._uniform: int | None = None
        self._prefix: torch.Tensor | None = None
        self._prefix32: torch.Tensor | None = None
        self._block_size: int | None = None
        self._draft = False
        self._plain_kv_len = 0

    def set_store(self, k: list[torch.Tensor | None], v: list[torch.Tensor | None]) -> None:
        """Point at other K/V tensors (e.g. the other buffer of a double-buffered pool)."""
        first = next(t for t in k if t is not None)
        self.k, self.v = k, v
        self.num_slots, self.capacity = first.shape[0], first.shape[2]
        self.device = first.device

    def prepare(
        self,
        prefix: list[int],
        length: int,
        block_size: int | None = None,
        slot_offset: int = 0,
        draft_group: bool = False,
    ) -> None:
        """Describe the next forward (see the class docstring).

        Raises:
            ValueError: more rows than slots, or rows past the store capacity.
        """
        bs = len(prefix)
        if slot_offset + bs > self.num_slots:
            raise ValueError(f"batch of {bs} exceeds the store's {self.num_slots} slots")
        end = max(prefix) + length
        if end > self.capacity:
            raise ValueError(f"row {end} exceeds the store capacity {self.capacity}")
        self._slots = slice(slot_offset, slot_offset + bs)
        self._block_size = block_size if block_size is not None and length > block_size else None
        self._draft = draft_group
        uniform = all(p == prefix[0] for p in prefix)
        # the key length of a plain denoising step over the same prefix (the draft group's
        # block half attends over exactly that many keys)
        self._plain_kv_len = max(prefix) + (length // 2 if draft_group else length)
        if self.kv_pad and self._block_size is None:
            # Key length rounded up to a multiple of kv_pad, every row masked to its own rows:
            # a row's keys then fall into the same kernel blocks whatever the batch's longest
            # row (batch-invariant results), and the shape changes once per kv_pad tokens.
            end, uniform = min(self.capacity, padded_kv_len(end, self.kv_pad)), False
            self._plain_kv_len = min(self.capacity, padded_kv_len(self._plain_kv_len, self.kv_pad))
        self._length, self._kv_len = length, end
        self._uniform = prefix[0] if uniform else None
        self._prefix = torch.tensor(prefix, device=self.device)
        self._prefix32 = self._prefix.to(torch.int32)

    def _key_mask(self, visible: int) -> torch.Tensor | None:
        if self._uniform is not None:
            return None
        assert self._prefix is not None
        return key_mask(self._prefix, visible, self._kv_len)

    def _write(self, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        length = k.shape[1]
        if self._uniform is not None:
            s0 = self._uniform
            kc[self._slots, :, s0 : s0 + length].copy_(k.transpose(1, 2))
            vc[self._slots, :, s0 : s0 + length].copy_(v.transpose(1, 2))
        else:
            assert self._prefix is not None
            rows = torch.arange(self._slots.start, self._slots.stop, device=self.device)
            pos = self._prefix[:, None] + torch.arange(length, device=self.device)[None, :]
            b_idx = rows[:, None].expand_as(pos)
            kc[b_idx, :, pos] = k
            vc[b_idx, :, pos] = v

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """See :class:`herald.attention.base.AttentionBackend`. Writes k/v into the store first."""
        kc, vc = self.k[layer_id], self.v[layer_id]
        if kc is None or vc is None:
            raise ValueError(f"layer {layer_id} has no store in this backend")
        self._write(kc, vc, k, v)
        keys = kc[self._slots, :, : self._kv_len]
        values = vc[self._slots, :, : self._kv_len]
        block = self._block_size or (self._length // 2 if self._draft else 0)
        fast = self._prefix32 is not None and block_attention_available(
            q, kc, prefill=self._block_size is not None, block=block
        )
        if fast and (self._block_size is None or self._length % self._block_size == 0):
            # One kernel over each row's own keys: no padding, no masks, batch-invariant.
            assert self._prefix32 is not None
            return block_attention(
                q, kc, vc, self._prefix32, slot_offset=self._slots.start,
                draft_block=self._length // 2 if self._draft else 0,
                causal_block=self._block_size or 0,
            )  # fmt: skip
        if self._block_size is not None:
            # Prefill chunks are one request each, so the batch is uniform.
            assert self._uniform is not None and q.shape[0] == 1
            return sdpa_block_causal(q, keys, values, self._uniform, self._block_size)
        if not self._draft:
            return sdpa_folded(q, keys, values, self._key_mask(self._length))
        return self._draft_forward(q, keys, values)

    def _draft_forward(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        b = self._length // 2
        assert self._prefix is not None
        # NOTE: the block group is computed exactly as a plain denoising step (same keys, same
        # key length -- with kv_pad, padded(p + B), not padded(p + 2B) - B -- same kernel), so
        # the draft never changes the block's numbers.
        kv_block = self._plain_kv_len
        block_mask = self._key_mask(b)
        o_block = sdpa_folded(
            q[:, :b].contiguous(),
            keys[:, :, :kv_block],
            values[:, :, :kv_block],
            None if block_mask is None else block_mask[..., :kv_block],
        )
        draft_mask = draft_group_mask(self._prefix, b, self._kv_len)
        o_draft = sdpa_folded(q[:, b:].contiguous(), keys, values, draft_mask)
        return torch.cat([o_block, o_draft], dim=1)
