"""InfiniGen-style selection proxy, adapted to once per block (DESIGN §4 "infinigen").

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
        return torch.arange(s, device=q.device).expand(hkv, s).clone()
    g = hq // hkv
    qh = q.float().view(n_q, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n_q * g, d)
    qp = qh.gather(2, channels.to(q.device)[:, None, :].expand(hkv, n_q * g, r))
    scores = torch.bmm(qp, partial_keys.float().transpose(1, 2)) * d**-0.5
    imp = torch.softmax(scores, dim=-1).sum(dim=1)  # [Hkv, S]
    order = torch.sort(imp, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=-1).values
