"""Token sampler: logits -> (token, confidence) for the masked positions of a block.

Confidence is the probability of the chosen token under the distribution the sampler drew it from,
as in the reference generators (docs/MODELS.md §8): greedy decoding takes the argmax of
``softmax(logits)`` and its probability (deterministic); sampling draws from
``softmax(filter(logits / temperature))`` (top-k, then top-p) and reports the drawn token's
probability under that same tempered, filtered distribution. The mask token itself is never chosen
(its logit is set to -inf first, as dInfer does), so an accepted position can never hold the mask
id and the distribution is over the other tokens. The log of the confidence at the step a
position is accepted is the token's recorded log-probability (``Request.output_logprobs``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from herald.config import MIN_TEMPERATURE, SamplingParams


class Sampled(NamedTuple):
    """One sampler call's result for N positions, on the logits' device."""

    tokens: torch.Tensor
    """[N] int64, the chosen tokens."""
    conf: torch.Tensor
    """[N] float32, each chosen token's probability under ``probs``."""
    probs: torch.Tensor
    """[N, vocab] float32, the distribution the tokens were chosen from (mask token: 0)."""


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


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> Sampled:
    """Choose a token at each position; also return its probability and the distribution.

    Args:
        logits: [N, vocab] float32, any device (one request's positions when sampling; any rows
            when greedy). Its mask-token column is overwritten with -inf.
        params: temperature / top_k / top_p.
        mask_token_id: never chosen.
        generator: torch.Generator on ``logits.device`` for temperature > 0 (seeded per request).

    Returns:
        :class:`Sampled`, on ``logits.device``. No host synchronisation.
    """
    logits = logits.float()
    logits[..., mask_token_id] = float("-inf")
    if params.greedy:
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        return Sampled(tokens, conf, probs)
    # NOTE: a tiny temperature would overflow float32 logits to inf (softmax -> NaN).
    temperature = max(params.temperature, MIN_TEMPERATURE)
    logits = _filter_logits(logits / temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    return Sampled(tokens, conf, probs)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    mask_token_id: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample` without the distribution: tokens [N] int64 and confidence [N] float32."""
    tokens, conf, _ = sample(logits, params, mask_token_id, generator)
    return tokens, conf


def top_logprobs(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` most likely tokens of each row of ``probs`` [N, vocab]: (log-probabilities
    [N, n] float32, descending, and token ids [N, n] int64). A token the sampler could not choose
    (filtered out, or the mask token) has probability 0, so log-probability -inf."""
    vals, ids = torch.topk(probs, min(n, probs.shape[-1]), dim=-1)
    return vals.log(), ids
