"""Block-diffusion objective: the training forward is the inference forward, block by block."""

from __future__ import annotations

import warnings

import pytest
import torch

from herald.engine.reference import BlockCausalAttention
from herald.models.registry import build_model, get_preset
from herald.train.objective import (
    BlockDiffusionLoss,
    DenseDiffusionAttention,
    FlexDiffusionAttention,
    dense_block_diffusion_mask,
    diffusion_forward,
    flex_block_mask,
    long_range_tokens,
    loss_weights,
    name_token_mask,
    sample_noise,
)

B = 32
NUM_BLOCKS = 4
L = B * NUM_BLOCKS


def spec_mask(seq_len: int, block_size: int) -> torch.Tensor:
    """The 2L mask written out block by block (the BD3-LM layout): [[BD, OBC], [0, BC]]."""
    nb = seq_len // block_size
    m = torch.zeros(2 * seq_len, 2 * seq_len, dtype=torch.bool)
    for i in range(nb):
        rows = slice(i * block_size, (i + 1) * block_size)
        m[rows, rows] = True  # noisy block i <-> itself
        m[rows, seq_len : seq_len + i * block_size] = True  # noisy i -> clean < i
        m[
            seq_len + i * block_size : seq_len + (i + 1) * block_size,
            seq_len : seq_len + (i + 1) * block_size,
        ] = True
    return m


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = get_preset("tiny-sdar")
    return build_model(cfg, "cpu", torch.float64, seed=3), cfg


def backends():
    out = {"dense": DenseDiffusionAttention(dense_block_diffusion_mask(L, B))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["flex"] = FlexDiffusionAttention(flex_block_mask(L, B, "cpu"))
    return out


def test_mask_matches_the_spec() -> None:
    for n, b in [(L, B), (64, 16), (96, 32)]:
        assert torch.equal(dense_block_diffusion_mask(n, b), spec_mask(n, b))


def inputs(cfg, seed: int):
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 256, (2, L), generator=gen)
    noisy, masked, _ = sample_noise(clean, B, cfg.mask_token_id, generator=gen)
    return clean, noisy, masked


@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_training_forward_equals_inference_forward_per_block(model, kind) -> None:
    net, cfg = model
    clean, noisy, _ = inputs(cfg, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = backends()[kind]
        hidden = diffusion_forward(net, noisy, clean, attn)
    logits = net.lm_head(hidden)  # float64 (compute_logits would round to float32)
    for i in range(NUM_BLOCKS):
        blk = slice(i * B, (i + 1) * B)
        # herald's no-cache reference: [clean blocks < i ; noisy block i], block-causal mask.
        ids = torch.cat([clean[:, : i * B], noisy[:, blk]], dim=1)
        pos = torch.arange(ids.shape[1])[None].expand(2, -1)
        ref = net(ids, pos, BlockCausalAttention(B))[:, i * B :]
        torch.testing.assert_close(hidden[:, blk], ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(logits[:, blk], net.lm_head(ref), rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["dense", "flex"])
def test_noisy_block_ignores_later_blocks_and_other_noisy_blocks(model, kind) -> None:
    net, cfg = model
    clean, noisy, _ = inputs(cfg, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = backends()[kind]
        base = net.lm_head(diffusion_forward(net, noisy, clean, attn))
        i = 1
        blk = slice(i * B, (i + 1) * B)
        gen = torch.Generator().manual_seed(9)
        clean2, noisy2 = clean.clone(), noisy.clone()
        clean2[:, (i + 1) * B :] = torch.randint(
            0, 256, clean2[:, (i + 1) * B :].shape, generator=gen
        )
        clean2[:, blk] = torch.randint(0, 256, (2, B), generator=gen)  # clean copy of block i too
        noisy2[:, : i * B] = torch.randint(0, 256, (2, i * B), generator=gen)
        noisy2[:, (i + 1) * B :] = cfg.mask_token_id
        changed = net.lm_head(diffusion_forward(net, noisy2, clean2, attn))
    torch.testing.assert_close(changed[:, blk], base[:, blk], rtol=0, atol=1e-10)
    # ...while the blocks whose inputs did change do move (the test has teeth).
    assert (changed[:, (i + 1) * B :] - base[:, (i + 1) * B :]).abs().max() > 1e-3
    assert (changed[:, : i * B] - base[:, : i * B]).abs().max() > 1e-3


def test_noise_is_per_block_and_seeded() -> None:
    clean = torch.randint(3, 100, (64, 8 * B), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    noisy, masked, t = sample_noise(clean, B, 2, eps=0.01, generator=gen)
    assert torch.equal(noisy == 2, masked) and torch.equal(noisy[~masked], clean[~masked])
    tb = t.view(64, 8, B)
    assert torch.equal(tb, tb[:, :, :1].expand_as(tb))  # one ratio per block
    assert float(t.min()) >= 0.01 and float(t.max()) <= 1.0
    frac = masked.view(64, 8, B).float().mean(-1)
    assert abs(float((frac - tb[:, :, 0]).mean())) < 0.02  # masked fraction tracks t
    again = sample_noise(clean, B, 2, eps=0.01, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], noisy)
    with pytest.raises(ValueError, match="multiple"):
        sample_noise(clean[:, :40], B, 2)


def test_loss_weights() -> None:
    masked = torch.tensor([[True, False, True, True]])
    t = torch.tensor([[0.5, 0.5, 0.25, 0.25]])
    w, n = loss_weights(masked, t, "mean")
    assert w.tolist() == [[1.0, 0.0, 1.0, 1.0]] and float(n) == 3.0
    w, n = loss_weights(masked, t, "elbo")
    assert w.tolist() == [[2.0, 0.0, 4.0, 4.0]] and float(n) == 4.0
    with pytest.raises(ValueError, match="weighting"):
        loss_weights(masked, t, "other")  # type: ignore[arg-type]


def _long_range_reference(row: list[int], ngram: int, min_distance: int) -> list[bool]:
    out = []
    for i in range(len(row)):
        if i < ngram - 1:
            out.append(False)
            continue
        gram = row[i - ngram + 1 : i + 1]
        prev = [j for j in range(ngram - 1, i) if row[j - ngram + 1 : j + 1] == gram]
        out.append(bool(prev) and i - prev[-1] >= min_distance)
    return out


@pytest.mark.parametrize(("ngram", "min_distance"), [(1, 1), (1, 5), (2, 3), (3, 4), (3, 40)])
def test_long_range_tokens_match_a_brute_force_reference(ngram, min_distance) -> None:
    gen = torch.Generator().manual_seed(ngram * 100 + min_distance)
    clean = torch.randint(0, 4, (3, 96), generator=gen)  # a small vocabulary: many repeats
    got = long_range_tokens(clean, 4, ngram=ngram, min_distance=min_distance)
    assert got.dtype == torch.bool and got.shape == clean.shape
    for b in range(3):
        want = _long_range_reference(clean[b].tolist(), ngram, min_distance)
        assert got[b].tolist() == want
    assert got.any() and not got.all()


def test_long_range_tokens_flag_only_far_repeats() -> None:
    # "7 8 9" at 0..2 and again at 20..22: position 22 is 20 tokens after position 2
    row = [7, 8, 9] + [1, 2, 3, 4] * 4 + [5] + [7, 8, 9]
    clean = torch.tensor([row])
    far = long_range_tokens(clean, 10, ngram=3, min_distance=20)[0]
    assert far.nonzero().flatten().tolist() == [22]
    # the nearest repeat counts: "1 2 3" repeats every 4 tokens, so it is never 20 back
    assert not long_range_tokens(clean, 10, ngram=3, min_distance=21)[0].any()
    assert not long_range_tokens(clean[:, :2], 10, ngram=3).any()  # shorter than the n-gram
    with pytest.raises(ValueError, match="ngram"):
        long_range_tokens(clean, 10, ngram=0)
    with pytest.raises(ValueError, match="overflows"):
        long_range_tokens(torch.zeros(1, 16384, dtype=torch.long), 8192, ngram=4)


def test_name_token_mask() -> None:
    vocab = ["foo", " self.", "if", " return", ":\n", "_name", "(", " Bar", "cls", "x1", " 12"]
    mask = name_token_mask(lambda ids: vocab[ids[0]], len(vocab))
    assert [v for v, m in zip(vocab, mask.tolist(), strict=True) if m] == [
        "foo",
        "_name",
        " Bar",
        "x1",
    ]


def test_loss_weights_with_emphasis() -> None:
    masked = torch.tensor([[True, False, True, True]])
    t = torch.tensor([[0.5, 0.5, 0.25, 0.25]])
    flagged = torch.tensor([[False, True, True, False]])
    w, n = loss_weights(masked, t, "mean", emphasis=flagged, emphasis_weight=3.0)
    assert w.tolist() == [[1.0, 0.0, 3.0, 1.0]] and float(n) == 5.0
    w, n = loss_weights(masked, t, "elbo", emphasis=flagged, emphasis_weight=3.0)
    assert w.tolist() == [[2.0, 0.0, 12.0, 4.0]] and float(n) == 8.0  # 1 + 3 + 3 + 1
    same = loss_weights(masked, t, "mean", emphasis=flagged, emphasis_weight=1.0)
    assert [x.tolist() for x in same] == [x.tolist() for x in loss_weights(masked, t, "mean")]
    with pytest.raises(ValueError, match="emphasis_weight"):
        loss_weights(masked, t, "mean", emphasis=flagged, emphasis_weight=0.0)


def test_loss_decreases_on_a_tiny_model() -> None:
    torch.manual_seed(0)
    cfg = get_preset("tiny-sdar", num_layers=2)
    net = build_model(cfg, "cpu", torch.float32, seed=0)
    net.requires_grad_(True).train()
    loss_mod = BlockDiffusionLoss(net, DenseDiffusionAttention(dense_block_diffusion_mask(64, B)))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    # A repetitive sequence: learnable within a few steps.
    clean = torch.arange(64).remainder(16).add(65)[None].repeat(2, 1)
    losses = []
    for step in range(10):
        gen = torch.Generator().manual_seed(step)
        noisy, masked, t = sample_noise(clean, B, cfg.mask_token_id, generator=gen)
        w, norm = loss_weights(masked, t, "mean")
        loss = loss_mod(noisy, clean, w) / norm
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
