"""Scaled-dot-product attention calls shared by the backends, and key-length padding.

GQA is folded into the query length (``q`` viewed as ``[bs, Hkv, G*L, D]``) wherever every query
of a row sees the same keys, which holds for denoising steps: on an H200 at batch 16 x 32K keys
this runs in 0.27-0.39 ms against 0.78 ms for SDPA's own GQA path (``enable_gqa=True``) and
0.97 ms (+2.2 ms to expand) for K/V expanded to the query heads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from herald.attention.masks import block_causal_chunk_mask
from herald.env import settings


def padded_kv_len(n: int, kv_pad: int) -> int:
    """``n`` keys rounded up to a multiple of ``kv_pad`` (0: ``n``): the key length a padded
    backend attends over, and the store capacity an engine allocates for it."""
    return -(-n // kv_pad) * kv_pad if kv_pad > 0 else n


def sdpa_folded(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [bs, L, Hq, D] against keys/values [bs, Hkv, S, D]; GQA folded into the query length.

    Exact whenever every query of a row sees the same keys (mask [bs, 1, 1, S] bool or None).
    Returns [bs, L, Hq, D].
    """
    bs, length, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    qf = q.view(bs, length, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * length, d)
    if qf.is_cuda:
        configure_sdpa_backends()
    o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
    return o.view(bs, hkv, g, length, d).permute(0, 3, 1, 2, 4).reshape(bs, length, hq, d)


def sdpa_gqa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-query masks (prefill chunks): q [bs, L, Hq, D] -> [bs, L, Hq, D]."""
    g = q.shape[2] // keys.shape[1]
    if q.is_cuda:
        # A per-query mask rules out the flash and cuDNN GQA paths and the memory-efficient
        # kernel refuses GQA, so K/V are expanded to the query heads (a transient [Hq, S, D]
        # per layer) rather than falling back to the math kernel (20x slower).
        keys = keys.repeat_interleave(g, dim=1)
        values = values.repeat_interleave(g, dim=1)
        configure_sdpa_backends()
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
        )
    return o.transpose(1, 2)


CPU_PREFILL_TILE = 512
"""Query positions per SDPA call of a block-causal prefill chunk on the CPU (rounded down to
whole blocks): each tile attends only to the keys up to its own last block, so the chunk's
masked upper triangle is mostly never computed (a 4,096-token chunk from position 0 on one
core: 0.80 s per layer of code-sdar's heads against 1.45 s in one call)."""


def sdpa_block_causal(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, block: int
) -> torch.Tensor:
    """A prefill chunk of one request: q [1, L, Hq, D] at store rows ``[start, start + L)``
    (``start`` a whole number of blocks) against keys/values [1, Hkv, S, D], S >= start + L; query t
    sees keys ``< start + (t // block + 1) * block``. On CUDA one call with the chunk's mask; on
    the CPU in tiles of :data:`CPU_PREFILL_TILE` queries, each over its visible keys only.
    Returns [1, L, Hq, D]."""
    length = q.shape[1]
    tile = length if q.is_cuda else max(block, CPU_PREFILL_TILE // block * block)
    outs = []
    for s in range(0, length, tile):
        e = min(length, s + tile)
        kv_len = start + e
        mask = block_causal_chunk_mask(start + s, e - s, block, kv_len, q.device)
        outs.append(sdpa_gqa(q[:, s:e], keys[:, :, :kv_len], values[:, :, :kv_len], mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def configure_sdpa_backends() -> None:
    """Apply ``HERALD_SDPA_BACKENDS`` (:mod:`herald.env`): the SDPA kernels allowed
    process-wide; unset, PyTorch's own pick. Called before every CUDA attention call; applies a
    setting once (PyTorch's switches are global, not per thread, so they are set once rather
    than around each call, which would race with the retrieval thread).

    NOTE: PyTorch's pick for the engines' shapes is cuDNN, the fastest kernel at steady state,
    but cuDNN builds an execution plan on the host for every new key length (hundreds of ms at
    size); the key-length padding (``kv_pad``) bounds how often that happens. The setting exists
    to measure that trade-off.
    """
    _configure(settings().sdpa_backends)


@functools.cache
def _configure(names: tuple[str, ...] | None) -> None:
    if names is None:
        return
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in names)
    torch.backends.cuda.enable_flash_sdp("flash" in names)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in names)
    torch.backends.cuda.enable_math_sdp("math" in names)
