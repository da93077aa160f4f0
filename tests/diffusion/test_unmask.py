import pytest
import torch

from herald.config import SamplingParams
from herald.diffusion.block import BlockLayout
from herald.diffusion.sampler import sample_tokens
from herald.diffusion.unmask import min_accept_count, select_unmask


def _sel(conf, masked, thr=0.95, k=None, fixed=False):
    conf = torch.tensor([conf], dtype=torch.float32)
    masked = torch.tensor([masked])
    n = masked.sum(-1)
    k = torch.tensor([k]) if k is not None else torch.ones_like(n)
    return select_unmask(conf, masked, torch.tensor([thr]), k, torch.tensor([not fixed]))[
        0
    ].tolist()


def test_threshold_is_strictly_greater():
    assert _sel([0.95, 0.96, 0.5, 0.97], [True] * 4) == [False, True, False, True]


def test_at_least_one_most_confident_when_none_passes():
    assert _sel([0.2, 0.6, 0.5, 0.1], [True] * 4) == [False, True, False, False]


def test_never_touches_unmasked_positions():
    # Position 1 is already decoded: its (high) confidence must not count.
    assert _sel([0.2, 0.99, 0.5, 0.1], [True, False, True, True]) == [False, False, True, False]


def test_fallback_clamped_to_masks_left():
    # Fixed mode asks for 3 but only 2 masks are left: exactly those 2, nothing else.
    n = torch.tensor([2])
    k = min_accept_count(n, torch.tensor([0]), torch.tensor([1]))
    assert k.tolist() == [2]
    assert _sel([0.9, 0.8, 0.7, 0.6], [False, True, False, True], k=2, fixed=True) == [
        False,
        True,
        False,
        True,
    ]


def test_fixed_steps_schedule_finishes_in_t_steps():
    masks, steps, t = 32, 0, 20
    while masks:
        k = int(min_accept_count(torch.tensor([masks]), torch.tensor([steps]), torch.tensor([t])))
        masks -= k
        steps += 1
    assert steps == 20


def test_fixed_mode_ignores_threshold():
    assert _sel([0.99, 0.98, 0.97, 0.1], [True] * 4, k=1, fixed=True) == [True, False, False, False]


def test_ties_go_to_lower_position():
    assert _sel([0.5, 0.5, 0.5], [True] * 3) == [True, False, False]


def test_threshold_mode_min_count_is_one():
    k = min_accept_count(torch.tensor([5, 1]), torch.tensor([3, 0]), torch.tensor([0, 0]))
    assert k.tolist() == [1, 1]


def test_block_layout():
    lay = BlockLayout(prompt_len=70, block_size=32, max_new_tokens=40)
    assert lay.num_prefill_tokens == 64 and lay.prompt_tail_len == 6
    assert lay.total_len == 128 and lay.num_decode_blocks == 2
    with pytest.raises(ValueError, match="empty"):
        BlockLayout(0, 32, 10)


def test_sampler_greedy_and_mask_excluded():
    logits = torch.randn(5, 11)
    logits[:, 3] = 100.0  # the mask id would win the argmax
    tok, conf = sample_tokens(logits.clone(), SamplingParams(), mask_token_id=3)
    assert (tok != 3).all()
    ref = logits.clone()
    ref[:, 3] = float("-inf")
    assert torch.equal(tok, ref.argmax(-1))
    assert torch.allclose(conf, torch.softmax(ref, -1).max(-1).values)


def test_sampler_seeded_and_filters():
    logits = torch.randn(64, 50)
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1)
    g1 = torch.Generator().manual_seed(1)
    g2 = torch.Generator().manual_seed(1)
    t1, c1 = sample_tokens(logits.clone(), p, 0, g1)
    t2, c2 = sample_tokens(logits.clone(), p, 0, g2)
    assert torch.equal(t1, t2) and torch.equal(c1, c2)
    ref = logits.clone()
    ref[:, 0] = float("-inf")  # the mask id (0 here) is never a candidate
    top5 = ref.topk(5, -1).indices
    assert (top5 == t1[:, None]).any(-1).all()


def test_sampling_params_validation():
    for bad in (
        dict(max_new_tokens=0),
        dict(threshold=0.0),
        dict(threshold=1.5),
        dict(top_p=0.0),
        dict(temperature=-1.0),
        dict(num_denoise_steps=0),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate()
