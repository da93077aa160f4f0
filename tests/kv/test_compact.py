"""The compact first pass (int8 K, certified bounds, exact re-rank): its indices always equal the
exact kernel's; its candidate sets hold the top-k; a loosened bound is caught."""

from __future__ import annotations

import math

import pytest
import torch
from selection_utils import Inputs, make_inputs, reference

from herald.kv.compact_keys import RESIDUAL, quantize_keys
from herald.offload.selection import compact, compact_cpu
from herald.offload.selection.compact import CERTIFIED, VIOLATION, select_topk_compact_torch
from herald.offload.selection.cpu import select_topk

BEST = compact_cpu.best_isa()
needs_native = pytest.mark.skipif(BEST is None, reason="native library unavailable")


def _available() -> list[str]:
    """The compact pass's ISAs this CPU runs, best first."""
    if BEST is None:
        return []
    order = ["avx512", "avx2", "portable"]
    return order[order.index(BEST) :] if BEST in order else ["portable"]


ISAS = _available()


def _run(inp: Inputs, isa: str, **kw: object):
    k8, s = quantize_keys(inp.k_pages)
    stats: list[compact.CompactStats] = []
    res = compact_cpu.select_topk_compact(
        *inp.args(), k8_pages=k8, scale_pages=s, tail_lens=inp.tail_lens, stats_out=stats,
        isa=isa, num_threads=2, **kw,
    )  # fmt: skip
    return res, stats[0]


def _exact(inp: Inputs, **kw: object):
    return select_topk(
        *inp.args(), tail_lens=inp.tail_lens, output_mode="selected", num_threads=2, **kw
    )


CASES = [  # (group, n_q, q_scale, seq_lens, budgets, tails, page_size, head_dim)
    (1, 1, 2.0, [300, 77, 1000, 5], [40, 7, 50, 9], [32, 0, 32, 2], 32, 128),
    (4, 1, 2.0, [300, 77, 1000, 5], [40, 7, 50, 9], [32, 0, 32, 2], 32, 128),
    (4, 1, 8.0, [700, 64, 333], [35, 64, 17], [32, 32, 0], 32, 128),
    (8, 1, 6.0, [257, 1200], [30, 60], [0, 16], 16, 64),
    (4, 4, 2.0, [450, 90], [23, 9], [32, 0], 32, 128),
    (1, 1, 0.5, [1000, 1], [50, 1], [0, 0], 32, 128),
    (2, 2, 4.0, [513, 200], [100, 200], [1, 7], 8, 96),
]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_indices_equal_the_exact_kernel(isa: str, case: int) -> None:
    group, n_q, qs, lens, budgets, tails, page, d = CASES[case]
    inp = make_inputs(
        100 + case, lens, budgets, n_q=n_q, group=group, q_scale=qs, tail_lens=tails,
        page_size=page, head_dim=d,
    )  # fmt: skip
    ex = _exact(inp)
    res, st = _run(inp, isa)
    assert torch.equal(res.indices, ex.indices) and torch.equal(res.num_selected, ex.num_selected)
    rel = float((res.attn_output - ex.attn_output).norm() / ex.attn_output.norm())
    assert rel < 1e-5
    if group == 1:  # one query row: the normaliser cancels, so the certificate holds
        assert not st.fallback and bool((st.status == CERTIFIED).all())


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_certified_results_are_the_compact_pass_own(isa: str) -> None:
    """A certified call returns the pass's own indices (no fallback), equal to the exact ones,
    with the fused gather's rows; an uncertified one is the exact kernel's, gather included."""
    for seed, group, qs in ((1, 1, 2.0), (2, 4, 12.0), (3, 4, 1.0)):
        inp = make_inputs(seed, [640, 130], [32, 13], group=group, q_scale=qs, tail_lens=[32, 2])
        k_max = int(torch.minimum(inp.budget, inp.seq_lens - inp.tail_lens).max())
        outs = [torch.zeros(2, 2, 2, k_max, 128, dtype=torch.bfloat16) for _ in range(2)]
        ex = _exact(inp, gather_out=outs[0])
        res, st = _run(inp, isa, gather_out=outs[1])
        assert torch.equal(res.indices, ex.indices) and torch.equal(outs[0], outs[1])
        assert st.fallback == bool((st.status != CERTIFIED).any())


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_candidates_hold_the_exact_and_the_spec_topk(isa: str) -> None:
    inp = make_inputs(7, [900, 333, 64], [45, 17, 3], group=4, q_scale=3.0, tail_lens=[32, 0, 8])
    mask = torch.zeros(3, 2, 900, dtype=torch.uint8)
    k8, s = quantize_keys(inp.k_pages)
    stats: list[compact.CompactStats] = []
    compact_cpu.select_topk_compact(
        *inp.args(), k8_pages=k8, scale_pages=s, tail_lens=inp.tail_lens, isa=isa,
        candidates_out=mask, stats_out=stats,
    )  # fmt: skip
    ex, spec = _exact(inp), reference(inp, "selected")
    for r in range(3):
        for h in range(2):
            n = int(ex.num_selected[r])
            for idx in (ex.indices[r, h, :n], spec.indices[r, h, :n]):
                assert bool(mask[r, h, idx.long()].all()), (r, h)
            assert int(mask[r, h].sum()) == int(stats[0].num_candidates[r, h]) < inp.ranked(r)


@pytest.mark.parametrize("case", [0, 1, 2, 4])
def test_reference_equals_the_exact_kernel(case: int) -> None:
    group, n_q, qs, lens, budgets, tails, page, d = CASES[case]
    inp = make_inputs(
        200 + case, lens, budgets, n_q=n_q, group=group, q_scale=qs, tail_lens=tails,
        page_size=page, head_dim=d,
    )  # fmt: skip
    k8, s = quantize_keys(inp.k_pages)
    res, st = select_topk_compact_torch(
        *inp.args()[:3], k8, s, *inp.args()[3:], tail_lens=inp.tail_lens, exact=select_topk
    )
    assert res is not None and torch.equal(res.indices, _exact(inp).indices)
    if group == 1:
        assert not st.fallback


def _near_ties(seed: int, group: int) -> Inputs:
    """Keys that are copies of a few base keys (exact ties, in several pages) plus 1-ulp
    perturbations (near-ties), with the budget boundary among them."""
    inp = make_inputs(seed, [512, 256], [40, 100], group=group, q_scale=1.0, tail_lens=[32, 0])
    g = torch.Generator().manual_seed(seed)
    base = inp.k_pages[:4].clone()
    for p in range(inp.k_pages.shape[0]):
        inp.k_pages[p] = base[p % 4]
        bits = inp.k_pages[p].view(torch.int16)
        flip = torch.rand(bits.shape, generator=g) < 0.02
        bits[flip] += 1  # one ulp
    return inp


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [1, 4])
def test_adversarial_near_ties_equal_the_exact_kernel(isa: str, group: int) -> None:
    inp = _near_ties(3 + group, group)
    ex = _exact(inp)
    res, st = _run(inp, isa)
    assert torch.equal(res.indices, ex.indices)
    assert st.fallback  # exact ties at the k-th place are never certified
    ref, _ = select_topk_compact_torch(
        *inp.args()[:3],
        *quantize_keys(inp.k_pages),
        *inp.args()[3:],
        tail_lens=inp.tail_lens,
        exact=select_topk,
    )
    assert ref is not None and torch.equal(ref.indices, ex.indices)


def _aligned_residuals() -> Inputs:
    """One query row, 4 'A' keys whose int8 residuals all add to the score (+0.45 s per
    element) and 4 'B' keys with larger int8 centers whose residuals all subtract: the A keys
    are the true top-4 yet lie just above the B keys' lower bounds only with the full radius.
    The other keys are 0 (score 0, radius 0), so the normalisers are tight."""
    d, page, s = 128, 32, 1.0 / 127
    n_pages = 126
    g = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    k = torch.zeros(n_pages * page, d)
    a_rows, b_rows = [100, 101, 102, 103], [2000, 2001, 2002, 2003]
    for j in a_rows:
        k[j] = sign * 0.45 * s
        k[j, 0] = sign[0]
    up = torch.zeros(d, dtype=torch.bool)
    up[1:77] = True
    for j in b_rows:
        k[j] = sign * torch.where(up, 0.55 * s, -0.45 * s)
        k[j, 0] = sign[0]
    kp = k.view(n_pages, 1, page, d).bfloat16()  # one KV head
    v = torch.randn(kp.shape, generator=g).bfloat16()
    q = (16 * sign).view(1, 1, 1, d).bfloat16()
    pt = torch.arange(n_pages, dtype=torch.int32)[None]
    n = torch.tensor([n_pages * page], dtype=torch.int32)
    return Inputs(q, kp, v, pt, n, torch.tensor([4], dtype=torch.int32))


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_a_halved_bound_is_caught_natively(isa: str) -> None:
    inp = _aligned_residuals()
    ex = _exact(inp)
    assert ex.indices[0, 0].tolist() == [100, 101, 102, 103]
    res, st = _run(inp, isa)  # the real bound: certified, exact
    assert not st.fallback and torch.equal(res.indices, ex.indices)
    res, st = _run(inp, isa, radius_scale=0.5, check_bounds=False)  # unchecked: wrong answer
    assert not st.fallback and res.indices[0, 0].tolist() == [2000, 2001, 2002, 2003]
    res, st = _run(inp, isa, radius_scale=0.5)  # checked: the violation forces the exact path
    assert int(st.status[0, 0]) == VIOLATION and torch.equal(res.indices, ex.indices)


def test_a_halved_bound_is_caught_in_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    inp = _aligned_residuals()
    k8, s = quantize_keys(inp.k_pages)
    args = (*inp.args()[:3], k8, s, *inp.args()[3:])
    ex = _exact(inp)
    res, st = select_topk_compact_torch(*args)
    assert res is not None and torch.equal(res.indices, ex.indices)
    monkeypatch.setattr(compact, "RESIDUAL", RESIDUAL / 2)
    monkeypatch.setattr(compact, "CHECK_BOUNDS", False)
    res, st = select_topk_compact_torch(*args)
    assert res is not None and res.indices[0, 0].tolist() == [2000, 2001, 2002, 2003]
    monkeypatch.setattr(compact, "CHECK_BOUNDS", True)
    res, st = select_topk_compact_torch(*args, exact=select_topk)
    assert int(st.status[0, 0]) == VIOLATION and res is not None
    assert torch.equal(res.indices, ex.indices)


@needs_native
def test_budget_covering_every_position_selects_all() -> None:
    inp = make_inputs(9, [100, 40], [100, 500], group=4, tail_lens=[4, 40])
    for isa in ISAS:
        res, st = _run(inp, isa)
        assert not st.fallback and torch.equal(res.indices, _exact(inp).indices)
        assert res.indices[0, 0, :96].tolist() == list(range(96))


@needs_native
def test_full_mode_and_non_finite_go_to_the_exact_kernel() -> None:
    inp = make_inputs(10, [200], [20], group=4)
    k8, s = quantize_keys(inp.k_pages)
    st: list[compact.CompactStats] = []
    kw = dict(k8_pages=k8, scale_pages=s, stats_out=st)
    full = compact_cpu.select_topk_compact(*inp.args(), output_mode="full", **kw)
    assert torch.equal(full.indices, select_topk(*inp.args(), output_mode="full").indices)
    assert st[-1].fallback and bool((st[-1].status == compact.UNSUPPORTED).all())
    inp.q[0, 0, 1, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        compact_cpu.select_topk_compact(*inp.args(), **kw)
    assert int(st[-1].status[0, 0]) == compact.NONFINITE


def test_quantizer_bound_and_native_bits() -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(6, 3, 16, 64, generator=g) * torch.logspace(-30, 30, 16)[None, None, :, None]
    k[0, 0, 0] = 0.0
    k[0, 0, 1] = 2.0**-133  # the smallest bf16 in a row of zeros
    k[1, 1, 2, 3] = float("inf")
    k[1, 1, 3, 4] = float("nan")
    kb = k.bfloat16()
    q8, s = quantize_keys(kb)
    finite = torch.isfinite(s)
    err = (kb.double() - s.double()[..., None] * q8.double()).abs()
    assert bool((err[finite] <= RESIDUAL * s.double()[finite][..., None]).all())
    assert not bool(finite[1, 1, 2]) and not bool(finite[1, 1, 3]) and bool(finite.sum() > 280)
    if BEST is None:
        return
    nq8, ns = torch.zeros_like(q8)[None], torch.zeros_like(s)[None]
    compact_cpu.quantize_pages(kb[None], torch.tensor([0, 2, 1, 5]), nq8, ns)
    for p in (0, 1, 2, 5):
        same = (ns[0, p] == s[p]) | (ns[0, p].isnan() & s[p].isnan())
        assert torch.equal(nq8[0, p], q8[p]) and bool(same.all())
    assert bool((nq8[0, 3] == 0).all())  # pages not asked for are left alone


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_exp_bounds_hold_on_every_sampled_argument(isa: str) -> None:
    """The pass's exp: relative error < 2**-20 on the float32 arguments in [-104, 0] (every
    997th here; every one: results/compact/README.md), its bounds never on the wrong side."""
    err, side = compact_cpu.exp_bound_error(isa, 997)
    assert 0 <= err < 2.0**-20 and side < 0


def test_kernel_slack_grows_with_the_sequence_in_the_normaliser_only() -> None:
    lo, hi = torch.zeros(2, 4), torch.ones(2, 4)
    (t1, e1), (t2, e2) = (
        compact.kernel_slack(1024, 4, lo, hi),
        compact.kernel_slack(32768, 4, lo, hi),
    )
    assert t1 == t2 < e1 < e2
    assert math.isclose(compact.gamma(1), 2.0**-24, rel_tol=1e-6)


@needs_native
def test_random_shapes_equal_the_exact_kernel() -> None:
    """Random sizes (pages of 1 to 64 rows, head_dim 16 to 256, groups, query counts, tails,
    budgets, thread counts, duplicated keys): indices always the exact kernel's, no violation,
    and on a certified call the float64 spec's too."""
    import random

    rng = random.Random(0)
    for it in range(60):
        n = rng.randint(1, 3)
        lens = [rng.randint(1, 600) for _ in range(n)]
        inp = make_inputs(
            500 + it, lens, [rng.randint(1, x + 3) for x in lens], n_q=rng.choice([1, 1, 3]),
            num_kv_heads=rng.choice([1, 2, 3]), group=rng.choice([1, 2, 4, 8]),
            head_dim=rng.choice([16, 40, 64, 128, 256]), page_size=rng.choice([1, 3, 16, 32, 64]),
            q_scale=rng.choice([0.5, 2.0, 8.0, 30.0]),
            tail_lens=[rng.randint(0, min(x, 40)) for x in lens],
        )  # fmt: skip
        if it % 4 == 0:  # exact ties: every other page a copy of its neighbour
            kp = inp.k_pages
            kp[1::2] = kp[0::2][: kp[1::2].shape[0]]
        ex = _exact(inp)
        for isa in ISAS:
            res, st = _run(inp, isa)
            assert torch.equal(res.indices, ex.indices), (it, isa)
            assert not bool((st.status == VIOLATION).any()), (it, isa)
            if not st.fallback:
                assert torch.equal(res.indices, reference(inp, "selected").indices), (it, isa)
