"""InfiniGen-style selection proxy, adapted to once per block (docs/ARCHITECTURE.md, "Modes").

Offline, from the weights alone, each KV head of each layer gets a few "proxy" channels: the
head-dim channels whose query and key magnitudes are largest, so that the partial dot product
over them ranks keys like the full one. Online, the engine keeps the keys' proxy channels on the
GPU (a partial key cache) and at the first denoising step of each block scores every prefix
position with the block's queries on those channels; the top-k rows are fetched from the CPU pool
and reused for the rest of the block.

Channel score for KV head h, channel c: ``|w_qnorm[c]| * |w_knorm[c]| * mean_g ||W_q[(h,g), c]||
* ||W_k[h, c]||`` (the per-channel QK-norm gain times the projection's column norms). RoPE rotates
channels c and c + rotary_dim/2 together, so rotated channels are scored and kept in pairs.
"""

from __future__ import annotations

import math

import torch

from herald.models.common import QKNormDecoderLayer
from herald.offload.selection.topk import (
    all_positions,
    group_queries,
    importance,
    scores,
    topk_ascending,
)


@torch.no_grad()
def proxy_channels(layer: QKNormDecoderLayer, ratio: float) -> torch.Tensor:
    """Proxy channels of one decoder layer.

    Args:
        layer: a :class:`~herald.models.common.QKNormDecoderLayer` (``qkv_proj``, ``q_norm``,
            ``k_norm``, ``rotary``, ``num_heads``, ``num_kv_heads``, ``head_dim``).
        ratio: fraction of head_dim kept (0, 1].

    Returns:
        [num_kv_heads, r] int64 channel ids, ascending per head, r = ceil(ratio * head_dim)
        rounded up to an even count when pairs are taken.
    """
    nh, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    g = nh // hkv
    w = layer.qkv_proj.weight.float()
    wq = w[: nh * d].view(hkv, g, d, -1).norm(dim=-1).mean(dim=1)  # [Hkv, D]
    wk = w[nh * d : nh * d + hkv * d].view(hkv, d, -1).norm(dim=-1)  # [Hkv, D]
    gain = layer.q_norm.weight.float().abs() * layer.k_norm.weight.float().abs()
    score = wq * wk * gain[None]  # [Hkv, D]
    rot = int(layer.rotary.rotary_dim)
    half = rot // 2
    # Units: a rotated pair (c, c + half) or a pass-through channel.
    units = [(c, c + half) for c in range(half)] + [(c,) for c in range(rot, d)]
    r = max(1, math.ceil(ratio * d))
    unit_score = torch.stack([score[:, list(u)].sum(-1) for u in units], dim=-1)  # [Hkv, U]
    order = unit_score.argsort(dim=-1, descending=True)
    out = []
    for h in range(hkv):
        chans: list[int] = []
        for ui in order[h].tolist():
            if len(chans) >= r:
                break
            chans.extend(units[ui])
        out.append(chans)
    width = min(len(c) for c in out)  # equal width for every head (a pair may lose one half)
    return torch.tensor([sorted(c[:width]) for c in out], dtype=torch.long)


def proxy_topk(
    q: torch.Tensor, partial_keys: torch.Tensor, channels: torch.Tensor, budget: int
) -> torch.Tensor:
    """Top-``budget`` prefix positions per KV head from the proxy scores.

    Args:
        q: [n_q, Hq, D] the block's queries (post-RoPE).
        partial_keys: [Hkv, S, r] the ranked prefix's keys on the proxy channels.
        channels: [Hkv, r] from :func:`proxy_channels`.
        budget: k.

    Returns:
        [Hkv, min(budget, S)] int64 positions, ascending.
    """
    n_q, hq, d = q.shape
    hkv, s, r = partial_keys.shape
    k = min(budget, s)
    if k <= 0:
        return torch.empty(hkv, 0, dtype=torch.long, device=q.device)
    if k == s:
        return all_positions(hkv, s, q.device)
    qh = group_queries(q, hkv, torch.float32)
    qp = qh.gather(2, channels.to(q.device)[:, None, :].expand(hkv, qh.shape[1], r))
    return topk_ascending(importance(scores(qp, partial_keys.float(), d)), k)
