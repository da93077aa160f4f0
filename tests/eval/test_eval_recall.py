"""Recall analysis: the oracle's importance against brute force in float64, recall 1.0 when k
covers every ranked position, values in [0, 1] and monotone otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from herald.bench.capture import capture_dense
from herald.config import SamplingParams
from herald.eval.recall import (
    VARIANTS,
    AnalysisConfig,
    _ExactAttention,
    analyse_pair,
    importance,
    recall_of,
    summarise,
    topk_mask,
)
from herald.models.registry import build_model, get_preset


def test_importance_matches_bruteforce_float64():
    g = torch.Generator().manual_seed(0)
    n_q, hkv, grp, d, s, ranked = 3, 2, 4, 16, 40, 33
    q = torch.randn(n_q, hkv * grp, d, generator=g)
    keys = torch.randn(hkv, s, d, generator=g)
    got = importance(q, keys, ranked)
    want = torch.zeros(hkv, ranked, dtype=torch.float64)
    for h in range(hkv):
        for i in range(n_q):
            for j in range(grp):
                qv = q[i, h * grp + j].double()  # query head h*G+g uses KV head h
                sc = [float(qv @ keys[h, t].double()) / math.sqrt(d) for t in range(s)]
                m = max(sc)
                z = sum(math.exp(x - m) for x in sc)
                for t in range(ranked):
                    want[h, t] += math.exp(sc[t] - m) / z
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for k in (1, 7, ranked):
        mask = topk_mask(got, k)
        for h in range(hkv):
            top = set(torch.argsort(want[h], descending=True)[:k].tolist())
            assert set(mask[h].nonzero().flatten().tolist()) == top


def test_recall_of_known_sets():
    sel = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    orc = torch.tensor([[[1, 0, 1, 0]], [[1, 1, 0, 0]]], dtype=torch.bool)  # two steps
    assert recall_of(sel, orc, 2).tolist() == [0.75]
    ties = topk_mask(torch.tensor([[1.0, 2.0, 2.0, 0.5]]), 1)
    assert ties.tolist() == [[False, True, False, False]]  # ties to the smaller position


@pytest.fixture(scope="module")
def capture():
    config = get_preset("tiny-sdar")
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (192,), generator=g).tolist()
    cap = capture_dense(model, config, prompt, 3, SamplingParams(num_denoise_steps=3))
    return model, config, cap


def test_capture_records_committed_kv_and_steps(capture):
    model, config, cap = capture
    b = config.block_size
    assert cap.block_starts == [192, 224, 256]
    assert cap.committed_k[0].shape == (config.num_kv_heads, 192 + 2 * b, config.head_dim)
    assert [len(cap.steps[s]) for s in cap.block_starts] == [3, 3, 3]
    assert all(len(f.q) == config.num_layers for f in cap.steps[224])


def test_recall_is_one_when_k_covers_the_prefix(capture):
    model, config, cap = capture
    res = analyse_pair(model, config, cap, 1, AnalysisConfig(oracle_budget=1.0, budgets=(1.0,)))
    assert res["k_oracle"] == 224 and res["num_steps"] == 3
    assert set(res["recall"]) == set(VARIANTS)
    for variant, per_budget in res["recall"].items():
        assert per_budget["1"] == [1.0] * (config.num_layers - 2), variant


def test_recall_values_sensible_below_full_budget(capture):
    model, config, cap = capture
    acfg = AnalysisConfig(oracle_budget=0.1, budgets=(0.05, 0.2, 0.6))
    pairs = [analyse_pair(model, config, cap, j, acfg) for j in (0, 1)]
    for res in pairs:
        for variant, per_budget in res["recall"].items():
            vals = {float(x): sum(v) / len(v) for x, v in per_budget.items()}
            assert all(0.0 <= v <= 1.0 for v in vals.values()), variant
            if variant not in ("rep_draft_selected", "proxy"):  # nested top-k sets
                assert vals[0.05] <= vals[0.1] <= vals[0.2] <= vals[0.6], variant
        # MAGE's selection is the oracle of step 0: at k = k_o, at least 1/T of recall.
        assert min(res["recall"]["block_completed"]["0.1"]) >= 1 / res["num_steps"] - 1e-6
    s = summarise([{"example": "x", **p} for p in pairs], 0.1)
    assert s["num_pairs"] == 2 and sum(b["count"] for b in s["fig7"]) == 2 * (config.num_layers - 2)
    # the unbucketed Fig. 7 group: every (pair, layer), so each bar is the variant's mean at k_o
    assert s["fig7_all"]["count"] == 2 * (config.num_layers - 2)
    for v in ("rep_omitted", "rep_draft", "rep_completed"):
        assert s["fig7_all"][v] == pytest.approx(s["mean"][v]["0.1"])


def test_exact_backend_reproduces_the_engines_step0(capture):
    """The analysis' own forward (committed KV + a [MASK] block, exact attention) reproduces the
    dense engine's recorded step 0 of that block: same own keys up to bf16 rounding, same top-k."""
    model, config, cap = capture
    b, s_n = config.block_size, 224
    s1 = s_n + b
    ck = [t[:, :s1] for t in cap.committed_k]
    cv = [t[:, :s1] for t in cap.committed_v]
    att = _ExactAttention(ck, cv, s_n, self_attend=True, num_dense=2)
    ids = torch.full((1, b), config.mask_token_id)
    with torch.inference_mode():
        model(ids, torch.arange(s1, s1 + b)[None], att)
    step0 = cap.steps[s1][0]
    for layer in range(2, config.num_layers):
        torch.testing.assert_close(
            att.kv[layer][0], step0.k[layer].transpose(0, 1), atol=0.1, rtol=0.05
        )
        keys = torch.cat([ck[layer], step0.k[layer].transpose(0, 1)], dim=1)
        want = topk_mask(importance(step0.q[layer], keys, s_n), 56)
        got = topk_mask(att.imp[layer], 56)
        assert (want & got).sum() >= 0.95 * want.sum()


def test_several_representative_queries_sum_their_importances(capture):
    """rep2/rep4: [MASK] queries at the centres of equal parts of the block attend to the prefix
    and not to each other, so their joint importance is the sum of each query's own (what the
    kernel ranks for n_q queries), and one query at S + B/2 is HERALD's representative query."""
    model, config, cap = capture
    b, s_n = config.block_size, 224
    s1 = s_n + b
    pk = [t[:, :s_n] for t in cap.committed_k]
    pv = [t[:, :s_n] for t in cap.committed_v]
    positions = [s1 + (2 * i + 1) * b // 8 for i in range(4)]
    assert positions == [s1 + 4, s1 + 12, s1 + 20, s1 + 28]

    def imp(pos):
        att = _ExactAttention(pk, pv, s_n, self_attend=False, num_dense=2)
        ids = torch.full((1, len(pos)), config.mask_token_id)
        with torch.inference_mode():
            model(ids, torch.tensor(pos)[None], att)
        return att.imp

    joint, alone = imp(positions), [imp([p]) for p in positions]
    for layer in range(2, config.num_layers):
        torch.testing.assert_close(joint[layer], sum(a[layer] for a in alone), atol=1e-3, rtol=1e-3)
