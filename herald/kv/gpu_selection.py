"""Top-k selection with PyTorch on the model's device (DESIGN §4: MAGE with GPU selection, and the
first block's exact B-query selection at prefill).

Same importance as the CPU kernel (:func:`herald.kv.selection.select_topk`): for KV head h,
``imp[s] = sum_{q,g} softmax_s(q_{q,g} . k_s / sqrt(D))`` over all S keys of the row, top-k over the
ranked positions ``[0, S - tail)``, indices ascending. Computed per request in float32.
"""

from __future__ import annotations

import torch


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
    n_q, hq, d = q.shape
    hkv = keys.shape[0]
    g = hq // hkv
    ranked = seq_len - tail_len
    k = min(budget, ranked)
    if k <= 0:
        return torch.empty(hkv, 0, dtype=torch.long, device=q.device)
    qf = q.float().view(n_q, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n_q * g, d)
    scores = torch.bmm(qf, keys[:, :seq_len].float().transpose(1, 2)) * d**-0.5
    imp = torch.softmax(scores, dim=-1).sum(dim=1)[:, :ranked]  # [Hkv, ranked]
    if k == ranked:
        return torch.arange(ranked, device=q.device).expand(hkv, ranked).clone()
    # Ties toward the smaller position: stable sort on descending importance.
    order = torch.sort(imp, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=-1).values
