"""The Triton kernel of :mod:`herald.layers.router_triton` (imported only where Triton is)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _top2_sums(b, BLOCK_T: tl.constexpr, G: tl.constexpr, PG: tl.constexpr):
    """[BLOCK_T, E] biased scores -> [BLOCK_T, G]: the sum of each group's two largest."""
    grp = tl.reshape(b, (BLOCK_T, G, PG))
    first = tl.max(grp, axis=2)
    at = tl.argmax(grp, axis=2)
    j = tl.arange(0, PG)
    rest = tl.where(j[None, None, :] == at[:, :, None], float("-inf"), grp)
    return first + tl.max(rest, axis=2)


@triton.jit
def _kept_experts(gs, BLOCK_T: tl.constexpr, G: tl.constexpr, PG: tl.constexpr,
                  TOPK_GROUP: tl.constexpr):  # fmt: skip
    """[BLOCK_T, G] group scores -> [BLOCK_T, E] bool: the experts of the TOPK_GROUP best groups
    (ties to the lower group)."""
    g = tl.arange(0, G)
    kept = tl.zeros((BLOCK_T, G), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        hit = g[None, :] == tl.argmax(gs, axis=1)[:, None]
        kept = tl.where(hit, 1, kept)
        gs = tl.where(hit, float("-inf"), gs)
    wide = tl.broadcast_to(kept[:, :, None], (BLOCK_T, G, PG))
    return tl.reshape(wide, (BLOCK_T, G * PG)) != 0


@triton.jit
def group_limited_topk(
    logits_ptr, bias_ptr, idx_ptr, weight_ptr, num_tokens, scale,
    E: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_T tokens, each token's E router logits in registers: sigmoid, the
    bias, the group-limited choice and the top K in descending biased order (K argmax passes,
    ties to the lower expert), the unbiased weights normalised and scaled."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < num_tokens
    e = tl.arange(0, E)
    x = tl.load(logits_ptr + t[:, None] * E + e[None, :], mask=live[:, None], other=0.0)
    s = 1.0 / (1.0 + tl.exp(-x))
    b = s + tl.load(bias_ptr + e)[None, :]
    keep = _kept_experts(_top2_sums(b, BLOCK_T, G, E // G), BLOCK_T, G, E // G, TOPK_GROUP)
    masked = tl.where(keep, b, float("-inf"))
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int64)
    ws = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for k in tl.static_range(K):
        pick = tl.argmax(masked, axis=1)
        hit = e[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, s, 0.0), axis=1)
        ids = tl.where(slot[None, :] == k, pick[:, None].to(tl.int64), ids)
        ws = tl.where(slot[None, :] == k, w[:, None], ws)
        masked = tl.where(hit, float("-inf"), masked)
    if K > 1:
        ws = ws / (tl.sum(ws, axis=1)[:, None] + 1e-20)
    out = t[:, None] * K + slot[None, :]
    ok = live[:, None] & (slot[None, :] < K)
    tl.store(idx_ptr + out, ids, mask=ok)
    tl.store(weight_ptr + out, ws * scale, mask=ok)
