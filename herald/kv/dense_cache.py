"""Dense KV cache on one device, and the attention backend that reads it (DESIGN §4 "dense").

Storage: per layer one K and one V tensor ``[num_slots, num_kv_heads, capacity, head_dim]``. A
running request owns one slot (a row); the batch of a forward is always slots ``0..bs-1`` so that
attention reads a plain view with no gather (slots are compacted when a request leaves).

Each forward writes the current tokens' K/V into the cache at their absolute positions *before*
attending, so a denoising step of block n (positions ``[S, S+B)``) attends to ``[0, S+B)`` — the
committed prefix plus the block itself, bidirectionally — with a single SDPA call. Those slots hold
noisy-block KV until the commit forward on the clean block overwrites them (this is what makes a
completed block's KV the *clean* one, model spec §1.4). The engine advances the prefix length only
after the commit forward.

GQA is folded into the query length (``q`` viewed as ``[bs, Hkv, G*L, D]``): exact whenever every
query of a request sees the same keys, which holds for denoising steps (device.md: 0.27-0.39 ms vs
0.78 ms for the default GQA path at batch 16 x 32K).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from herald.models.config import ModelConfig


class DenseKVCache:
    """Preallocated dense K/V for ``num_slots`` requests of up to ``capacity`` tokens each.

    Args:
        config: the model (layers, KV heads, head_dim).
        num_slots: requests held at once.
        capacity: tokens per request (prompt + generation, rounded up to whole blocks).
        device, dtype: where and how the cache lives (bf16 on GPU in production).

    Raises:
        torch.OutOfMemoryError (CUDA) when the cache does not fit; the message is the allocator's.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        shape = (num_slots, config.num_kv_heads, capacity, config.head_dim)
        # NOTE: zero-filled, not empty: masked-out keys still multiply their V rows by a zero
        # probability, and 0 * NaN from uninitialised memory would poison the output.
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.num_slots = num_slots
        self.capacity = capacity

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` tokens of slot ``src`` into slot ``dst`` (all layers)."""
        for t in self.k + self.v:
            t[dst, :, :length].copy_(t[src, :, :length])


class DenseAttention:
    """AttentionBackend over a :class:`DenseKVCache` for one batched forward.

    Set :meth:`prepare` before each forward: the current tokens of request ``i`` (slot ``i``) sit at
    positions ``start[i] .. start[i] + L - 1`` and attend to cache positions ``[0, start[i] + L)``.
    With ``causal_blocks`` (prefill of several blocks at once) query block j of the chunk sees the
    chunk only up to the end of block j (block-causal, model spec §1.3).
    """

    def __init__(self, cache: DenseKVCache) -> None:
        self.cache = cache
        self._bs = 0
        self._length = 0
        self._uniform_start: int | None = None
        self._write_b: torch.Tensor | None = None
        self._write_p: torch.Tensor | None = None
        self._key_mask: torch.Tensor | None = None
        self._kv_len = 0
        self._block_size: int | None = None
        self._slots = slice(0, 0)

    def prepare(
        self,
        start: list[int],
        length: int,
        block_size: int | None = None,
        slot_offset: int = 0,
    ) -> None:
        """Describe the next forward.

        Args:
            start: per request (slot order), the absolute position of its first current token.
            length: L, current tokens per request.
            block_size: set for a multi-block prefill chunk (block-causal inside the chunk); None
                for a single block (fully bidirectional inside it).
            slot_offset: batch row i uses KV slot ``slot_offset + i`` (prefill of one new request).
        """
        device = self.cache.k[0].device
        bs = len(start)
        if slot_offset + bs > self.cache.num_slots:
            raise ValueError(f"batch of {bs} exceeds the cache's {self.cache.num_slots} slots")
        self._slots = slice(slot_offset, slot_offset + bs)
        end = max(start) + length
        if end > self.cache.capacity:
            raise ValueError(f"position {end} exceeds the cache capacity {self.cache.capacity}")
        self._bs, self._length, self._kv_len = bs, length, end
        self._block_size = block_size if block_size is not None and length > block_size else None
        if all(s == start[0] for s in start):
            self._uniform_start = start[0]
            self._write_b = self._write_p = self._key_mask = None
        else:
            self._uniform_start = None
            st = torch.tensor(start, device=device)
            ar = torch.arange(length, device=device)
            rows = torch.arange(slot_offset, slot_offset + bs, device=device)
            self._write_b = rows[:, None].expand(bs, length)
            self._write_p = st[:, None] + ar[None, :]
            keys = torch.arange(end, device=device)
            # [bs, 1, 1, kv_len]: request i sees keys < start[i] + L.
            self._key_mask = (keys[None, :] < (st + length)[:, None])[:, None, None, :]

    def _mask(self, device: torch.device) -> torch.Tensor | None:
        if self._block_size is None:
            return self._key_mask
        # Block-causal inside the chunk: query t (chunk-relative) sees absolute keys
        # < chunk_start + (t // B + 1) * B. Only used for uniform batches (prefill is per request).
        assert self._uniform_start is not None, "multi-block chunks need a uniform start"
        b = self._block_size
        t = torch.arange(self._length, device=device)
        limit = self._uniform_start + (t // b + 1) * b
        keys = torch.arange(self._kv_len, device=device)
        return (keys[None, :] < limit[:, None])[None, None]

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """See :class:`herald.models.base.AttentionBackend`. Writes k/v into the cache first."""
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        bs, length, hq, d = q.shape
        hkv = k.shape[2]
        g = hq // hkv
        if self._uniform_start is not None:
            s0 = self._uniform_start
            kc[self._slots, :, s0 : s0 + length].copy_(k.transpose(1, 2))
            vc[self._slots, :, s0 : s0 + length].copy_(v.transpose(1, 2))
        else:
            kc[self._write_b, :, self._write_p] = k
            vc[self._write_b, :, self._write_p] = v
        keys = kc[self._slots, :, : self._kv_len]
        values = vc[self._slots, :, : self._kv_len]
        mask = self._mask(q.device)
        if self._block_size is None:
            # Fold GQA into the query length: [bs, Hkv, G*L, D]; all queries of a request see the
            # same keys, so this is exact.
            qf = (
                q.view(bs, length, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * length, d)
            )
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
            return o.view(bs, hkv, g, length, d).permute(0, 3, 1, 2, 4).reshape(bs, length, hq, d)
        if q.is_cuda:
            # Prefill chunk: the block-causal mask rules out the flash / cuDNN GQA paths and the
            # memory-efficient kernel refuses GQA (device.md), so expand K/V to the query heads
            # (a transient [Hq, S, D] per layer) rather than fall back to the math kernel.
            keys = keys.repeat_interleave(g, dim=1)
            values = values.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
            )
        return o.transpose(1, 2)
