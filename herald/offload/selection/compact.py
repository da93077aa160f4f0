"""Compact first pass of the CPU selection, PyTorch reference (the spec of the native pass).

The exact selection (:mod:`herald.offload.selection.cpu`, HERALD §IV-B4) reads every prefix key
in bf16. The compact pass reads an int8 copy of K with one float32 scale per (token, KV head)
(``k = s * q8 + e``, :func:`herald.kv.compact_keys.quantize_keys`), bounds every score and every
importance from it with certified intervals, and keeps as candidates the positions whose
importance upper bound reaches the k-th largest lower bound: a set that provably holds the exact
top-k. It then reads the bf16 K rows of the candidates (and of the tail) only, and certifies the
final top-k from their exact scores. A certified result equals the exact kernel's indices;
anything the pass cannot certify makes the caller run the exact kernel instead
(:func:`select_topk_compact_torch`), so the returned indices are always the exact kernel's.

Bounds (every score of KV head h, query row x, key k_j, c = float32(head_dim ** -0.5)):

* int8 keys: ``|k_jd - s_j q8_jd| <= RESIDUAL * s_j`` for every element (proof at
  :func:`herald.kv.compact_keys.quantize_keys`).
* int16 query: ``x_d = sigma * qq_d + eps_d``, ``|eps_d| <= RESIDUAL * sigma`` (sigma = max|x| /
  32767), so ``x . k_j = s_j (sigma I_j + eps . q8_j) + x . e_j`` with the exact integer dot
  ``I_j = qq . q8_j`` and ``|eps . q8_j| <= RESIDUAL sigma 127 D``, ``|x . e_j| <= RESIDUAL s_j
  ||x||_1``; hence ``score_j in c s_j (sigma I_j +- B)``, ``B = RESIDUAL (||x||_1 + 127 D sigma)``.
* the exact kernel's own float32 score differs from the real one by at most
  ``c gamma(D) sum_d |x_d k_jd| + 2u |score|`` (products of bf16 are exact in float32; any
  summation order; ``gamma(n) = n u / (1 - n u)``, u = 2**-24), and ``sum_d |x_d k_jd| <=
  ||x||_1 127 s_j (1 + 2u)``: the radius adds that term, so one interval ``[lo_j, hi_j]`` holds
  both the real score and the kernel's.
* importance: with ``M`` any shift, ``e_lo = exp(lo - M)``, ``e_hi = exp(hi - M)`` and ``Z_lo``
  / ``Z_hi`` their sums over all S positions (tail included), the softmax probability of
  position s lies in ``[e_lo_s / Z_hi, e_hi_s / (Z_lo - e_lo_s + e_hi_s)]`` (p = e / (e + rest)
  grows with e and rest >= Z_lo - e_lo_s). The kernel's own importance is that of its float32
  scores with each term off by ``1 +- theta`` (its exps and products) and each row's normaliser
  off by one common ``1 +- eta`` (its sum over every key: :func:`kernel_slack`), plus an
  absolute ``ABS_SLACK`` per row (underflow). Summed over the query rows: ``IL_s <= imp_s <=
  IU_s`` for the real importance and for the kernel's alike.
* candidates: ``tau`` = the k-th largest IL over the ranked positions; position s is kept iff
  ``IU_s >= tau``. A position t with ``IU_t < tau`` has k positions of strictly larger
  importance, so it is in no top-k whatever the tie rule: the candidates hold the top-k.

The final ranking needs the per-row normalisers exactly, and they sum over every key: the
certificate (:func:`certify`) bounds them by the candidates' exact terms plus the other
positions' int8 bounds and accepts a top-k only if every selected candidate beats every other
candidate for every normaliser in those bounds. When the uncertain share of a normaliser exceeds
the importance gap at the k-th position, which on real KV with several query rows per KV head is
the rule (results/compact/README.md), the caller falls back to the exact kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from herald.kv.compact_keys import RESIDUAL
from herald.offload.selection.ref import SelectionResult, check_selection_inputs
from herald.offload.selection.topk import group_queries

U = 2.0**-24
"""Unit roundoff of float32."""
Q16 = 32767
"""Largest int16 query magnitude."""
REL_SLACK = 2.0**-13
"""Relative slack applied to every exp, sum and quotient of the bounds themselves (covers their own
float32 / float64 rounding, derived in :func:`first_pass_bounds` and the native pass)."""
ABS_SLACK = 2.0**-100
"""Absolute slack per query row on an importance bound (underflowed probabilities)."""
MAX_PAIR_WORK = 1 << 24
"""Pairwise certificate work (pairs x rows) above which an item is declared uncertified."""
CHECK_BOUNDS = True
"""Flag a re-read score outside its pass-1 interval (VIOLATION); tests turn it off to show what a
loosened bound would do unchecked."""
MAX_HEAD_DIM = 512
"""Largest head_dim of the int8 pass (the int32 dot product of int16 x int8 cannot overflow)."""

CERTIFIED, AMBIGUOUS, VIOLATION, NONFINITE, TOO_MANY_PAIRS, UNSUPPORTED = range(6)
STATUS_NAMES = ("certified", "ambiguous", "violation", "nonfinite", "too_many_pairs", "unsupported")


def gamma(n: int) -> float:
    """Bound on the relative error of n float32 roundings (Higham's gamma_n)."""
    return n * U / (1.0 - n * U)


def quantize_query(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Qn, D]`` float64 query rows -> (int16-valued float64 ``qq``, ``sigma [Qn]``):
    ``x = sigma qq + eps``, ``|eps| <= RESIDUAL sigma`` (float64: the proof of
    :func:`herald.kv.compact_keys.quantize_keys` with u = 2**-53)."""
    m = x.abs().amax(dim=-1)
    sigma = torch.where(m > 0, m / Q16, torch.ones_like(m))
    return torch.round(x / sigma[:, None]).clamp_(-Q16, Q16), sigma


def first_pass_bounds(
    x: torch.Tensor, q8: torch.Tensor, s: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score bounds ``lo, hi [Qn, S]`` (float64) from int8 keys ``q8 [S, D]``, scales ``s [S]``
    and query rows ``x [Qn, D]``: each interval holds the real score and the exact kernel's
    float32 score (module docstring). float64 arithmetic: the center is a product of three
    numbers with an exact integer dot (relative error <= 4 * 2**-53), the radius has REL_SLACK."""
    d = x.shape[1]
    qq, sigma = quantize_query(x)
    dot = qq @ q8.double().T  # exact: integers below 2**53
    l1 = x.abs().sum(dim=-1)
    b = RESIDUAL * (l1 + 127 * d * sigma)  # [Qn]
    kern = scale * gamma(d) * (1 + 4 * U) * 127 * l1  # the kernel's dot rounding, per unit s
    sd = s.double()
    center = scale * sigma[:, None] * dot * sd[None, :]
    radius = (scale * b + kern)[:, None] * sd[None, :]
    radius = radius * (1 + REL_SLACK) + (2 * U + REL_SLACK) * center.abs()
    return center - radius, center + radius


def exact_score_bounds(
    x: torch.Tensor, keys: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(score, lo, hi) ``[Qn, n]`` of query rows ``x`` against bf16 ``keys [n, D]`` (float64):
    ``[lo, hi]`` holds the real score and the exact kernel's float32 score."""
    kd = keys.double()
    score = scale * (x @ kd.T)
    err = scale * gamma(x.shape[1]) * (1 + 4 * U) * (x.abs() @ kd.abs().T)
    err = err + (2 * U + 2.0**-40) * score.abs()
    return score, score - err, score + err


def kernel_slack(
    seq_len: int, rows: int, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[float, float]:
    """(theta, eta): relative errors of the exact kernel's importance given its float32 scores.
    theta, per term: the exps of the score and of the page max (<= 2 ulp each; 2**-20 covers ~16)
    with arguments rounded within the score range, the products, the sum over the query rows.
    eta, per row and common to all its terms (one 1/l per row in the kernel, one softmax sum in
    PyTorch): the normaliser's sum, where a term passes at most the additions of its page, of the
    pages (together <= 2 S) and of up to 256 tiles, plus the page maxima's exps."""
    span = float((hi.amax(dim=-1) - lo.amin(dim=-1)).max()) if lo.numel() else 0.0
    theta = gamma(rows + 8) + 4 * 2.0**-20 + 4 * U * span
    eta = gamma(2 * seq_len + rows + 320) + 4 * 2.0**-20 + 4 * U * span
    return theta, eta


@dataclass
class ItemBounds:
    """First-pass result of one (request, KV head): shift, per-position exps, normaliser bounds,
    candidate mask over the ranked positions and the kernel's slack (:func:`kernel_slack`)."""

    shift: torch.Tensor  # [Qn]
    e_lo: torch.Tensor  # [Qn, S]
    e_hi: torch.Tensor
    candidates: torch.Tensor  # [R] bool
    theta: float
    eta: float


def candidate_set(lo: torch.Tensor, hi: torch.Tensor, ranked: int, k: int) -> ItemBounds:
    """Importance bounds from score bounds ``[Qn, S]`` and the candidate mask (module docstring).
    ``k`` in ``[1, ranked)``."""
    rows, seq = lo.shape
    theta, eta = kernel_slack(seq, rows, lo, hi)
    shift = hi.amax(dim=-1, keepdim=True)
    e_lo = torch.exp(lo - shift) * (1 - REL_SLACK)
    e_hi = torch.exp(hi - shift) * (1 + REL_SLACK)
    z_lo = e_lo.sum(dim=-1, keepdim=True) * (1 - REL_SLACK)
    z_hi = e_hi.sum(dim=-1, keepdim=True) * (1 + REL_SLACK)
    f_lo = (1 - theta) * (1 - REL_SLACK) / (1 + eta)
    f_hi = (1 + theta) * (1 + REL_SLACK) / (1 - eta)
    il = (e_lo[:, :ranked] / z_hi).sum(dim=0) * f_lo - rows * ABS_SLACK
    denom = z_lo - e_lo[:, :ranked] + e_hi[:, :ranked]
    iu = (e_hi[:, :ranked] / denom).sum(dim=0) * f_hi + rows * ABS_SLACK
    tau = torch.topk(il, k, sorted=True).values[-1]
    return ItemBounds(shift.squeeze(1), e_lo, e_hi, iu >= tau, theta, eta)


def certify(
    e_lo: torch.Tensor,
    e_hi: torch.Tensor,
    z_lo: torch.Tensor,
    z_hi: torch.Tensor,
    k: int,
    theta: float,
) -> tuple[torch.Tensor | None, int]:
    """The top-k of candidates whose exact terms ``exp(score - shift)`` lie in ``[e_lo, e_hi]``
    ``[Qn, n]``, with the row normalisers in ``[z_lo, z_hi] [Qn]``; returns (indices into the n
    candidates in rank order, CERTIFIED) or (None, status).

    Certified iff every selected s and unselected t satisfy, for every normaliser in its box,
    ``sum_q w_q ((1-theta) e_lo_qs - (1+theta) e_hi_qt) > 2 Qn ABS_SLACK`` (w_q = 1 / Z_q): the
    minimum over the box takes w = 1/z_hi where the difference is positive, 1/z_lo elsewhere.
    Then the kernel ranks every selected candidate strictly above every other one, and since
    its top-k lies among the candidates, its top-k is this one.
    """
    n, rows = e_lo.shape[1], e_lo.shape[0]
    zmid = (z_lo + z_hi) / 2
    mid = ((e_lo + e_hi) / 2 / zmid[:, None]).sum(dim=0)
    order = torch.sort(mid, descending=True, stable=True).indices
    if k >= n:
        return order, CERTIFIED
    sel, uns = order[:k], order[k:]
    lo_s = (1 - theta) * e_lo[:, sel]
    hi_t = (1 + theta) * e_hi[:, uns]
    a = (lo_s / z_hi[:, None]).sum(dim=0)  # lower bound of each selected one's importance
    b = (hi_t / z_lo[:, None]).sum(dim=0)  # upper bound of each unselected one's
    margin = 2 * rows * ABS_SLACK
    amb_s, amb_t = a <= float(b.max()) + margin, b >= float(a.min()) - margin
    if not bool(amb_s.any()):
        return order, CERTIFIED
    ls, ht = lo_s[:, amb_s], hi_t[:, amb_t]
    if ls.shape[1] * ht.shape[1] * rows > MAX_PAIR_WORK:
        return None, TOO_MANY_PAIRS
    diff = ls[:, :, None] - ht[:, None, :]  # [Qn, s, t]
    worst = torch.where(diff > 0, diff / z_hi[:, None, None], diff / z_lo[:, None, None]).sum(0)
    return (order, CERTIFIED) if bool((worst > margin).all()) else (None, AMBIGUOUS)


@dataclass
class CompactStats:
    """Per (request, KV head): candidates (ranked positions re-read in bf16) and status
    (CERTIFIED, ...); ``fallback``: the exact kernel produced the returned result."""

    num_candidates: torch.Tensor  # [n_req, Hkv] int32
    status: torch.Tensor  # [n_req, Hkv] int32
    fallback: bool

    @property
    def certified_fraction(self) -> float:
        return float((self.status == CERTIFIED).double().mean())


def _rows(pages: torch.Tensor, ids: torch.Tensor, n: int, h: int) -> torch.Tensor:
    """Rows ``[0, n)`` of KV head h of one request: ``[n, ...]`` of a paged layer."""
    x = pages[ids.long(), h]  # [pages, P, ...]
    return x.reshape(-1, *x.shape[2:])[:n]


@dataclass
class ItemResult:
    status: int
    candidates: int
    selected: torch.Tensor | None = None  # [k] ascending positions
    output: torch.Tensor | None = None  # [Qn, D] float64, selected mode


def select_item(
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q8: torch.Tensor,
    s: torch.Tensor,
    ranked: int,
    k: int,
    scale: float,
) -> ItemResult:
    """One (request, KV head): query rows ``x [Qn, D]`` float64, int8 keys ``q8 [S, D]`` and
    scales ``s [S]``; ``keys`` / ``values`` ``[S, D]`` bf16 (only the candidates' and the tail's
    rows are read)."""
    seq, rows = q8.shape[0], x.shape[0]
    if not bool(torch.isfinite(s).all()) or not bool(torch.isfinite(x).all()):
        return ItemResult(NONFINITE, 0)
    tail = torch.arange(ranked, seq)
    if k >= ranked:  # every ranked position: nothing to rank
        cand = torch.arange(ranked)
        sel_pos = cand
    else:
        lo, hi = first_pass_bounds(x, q8, s, scale)
        ib = candidate_set(lo, hi, ranked, k)
        cand = ib.candidates.nonzero().squeeze(1)
        exact_pos = torch.cat([cand, tail])
        score, slo, shi = exact_score_bounds(x, keys[exact_pos], scale)
        plo, phi = lo[:, exact_pos], hi[:, exact_pos]
        if CHECK_BOUNDS and not bool(((score >= plo) & (score <= phi)).all()):
            return ItemResult(VIOLATION, len(cand))  # a real score outside its interval
        slo, shi = torch.maximum(slo, plo), torch.minimum(shi, phi)  # both enclose it
        m = ib.shift[:, None]
        ce_lo = torch.exp(slo - m) * (1 - REL_SLACK)
        ce_hi = torch.exp(shi - m) * (1 + REL_SLACK)
        rest = torch.ones(ranked, dtype=torch.bool)
        rest[cand] = False
        # the row normalisers, with the kernel's own normaliser error (eta) folded in
        z_lo = (ce_lo.sum(dim=1) + ib.e_lo[:, :ranked][:, rest].sum(dim=1)) * (1 - REL_SLACK)
        z_hi = (ce_hi.sum(dim=1) + ib.e_hi[:, :ranked][:, rest].sum(dim=1)) * (1 + REL_SLACK)
        z_lo, z_hi = z_lo * (1 - ib.eta), z_hi * (1 + ib.eta)
        nc = len(cand)
        order, status = certify(ce_lo[:, :nc], ce_hi[:, :nc], z_lo, z_hi, k, ib.theta)
        if order is None:
            return ItemResult(status, nc)
        sel_pos = torch.sort(cand[order[:k]]).values
    rows_pos = torch.cat([sel_pos, tail])
    sc = scale * (x @ keys[rows_pos].double().T)
    out = torch.softmax(sc, dim=-1) @ values[rows_pos].double() if len(rows_pos) else None
    if out is None:
        out = torch.zeros(rows, x.shape[1], dtype=torch.float64)
    return ItemResult(CERTIFIED, len(cand), sel_pos, out)


def select_topk_compact_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k8_pages: torch.Tensor,
    scale_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget_tokens: torch.Tensor,
    *,
    tail_lens: torch.Tensor | None = None,
    output_mode: str = "selected",
    exact: Callable[..., SelectionResult] | None = None,
) -> tuple[SelectionResult | None, CompactStats]:
    """The compact selection of ``select_topk``'s arguments plus the int8 pages ``k8_pages``
    ``[num_pages, Hkv, P, D]`` int8 and ``scale_pages [num_pages, Hkv, P]`` float32.

    Returns (result, stats): the certified result (``output_mode="selected"`` attention), or, if
    any item is not certified (or the mode is ``full``, or D > MAX_HEAD_DIM), ``exact(q, ...,
    tail_lens=..., output_mode=...)``'s result for the whole call (None if ``exact`` is None).
    """
    sh = check_selection_inputs(
        q, k_pages, v_pages, page_table, seq_lens, budget_tokens, output_mode, tail_lens=tail_lens
    )
    hkv, g, d, p = sh.num_kv_heads, sh.group_size, sh.head_dim, sh.page_size
    scale = float(torch.tensor(d**-0.5, dtype=torch.float32))
    status = torch.full((sh.n_req, hkv), UNSUPPORTED, dtype=torch.int32)
    ncand = torch.zeros(sh.n_req, hkv, dtype=torch.int32)
    indices = torch.full((sh.n_req, hkv, sh.k_max), -1, dtype=torch.int32)
    out = torch.zeros(sh.n_req, sh.n_q, sh.num_heads, d, dtype=torch.float32)
    if output_mode == "selected" and d <= MAX_HEAD_DIM:
        for r in range(sh.n_req):
            seq, k = sh.seq_lens[r], sh.num_selected[r]
            ids = page_table[r, : (seq + p - 1) // p]
            xs = group_queries(q[r], hkv, torch.float64)  # [Hkv, Qn, D]
            for h in range(hkv):
                kr, vr = _rows(k_pages, ids, seq, h), _rows(v_pages, ids, seq, h)
                res = select_item(
                    xs[h], kr, vr, _rows(k8_pages, ids, seq, h), _rows(scale_pages, ids, seq, h),
                    seq - sh.tail_lens[r], k, scale,
                )  # fmt: skip
                status[r, h], ncand[r, h] = res.status, res.candidates
                if res.selected is not None and res.output is not None:
                    indices[r, h, :k] = res.selected.int()
                    o = res.output.view(sh.n_q, g, d).float()
                    out[r, :, h * g : (h + 1) * g] = o
    stats = CompactStats(ncand, status, fallback=bool((status != CERTIFIED).any()))
    if stats.fallback:
        result = None
        if exact is not None:
            args = (q, k_pages, v_pages, page_table, seq_lens, budget_tokens)
            result = exact(*args, tail_lens=tail_lens, output_mode=output_mode)
        return result, stats
    num = torch.tensor(sh.num_selected, dtype=torch.int32)
    return SelectionResult(indices, num, out), stats


def candidate_fraction(stats: CompactStats, ranked: torch.Tensor) -> float:
    """Mean over items of candidates / ranked positions (ranked [n_req] int)."""
    frac = stats.num_candidates.double() / ranked.double().clamp(min=1)[:, None]
    return float(frac.mean()) if math.prod(frac.shape) else 0.0
