"""Top-k selection with PyTorch on the model's device: MAGE with GPU selection, and the first
block's exact B-query selection at prefill (the prompt's KV is still on the GPU then).

Same rule as the CPU kernel (:mod:`herald.offload.selection.topk`), computed per request in
float32.
"""

from __future__ import annotations

import torch

from herald.offload.selection.topk import (
    all_positions,
    group_queries,
    importance,
    scores,
    topk_ascending,
)


def select_topk_rows(
    q: torch.Tensor,
    keys: torch.Tensor,
    seq_len: int,
    tail_len: int,
    budget: int,
) -> torch.Tensor:
    """Select the top-``budget`` positions per KV head for one request.

    Args:
        q: [n_q, Hq, D] queries (any float dtype), same device as ``keys``.
        keys: [Hkv, >= seq_len, D] the request's keys in logical order.
        seq_len: S, keys attended; tail_len: trailing keys attended but never selected.
        budget: k per KV head.

    Returns:
        [Hkv, min(budget, S - tail_len)] int64 positions, ascending per head.
    """
    hkv, d = keys.shape[0], q.shape[2]
    ranked = seq_len - tail_len
    k = min(budget, ranked)
    if k <= 0:
        return torch.empty(hkv, 0, dtype=torch.long, device=q.device)
    qf = group_queries(q, hkv, torch.float32)
    imp = importance(scores(qf, keys[:, :seq_len].float(), d))[:, :ranked]
    if k == ranked:
        return all_positions(hkv, ranked, q.device)
    return topk_ascending(imp, k)
