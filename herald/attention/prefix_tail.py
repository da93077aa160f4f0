"""A few queries over a store's prefix rows plus a tail block: the retrieval stream's dense layers.

The representative query of block n+1 (HERALD §IV-A2) attends, on the layers whose full KV stays
on the GPU, to the committed prefix and to the tail block: block n's draft (lookahead) or block n
itself once committed. The two spans are not contiguous in the store when the draft sits after
the current block's rows, hence the explicit mask.
"""

from __future__ import annotations

import torch

from herald.attention.sdpa import padded_kv_len, sdpa_folded


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

    Args:
        q: [bs, n_q, Hq, D]; keys/values: [bs, Hkv, cap, D] (one layer of a store, slot order).
        prefix, tail_start: per row, in store rows; tail_len: rows of the tail (0 = none).
        kv_pad: round the key length up to a multiple of it (masked), as the slot backend does.

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
    return sdpa_folded(q, keys[:, :, :end], values[:, :, :end], mask[:, None, None, :])
