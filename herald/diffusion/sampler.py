"""Token sampler: logits -> (token, confidence) for the masked positions of a block.

Confidence is the probability of the chosen token under the (filtered) distribution that chose it,
as in the reference generators (docs/MODELS.md §8). Greedy decoding takes the argmax
and its softmax probability; it is deterministic. The mask token itself is never chosen (its logit
is set to -inf first, as dInfer does), so an accepted position can never hold the mask id.
"""

from __future__ import annotations

import torch

from herald.config import MIN_TEMPERATURE, SamplingParams


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering over the last dim (values below the cut become -inf)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass *before* it already exceeds top_p; the first token always
        # stays.
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose a token and its confidence at each position.

    Args:
        logits: [N, vocab] float32, any device (one request's positions when sampling; any rows
            when greedy).
        params: temperature / top_k / top_p.
        mask_token_id: never chosen.
        generator: torch.Generator on ``logits.device`` for temperature > 0 (seeded per request).

    Returns:
        tokens [N] int64 and confidence [N] float32, on ``logits.device``.
    """
    logits = logits.float()
    logits[..., mask_token_id] = float("-inf")
    if params.greedy:
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        return tokens, conf
    # NOTE: a tiny temperature would overflow float32 logits to inf (softmax -> NaN).
    temperature = max(params.temperature, MIN_TEMPERATURE)
    logits = _filter_logits(logits / temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, conf
