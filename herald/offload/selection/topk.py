"""The importance and top-k rule every selection path shares (HERALD §IV-B4).

For KV head h with G query heads, queries q and keys k: ``score[q, g, s] = q_{q,g} . k_s /
sqrt(D)``, ``imp[s] = sum_{q,g} softmax_s(score)[q, g, s]`` (softmax over every key of the row, an
always-included tail too), and the selection is the ``k`` ranked positions of largest importance,
ties toward the smaller position, returned in ascending order. The CPU kernel
(:mod:`herald.offload.selection.cpu`) implements the same rule natively; its reference
(:mod:`~herald.offload.selection.ref`), the GPU selection
(:mod:`~herald.offload.selection.gpu_topk`) and InfiniGen's proxy
(:mod:`~herald.offload.selection.proxy`) call these functions.
"""

from __future__ import annotations

import torch


def group_queries(q: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n_q, Hq, D]`` queries -> ``[Hkv, n_q * G, D]`` in ``dtype``: the rows of KV head h
    are query heads ``h*G .. h*G+G-1`` of every query (row = query * G + g)."""
    n_q, hq, d = q.shape
    g = hq // num_kv_heads
    return (
        q.to(dtype)
        .view(n_q, num_kv_heads, g, d)
        .permute(1, 0, 2, 3)
        .reshape(num_kv_heads, n_q * g, d)
    )


def scores(grouped_q: torch.Tensor, keys: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[Hkv, Q, D]`` x ``[Hkv, S, D']`` -> ``[Hkv, Q, S]`` scaled by ``head_dim ** -0.5`` (D'
    may be fewer channels than D: a proxy's partial keys, scaled as the full product)."""
    return torch.matmul(grouped_q, keys.transpose(1, 2)) * head_dim**-0.5


def importance(score: torch.Tensor) -> torch.Tensor:
    """``[Hkv, Q, S]`` scores -> ``[Hkv, S]``: softmax over S, summed over the Q query rows."""
    return torch.softmax(score, dim=-1).sum(dim=1)


def topk_ascending(imp: torch.Tensor, k: int) -> torch.Tensor:
    """``[Hkv, R]`` importance -> ``[Hkv, k]`` int64 positions of the k largest, ties toward the
    smaller position (a stable descending sort), ascending."""
    order = torch.sort(imp, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=-1).values


def all_positions(num_kv_heads: int, n: int, device: torch.device) -> torch.Tensor:
    """``[Hkv, n]`` int64 ``0..n-1`` per head: the selection when the budget covers every
    ranked position."""
    return torch.arange(n, device=device).expand(num_kv_heads, n).clone()
