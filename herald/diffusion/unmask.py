"""Unmask policy: which masked positions of a block accept their token at this step.

Two modes, per request:
- threshold: every masked position with confidence strictly greater than ``threshold``, and at
  least the single most confident masked position (docs/MODELS.md §9: ``conf > thr`` else top-1).
- fixed steps T: exactly ``ceil(masks_left / steps_left)`` most confident masked positions, so the
  block completes in T steps (or in ``masks_left`` steps if that is smaller).
The fallback count is clamped to the masks left; accepted positions are never re-masked (the caller
only ever clears mask bits).
"""

from __future__ import annotations

import torch


def min_accept_count(
    num_masked: torch.Tensor, steps_done: torch.Tensor, num_denoise_steps: torch.Tensor
) -> torch.Tensor:
    """Per-request minimum number of positions to accept this step.

    Args:
        num_masked: [bs] int64, masks left in each block (> 0 for requests that denoise).
        steps_done: [bs] int64, denoising steps already run on the current block.
        num_denoise_steps: [bs] int64, T for fixed-steps requests, 0 for threshold requests.

    Returns:
        [bs] int64: 1 for threshold requests, ``ceil(masks_left / max(T - steps_done, 1))`` for
        fixed-steps requests, always clamped to ``[1, masks_left]``.
    """
    steps_left = (num_denoise_steps - steps_done).clamp(min=1)
    fixed = (num_masked + steps_left - 1) // steps_left
    k = torch.where(num_denoise_steps > 0, fixed, torch.ones_like(num_masked))
    return torch.minimum(k.clamp(min=1), num_masked.clamp(min=1))


def select_unmask(
    confidence: torch.Tensor,
    masked: torch.Tensor,
    threshold: torch.Tensor,
    min_count: torch.Tensor,
    use_threshold: torch.Tensor,
) -> torch.Tensor:
    """Choose the positions that accept their token.

    Args:
        confidence: [bs, B] float32, confidence of the candidate token at each position (values at
            unmasked positions are ignored).
        masked: [bs, B] bool, True where the position is still a mask.
        threshold: [bs] float32, per-request threshold.
        min_count: [bs] int64, from :func:`min_accept_count`.
        use_threshold: [bs] bool, True for threshold-mode requests.

    Returns:
        [bs, B] bool, a subset of ``masked``; every row with a mask has at least one True.
    """
    conf = confidence.masked_fill(~masked, float("-inf"))
    # Rank positions by confidence (stable: ties go to the lower position).
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    top = rank < min_count[:, None]
    above = (conf > threshold[:, None]) & use_threshold[:, None]
    return (top | above) & masked
