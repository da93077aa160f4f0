"""Sampler: the distribution it returns is the one its tokens and confidences come from."""

from __future__ import annotations

import torch

from herald.config import SamplingParams
from herald.diffusion.sampler import sample, sample_tokens, top_logprobs


def _logits(seed=0, n=6, vocab=50):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_confidence_is_the_tokens_probability_under_the_returned_distribution():
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.8, seed=2),
    ):
        gen = None if params.greedy else torch.Generator().manual_seed(4)
        s = sample(_logits(), params, mask_token_id=3, generator=gen)
        assert torch.equal(s.conf, s.probs.gather(-1, s.tokens[:, None]).squeeze(-1))
        assert torch.all(s.probs[:, 3] == 0)
        assert torch.allclose(s.probs.sum(-1), torch.ones(len(s.tokens)))
        gen = None if params.greedy else torch.Generator().manual_seed(4)
        tok, conf = sample_tokens(_logits(), params, 3, gen)
        assert torch.equal(tok, s.tokens) and torch.equal(conf, s.conf)


def test_top_logprobs_of_a_filtered_distribution():
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    s = sample(_logits(1), params, mask_token_id=0, generator=torch.Generator().manual_seed(0))
    lp, ids = top_logprobs(s.probs, 4)
    assert lp.shape == ids.shape == (6, 4)
    assert torch.all(torch.isfinite(lp[:, :2])) and torch.all(lp[:, 2:] == float("-inf"))
    assert torch.allclose(lp[:, :2].exp().sum(-1), torch.ones(6))
    # the sampled token is one of the two kept, with its own probability
    hit = ids[:, :2] == s.tokens[:, None]
    assert torch.all(hit.any(-1))
    assert torch.equal(lp[:, :2][hit], s.conf.log())
