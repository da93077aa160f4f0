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

import functools
import os

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


class SlotAttention:
    """AttentionBackend over per-slot KV stores, for one batched forward at a time.

    ``k[layer]`` / ``v[layer]`` are ``[num_slots, num_kv_heads, capacity, head_dim]`` (``None`` for
    layers this backend does not serve). Batch row i uses slot ``slot_offset + i``; its current
    tokens are written at store rows ``[prefix[i], prefix[i] + L)`` before attending, and attend to
    rows ``[0, prefix[i] + L)``. For the dense cache ``prefix`` is the absolute block start; for a
    GPU sparse pool it is the number of rows already there (selected rows + last completed block).

    Modes (:meth:`prepare`):
    - one block (L = B): bidirectional inside the block (denoising step, commit forward);
    - ``block_size`` with L > B: block-causal inside the chunk (prefill, model spec §1.3);
    - ``draft_group``: L = 2B, the block then its draft (DESIGN §2, paper §IV-A1). Both write their
      K/V (the draft right after the block, rows ``[p + B, p + 2B)``); block queries see
      ``[0, p + B)`` exactly as in a plain denoising step, draft queries see ``[0, p)`` and the
      draft, not the block.

    ``kv_pad`` (0 = off): attend over the batch's longest row rounded up to a multiple of
    ``kv_pad`` keys, every row masked to its own, instead of exactly the longest row. A batched
    attention's reduction order depends on the key length, so otherwise a row's result can differ
    by a bf16 ulp with its batch mates; with a multiple of the kernel's key block (512 for
    PyTorch's CPU flash attention) each row's keys land in the same blocks whatever the batch:
    results are batch-invariant (tested on the CPU), and the attention shape changes once per
    ``kv_pad`` tokens rather than every block (cuDNN plans per shape). Costs up to ``kv_pad - 1``
    masked keys per call. Prefill chunks (block-causal) are not affected.
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

    # -- masks -------------------------------------------------------------------------------------
    def _key_mask(self, visible: int) -> torch.Tensor | None:
        """[bs, 1, 1, kv_len] bool: row i sees keys < prefix[i] + visible (None when uniform)."""
        if self._uniform is not None:
            return None
        assert self._prefix is not None
        keys = torch.arange(self._kv_len, device=self.device)
        return (keys[None, :] < (self._prefix + visible)[:, None])[:, None, None, :]

    def _draft_mask(self, b: int) -> torch.Tensor:
        """[bs, 1, 1, kv_len] bool: keys < p, or in the draft rows [p + B, p + 2B)."""
        assert self._prefix is not None
        keys = torch.arange(self._kv_len, device=self.device)[None, :]
        p = self._prefix[:, None]
        return ((keys < p) | ((keys >= p + b) & (keys < p + 2 * b)))[:, None, None, :]

    def _causal_mask(self) -> torch.Tensor:
        # Block-causal inside the chunk: query t (chunk-relative) sees rows
        # < start + (t // B + 1) * B. Only used for uniform batches (prefill is per request).
        assert self._uniform is not None and self._block_size is not None
        b = self._block_size
        t = torch.arange(self._length, device=self.device)
        limit = self._uniform + (t // b + 1) * b
        keys = torch.arange(self._kv_len, device=self.device)
        return (keys[None, :] < limit[:, None])[None, None]

    # -- forward -----------------------------------------------------------------------------------
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
        """See :class:`herald.models.base.AttentionBackend`. Writes k/v into the store first."""
        kc, vc = self.k[layer_id], self.v[layer_id]
        if kc is None or vc is None:
            raise ValueError(f"layer {layer_id} has no store in this backend")
        self._write(kc, vc, k, v)
        keys = kc[self._slots, :, : self._kv_len]
        values = vc[self._slots, :, : self._kv_len]
        if self._block_size is not None:
            return _sdpa_gqa(q, keys, values, self._causal_mask())
        if not self._draft:
            return _sdpa_folded(q, keys, values, self._key_mask(self._length))
        b = self._length // 2
        # NOTE: the block group is computed exactly as a plain denoising step (same keys, same
        # key length -- with kv_pad, padded(p + B), not padded(p + 2B) - B -- same kernel), so
        # the draft never changes the block's numbers.
        kv_block = self._plain_kv_len
        o_block = _sdpa_folded(
            q[:, :b].contiguous(),
            keys[:, :, :kv_block],
            values[:, :, :kv_block],
            None if self._uniform is not None else self._key_mask(b)[..., :kv_block],  # type: ignore[index]
        )
        o_draft = _sdpa_folded(q[:, b:].contiguous(), keys, values, self._draft_mask(b))
        return torch.cat([o_block, o_draft], dim=1)


MAX_KV_PAD = 65536
"""The largest ``kv_pad`` accepted (store capacities grow with it)."""

DEFAULT_KV_PAD = 512
"""The engines' default ``kv_pad``. Measured on the H200 (``results/offload/profile/``,
LLaDA2.0-mini 32K x 32, 5%): it makes herald equal dense at budget 1.0 on the GPU (without it the
two differ in one request from token 66, every run: their padded key lengths differ), and it cuts
the main stream's steps 0-1 from 0.1-1.7 s to ~25 ms (cuDNN builds one plan per new key length:
every block without padding, once per 512 tokens with it)."""


def check_kv_pad(kv_pad: int, name: str = "kv_pad") -> None:
    """ValueError unless ``0 <= kv_pad <=`` :data:`MAX_KV_PAD` (engines check it before they size
    their stores; the CLI before the model loads, as ``name="--kv-pad"``)."""
    if not 0 <= kv_pad <= MAX_KV_PAD:
        raise ValueError(f"{name} must be an integer in [0, {MAX_KV_PAD}], got {kv_pad}")


def padded_kv_len(n: int, kv_pad: int) -> int:
    """``n`` keys rounded up to a multiple of ``kv_pad`` (0: ``n``): the key length
    :class:`SlotAttention` attends over, and the store capacity an engine allocates for it."""
    return -(-n // kv_pad) * kv_pad if kv_pad > 0 else n


def _sdpa_folded(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [bs, L, Hq, D] against keys/values [bs, Hkv, S, D]; GQA folded into the query length.

    Exact whenever every query of a row sees the same keys (mask [bs, 1, 1, S] or None).
    """
    bs, length, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    qf = q.view(bs, length, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * length, d)
    if qf.is_cuda:
        configure_sdpa_backends()
    o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
    return o.view(bs, hkv, g, length, d).permute(0, 3, 1, 2, 4).reshape(bs, length, hq, d)


def _sdpa_gqa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-query masks (prefill chunks): q [bs, L, Hq, D] -> [bs, L, Hq, D]."""
    g = q.shape[2] // keys.shape[1]
    if q.is_cuda:
        # The block-causal mask rules out the flash / cuDNN GQA paths and the memory-efficient
        # kernel refuses GQA (device.md), so expand K/V to the query heads (a transient
        # [Hq, S, D] per layer) rather than fall back to the math kernel.
        keys = keys.repeat_interleave(g, dim=1)
        values = values.repeat_interleave(g, dim=1)
        configure_sdpa_backends()
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
    return o.transpose(1, 2)


def attend_prefix_and_tail(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix: list[int],
    tail_start: list[int],
    tail_len: int,
    kv_pad: int = 0,
) -> torch.Tensor:
    """Exact attention of a few queries to rows ``[0, prefix)`` and ``[tail_start, +tail_len)``.

    The retrieval stream's representative query on the dense layers (prefix + draft, DESIGN §2).

    Args:
        q: [bs, n_q, Hq, D]; keys/values: [bs, Hkv, cap, D] (one layer of a store, slot order).
        prefix, tail_start: per row, in store rows; tail_len: rows of the tail (0 = none).
        kv_pad: round the key length up to a multiple of it (masked), as :class:`SlotAttention`.

    Returns:
        [bs, n_q, Hq, D].
    """
    dev = q.device
    end = max(max(p for p in prefix), max(t + tail_len for t in tail_start))
    if kv_pad:
        end = min(keys.shape[2], padded_kv_len(end, kv_pad))
    rows = torch.arange(end, device=dev)[None, :]
    p = torch.tensor(prefix, device=dev)[:, None]
    t = torch.tensor(tail_start, device=dev)[:, None]
    mask = (rows < p) | ((rows >= t) & (rows < t + tail_len))
    return _sdpa_folded(q, keys[:, :, :end], values[:, :, :end], mask[:, None, None, :])


class DenseAttention(SlotAttention):
    """:class:`SlotAttention` over every layer of a :class:`DenseKVCache` (absolute positions)."""

    def __init__(self, cache: DenseKVCache, kv_pad: int = 0) -> None:
        super().__init__(list(cache.k), list(cache.v), kv_pad=kv_pad)
        self.cache = cache


_BACKEND_NAMES = ("cudnn", "flash", "efficient", "math")


def configure_sdpa_backends() -> None:
    """Apply ``HERALD_SDPA_BACKENDS`` (e.g. ``flash,efficient,math``): the SDPA kernels allowed
    process-wide; unset, PyTorch's own pick. Called before every CUDA attention call; applies a
    given setting once (PyTorch's switches are global, not per thread, so they are set once
    rather than around each call, which would race with the retrieval thread).

    NOTE: PyTorch's pick for the engines' shapes is cuDNN, the fastest kernel at steady state,
    but cuDNN builds an execution plan on the host for every new key length (hundreds of ms at
    size, ``results/offload/profile``), and decoding meets new key lengths at every block. The
    setting exists to measure that trade-off. Raises ValueError for an unknown name.
    """
    _configure(os.environ.get("HERALD_SDPA_BACKENDS", ""))


@functools.cache
def _configure(spec: str) -> None:
    if not spec:
        return
    names = [x.strip() for x in spec.split(",") if x.strip()]
    if not names or any(x not in _BACKEND_NAMES for x in names):
        raise ValueError(
            f"HERALD_SDPA_BACKENDS={spec!r}: a comma-separated list of {', '.join(_BACKEND_NAMES)}"
        )
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in names)
    torch.backends.cuda.enable_flash_sdp("flash" in names)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in names)
    torch.backends.cuda.enable_math_sdp("math" in names)
