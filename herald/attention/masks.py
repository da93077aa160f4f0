"""Attention masks of the slot backend (:class:`herald.attention.slots.SlotAttention`).

All masks are bool, True = the key is visible, shaped to broadcast against SDPA's
``[bs, heads, queries, keys]`` scores. ``prefix`` is a ``[bs]`` int tensor of rows already in a
row's store before the current tokens; ``kv_len`` is the key length of the call.
"""

from __future__ import annotations

import torch


def key_mask(prefix: torch.Tensor, visible: int, kv_len: int) -> torch.Tensor:
    """``[bs, 1, 1, kv_len]``: row i sees keys ``< prefix[i] + visible`` (a denoising step or a
    commit forward: the prefix plus the block itself, bidirectionally)."""
    keys = torch.arange(kv_len, device=prefix.device)
    return (keys[None, :] < (prefix + visible)[:, None])[:, None, None, :]


def draft_group_mask(prefix: torch.Tensor, block: int, kv_len: int) -> torch.Tensor:
    """``[bs, 1, 1, kv_len]``: the draft group's keys, ``< prefix`` or in the draft rows
    ``[prefix + B, prefix + 2B)``. The draft attends to the prefix and to itself, never to the
    block being denoised (HERALD §IV-A1: the two groups of the fused 2B forward are independent)."""
    keys = torch.arange(kv_len, device=prefix.device)[None, :]
    p = prefix[:, None]
    return ((keys < p) | ((keys >= p + block) & (keys < p + 2 * block)))[:, None, None, :]


def block_causal_chunk_mask(
    start: int, length: int, block: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """``[1, 1, length, kv_len]`` for a prefill chunk of one request starting at store row
    ``start``: query t (chunk-relative) sees rows ``< start + (t // B + 1) * B``, i.e. every
    earlier block and its own block (block-causal: bidirectional inside a block)."""
    t = torch.arange(length, device=device)
    limit = start + (t // block + 1) * block
    keys = torch.arange(kv_len, device=device)
    return (keys[None, :] < limit[:, None])[None, None]


def block_causal_mask(length: int, block: int, device: torch.device) -> torch.Tensor:
    """``[L, L]`` for a full re-forward of a canvas: a key is visible when its block is not
    after the query's."""
    blk = torch.arange(length, device=device) // block
    return blk[None, :] <= blk[:, None]
