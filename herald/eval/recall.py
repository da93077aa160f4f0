"""Selection recall against the per-step oracle: analogs of the paper's Fig. 7 and Fig. 9.

Data (:mod:`herald.bench.capture`): one dense decode per example
(:class:`~herald.engine.dense.DenseEngine`, eager, batch 1) with a recorder wrapped around the
engine's attention backend, the pattern of :class:`~herald.attention.base.QueryRecorder`: every
forward's post-RoPE q/k/v of every layer is kept. From them: the committed KV of the prompt and
of each completed block (prefill chunks and commit forwards), and the queries and own keys of
every denoising step of every block. Everything else is computed here from those tensors with
exact attention (no engine change):

For each pair of consecutive decoded blocks (n, n+1), S_n = block n's start, S = S_n + B:

- oracle: for every denoising step t of block n+1 (the dense run's), every offloaded layer
  (``layer >= num_dense_layers``) and KV head h, the top-k_o positions of ``[0, S_n)`` by the
  importance the selection kernel uses (herald.offload.selection.ref): ``imp[s] = sum over the B
  queries and the G query heads of h of softmax(q . k / sqrt(D))[s]``, the softmax over every key
  the step attends to (committed ``[0, S)`` and block n+1's own B keys). Block n itself is not
  ranked: the sparse pool always holds the last completed block.
- candidate selections, top-k_b of their own importance over ``[0, S_n)``:
  ``rep_omitted`` / ``rep_draft`` / ``rep_completed``: the representative query (one [MASK] at
  S + B/2) run through every layer, attending to ``[0, S_n)`` plus nothing / block n's draft
  (step-0 argmax; its KV from a forward attending to ``[0, S_n)`` and itself) / block n's true
  KV; ``block_draft``: block n+1's B [MASK] queries over ``[0, S_n)`` + the draft + themselves;
  ``block_completed`` (MAGE): the dense run's own step-0 queries of block n+1 (so it equals the
  oracle of step 0); ``proxy`` (InfiniGen): those step-0 queries on the proxy channels
  (:mod:`herald.offload.selection.proxy`) of the keys; ``rep_draft_selected``: ``rep_draft``
  with the
  ``selected`` kernel output mode: at every offloaded layer the query's attention output comes
  from the selected rows and the draft only (what the rest of the representative query's forward
  then sees), instead of from all of ``[0, S_n)`` + draft (``full``); ``rep2_draft`` /
  ``rep4_draft``: ``rep_draft`` with 2 / 4 [MASK] queries at the centres of equal parts of block
  n+1 (S + B/4 and S + 3B/4; S + B/8, 3B/8, 5B/8, 7B/8) instead of one at its centre, their
  importances summed as the kernel does for n_q queries (a design variant, not in the paper:
  the kernel's cost grows with n_q).
- recall = |selected ∩ oracle| / k_o per (step, layer, head), averaged over the steps; reported
  per layer (mean over heads). k_b = min(ceil(budget * S), S_n), as the engine's budget_for.

Engine details not reproduced: the engine builds the draft and its KV from sparse attention over
block n's pool; here both come from exact attention over the full prefix (the dense trajectory).
The draft takes the argmax with [MASK] excluded (the engine keeps a raw argmax at positions still
masked after step 0; they differ only where [MASK] itself is the argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from herald.bench.capture import Capture, RecordedForward, capture_dense
from herald.config import SamplingParams
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig

VARIANTS = {
    "rep_omitted": "representative query, block n omitted",
    "rep_draft": "representative query + draft (HERALD)",
    "rep_completed": "representative query, block n completed (representative-query only)",
    "block_draft": "block queries + draft (draft only)",
    "block_completed": "block queries at step 0, block n completed (MAGE)",
    "proxy": "proxy channels of the step-0 block queries (InfiniGen)",
    "rep_draft_selected": "HERALD with the `selected` kernel output mode",
    "rep2_draft": "2 representative queries + draft",
    "rep4_draft": "4 representative queries + draft",
}

FIG9_VARIANTS = (
    "rep_completed",
    "block_draft",
    "rep_draft",
    "rep2_draft",
    "rep4_draft",
    "rep_draft_selected",
    "proxy",
)
"""The variants drawn in Fig. 9 and compared with MAGE's base-budget recall (MAGE itself is the
reference line; ``rep_omitted`` is Fig. 7's)."""


@dataclass(frozen=True)
class AnalysisConfig:
    """Knobs of the recall analysis (recorded with its results)."""

    oracle_budget: float = 0.025
    """k_o = ceil(oracle_budget x S): MAGE's base budget (the paper's Fig. 9 reference)."""
    budgets: tuple[float, ...] = (0.01, 0.025, 0.035, 0.04375, 0.05, 0.075, 0.10, 0.20)
    """Selection budgets swept (1.4x and 1.75x of 2.5% included)."""
    num_blocks: int = 4
    """Blocks decoded per example: num_blocks - 1 (n, n+1) pairs."""
    num_examples: int = 8
    num_dense_layers: int = 2
    proxy_ratio: float = 0.25

    def all_budgets(self) -> list[float]:
        return sorted({*self.budgets, self.oracle_budget})


# -- importance and top-k -------------------------------------------------------------------------
def importance(q: torch.Tensor, keys: torch.Tensor, ranked: int) -> torch.Tensor:
    """Softmax-normalised importance summed over queries and the GQA group (paper §IV-B4).

    Args:
        q: [n_q, Hq, D] post-RoPE queries, any float dtype. Query head ``h * G + g`` belongs to
            KV head ``h`` (G = Hq // Hkv).
        keys: [Hkv, S, D] every key the queries attend to (softmax over all S).
        ranked: the first ``ranked`` positions are returned.

    Returns:
        [Hkv, ranked] float32 on q's device: ``sum_{i, g} softmax_s(q[i, hG+g] . k[h, s] /
        sqrt(D))``.
    """
    n_q, hq, d = q.shape
    hkv = keys.shape[0]
    g = hq // hkv
    qf = q.float().reshape(n_q, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n_q * g, d)
    scores = torch.bmm(qf, keys.float().transpose(1, 2)) * d**-0.5
    return torch.softmax(scores, dim=-1).sum(dim=1)[:, :ranked]


def topk_mask(imp: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, S] bool: the ``k`` most important positions per row (ties to the smaller position,
    as the kernel); all False for k <= 0, all True for k >= S."""
    mask = torch.zeros(imp.shape, dtype=torch.bool, device=imp.device)
    if k <= 0:
        return mask
    idx = torch.sort(imp, dim=-1, descending=True, stable=True).indices[:, :k]
    return mask.scatter_(1, idx, True)


def recall_of(selected: torch.Tensor, oracle: torch.Tensor, k_oracle: int) -> torch.Tensor:
    """``|selected ∩ oracle_t| / k_oracle`` averaged over t: selected [Hkv, S] bool, oracle
    [T, Hkv, S] bool -> [Hkv] float32."""
    hit = (selected[None] & oracle).sum(dim=-1).float() / max(1, k_oracle)
    return hit.mean(dim=0)


class _ExactAttention:
    """Exact attention of the current tokens to fixed per-layer keys (a prefix, optionally a
    tail) and, if ``self_attend``, to themselves; records importance over the first ``ranked``
    keys at layers >= ``num_dense``, and with ``select_k`` attends at those layers only to the
    top-``select_k`` ranked keys plus every unranked one (the ``selected`` output mode)."""

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ranked: int,
        *,
        self_attend: bool,
        num_dense: int,
        select_k: int | None = None,
    ) -> None:
        self.keys, self.values, self.ranked = keys, values, ranked
        self.self_attend, self.num_dense, self.select_k = self_attend, num_dense, select_k
        self.imp: dict[int, torch.Tensor] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        own_k, own_v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [Hkv, L, D]
        self.kv[layer_id] = (own_k, own_v)
        kk, vv = self.keys[layer_id], self.values[layer_id]
        if self.self_attend:
            kk, vv = torch.cat([kk, own_k], dim=1), torch.cat([vv, own_v], dim=1)
        n_q, hq, d = q.shape[1:]
        hkv = kk.shape[0]
        g = hq // hkv
        qf = q[0].float().reshape(n_q, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n_q * g, d)
        scores = torch.bmm(qf, kk.float().transpose(1, 2)) * d**-0.5
        probs = torch.softmax(scores, dim=-1)
        if layer_id >= self.num_dense:
            imp = probs.sum(dim=1)[:, : self.ranked]
            self.imp[layer_id] = imp
            if self.select_k is not None:
                keep = torch.ones(hkv, kk.shape[1], dtype=torch.bool, device=kk.device)
                keep[:, : self.ranked] = topk_mask(imp, self.select_k)
                probs = torch.softmax(scores.masked_fill(~keep[:, None, :], -math.inf), dim=-1)
        o = torch.bmm(probs, vv.float())  # [Hkv, n_q * G, D]
        o = o.reshape(hkv, n_q, g, d).permute(1, 0, 2, 3).reshape(1, n_q, hq, d)
        return o.to(q.dtype)


# -- one (n, n+1) pair ----------------------------------------------------------------------------
def _proxy_channels(model: BlockDiffusionLM, layers: list[int], ratio: float) -> dict:
    """Per offloaded layer, InfiniGen's proxy channels on the model's device ({} if the layers
    are not QK-norm layers)."""
    from herald.offload.selection.proxy import proxy_channels

    dev = next(model.parameters()).device
    try:
        return {i: proxy_channels(model.layers[i], ratio).to(dev) for i in layers}  # type: ignore[arg-type]
    except AttributeError:
        return {}


@torch.inference_mode()
def analyse_pair(
    model: BlockDiffusionLM,
    config: ModelConfig,
    cap: Capture,
    j: int,
    acfg: AnalysisConfig,
    proxy_chans: dict[int, torch.Tensor] | None = None,
) -> dict[str, Any] | None:
    """Recall of every variant of :data:`VARIANTS` at every budget for blocks (j, j+1) of
    ``cap`` (see the module docstring). ``proxy_chans``: InfiniGen's channels per offloaded
    layer (default: computed here; ``{}`` skips the proxy variant). None when the pair is
    incomplete (block j not committed, block j+1 without steps) or block j starts at 0.

    Returns:
        ``{"block": j, "prefix": S_n, "k_oracle", "num_steps", "layers": [...], "recall":
        {variant: {f"{budget:g}": [recall per offloaded layer, mean over KV heads]}}}``.
    """
    b, mask_id = config.block_size, config.mask_token_id
    s_n = cap.block_starts[j]
    s1 = s_n + b
    steps = cap.steps.get(s1, [])
    if s_n == 0 or not steps or cap.committed_k[0].shape[1] < s1:
        return None
    num_layers = config.num_layers
    nd = min(acfg.num_dense_layers, num_layers)
    layers = list(range(nd, num_layers))
    if not layers:
        raise ValueError(f"no offloaded layer: the model has {num_layers} layers, {nd} dense")
    ck = [t[:, :s1] for t in cap.committed_k]
    cv = [t[:, :s1] for t in cap.committed_v]
    pk, pv = [t[:, :s_n] for t in ck], [t[:, :s_n] for t in cv]
    budgets = acfg.all_budgets()
    kb = {x: min(math.ceil(x * s1), s_n) for x in budgets}
    k_o = min(math.ceil(acfg.oracle_budget * s1), s_n)
    dev = ck[0].device

    def own(f: RecordedForward, i: int) -> torch.Tensor:
        return torch.cat([ck[i], f.k[i].transpose(0, 1)], dim=1)

    oracle = {
        i: torch.stack([topk_mask(importance(f.q[i], own(f, i), s_n), k_o) for f in steps])
        for i in layers
    }

    def run(
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        ids: torch.Tensor,
        start: int,
        *,
        self_attend: bool,
        select_k: int | None = None,
        positions: list[int] | None = None,
    ) -> tuple[_ExactAttention, torch.Tensor]:
        """Forward ``ids`` at positions ``start..`` (or ``positions``) over ``keys``; (backend,
        final hidden)."""
        att = _ExactAttention(
            keys, values, s_n, self_attend=self_attend, num_dense=nd, select_k=select_k
        )
        if positions is None:
            positions = list(range(start, start + ids.shape[0]))
        pos = torch.tensor(positions, device=dev)[None]
        return att, model(ids[None].to(dev), pos, att)

    # Block n's draft: argmax of its step-0 logits, and the draft's KV (attending to [0, S_n)
    # and itself, as the engine's draft group).
    tail = torch.tensor(cap.prompt_ids[s_n:s1], dtype=torch.long)
    tokens = torch.full((b,), mask_id, dtype=torch.long)
    tokens[: len(tail)] = tail
    _, hidden = run(pk, pv, tokens, s_n, self_attend=True)
    logits = model.compute_logits(hidden[0])
    logits[:, mask_id] = -math.inf
    draft = torch.where(tokens.to(dev) == mask_id, logits.argmax(dim=-1), tokens.to(dev))
    att, _ = run(pk, pv, draft, s_n, self_attend=True)
    dk = [att.kv[i][0] for i in range(num_layers)]
    dv = [att.kv[i][1] for i in range(num_layers)]
    tk = [t[:, s_n:s1] for t in ck]
    tv = [t[:, s_n:s1] for t in cv]

    def cat(a: list[torch.Tensor], c: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat([x, y], dim=1) for x, y in zip(a, c, strict=True)]

    def rep(
        tail_k: list, tail_v: list, select_k: int | None = None, n_q: int = 1
    ) -> dict[int, torch.Tensor]:
        """The representative query (one [MASK] at S + B/2; n_q: at the centres of n_q equal
        parts of the block) over [0, S_n) + a tail."""
        keys, values = cat(pk, tail_k), cat(pv, tail_v)
        ids = torch.full((n_q,), mask_id, dtype=torch.long)
        pos = [s1 + (2 * i + 1) * b // (2 * n_q) for i in range(n_q)]
        return run(keys, values, ids, s1, self_attend=False, select_k=select_k, positions=pos)[
            0
        ].imp

    none: list[torch.Tensor] = [t[:, :0] for t in pk]
    masks = torch.full((b,), mask_id, dtype=torch.long)
    imps: dict[str, dict[int, torch.Tensor]] = {
        "rep_omitted": rep(none, none),
        "rep_draft": rep(dk, dv),
        "rep_completed": rep(tk, tv),
        "block_draft": run(cat(pk, dk), cat(pv, dv), masks, s1, self_attend=True)[0].imp,
        "block_completed": {i: importance(steps[0].q[i], own(steps[0], i), s_n) for i in layers},
        "rep2_draft": rep(dk, dv, n_q=2),
        "rep4_draft": rep(dk, dv, n_q=4),
    }
    out: dict[str, dict[str, list[float]]] = {}
    for name, imp in imps.items():
        out[name] = {
            f"{x:g}": [
                recall_of(topk_mask(imp[i], kb[x]), oracle[i], k_o).mean().item() for i in layers
            ]
            for x in budgets
        }
    if proxy_chans is None:
        proxy_chans = _proxy_channels(model, layers, acfg.proxy_ratio)
    if proxy_chans:
        from herald.offload.selection.proxy import proxy_topk

        out["proxy"] = {}
        for x in budgets:
            per_layer = []
            for i in layers:
                chans = proxy_chans[i]
                part = pk[i].gather(2, chans[:, None, :].expand(-1, s_n, -1))
                idx = proxy_topk(steps[0].q[i], part, chans, kb[x])
                sel = torch.zeros(part.shape[0], s_n, dtype=torch.bool, device=dev)
                sel.scatter_(1, idx, True)
                per_layer.append(recall_of(sel, oracle[i], k_o).mean().item())
            out["proxy"][f"{x:g}"] = per_layer
    out["rep_draft_selected"] = {}
    for x in budgets:
        imp = rep(dk, dv, select_k=kb[x])
        out["rep_draft_selected"][f"{x:g}"] = [
            recall_of(topk_mask(imp[i], kb[x]), oracle[i], k_o).mean().item() for i in layers
        ]
    return {
        "block": j,
        "prefix": s_n,
        "k_oracle": k_o,
        "num_steps": len(steps),
        "layers": layers,
        "recall": out,
    }


# -- a unit: several examples ---------------------------------------------------------------------
BUCKETS = (0.0, 0.6, 0.7, 0.8, 0.9, 1.0001)
"""Fig. 7 buckets of the recall with block n omitted (per pair and layer)."""
FIG7_BARS = (("rep_omitted", "omitted"), ("rep_draft", "drafted"), ("rep_completed", "completed"))
"""Fig. 7's three bars: (variant, label), block n omitted / drafted / completed."""


def run_analysis(
    examples: list[Any],
    model: BlockDiffusionLM,
    config: ModelConfig,
    params: SamplingParams,
    acfg: AnalysisConfig,
    desc: str = "analysis",
) -> dict[str, Any]:
    """Capture and analyse the first ``acfg.num_examples`` of ``examples``
    (:class:`~herald.eval.tasks.Example`), with a progress bar on stderr.

    Returns ``{"config", "pairs": [analyse_pair(...) + "example"], "summary": summarise(...)}``.
    """
    from herald.progress import progress

    chosen = examples[: acfg.num_examples]
    nd = min(acfg.num_dense_layers, config.num_layers)
    chans = _proxy_channels(model, list(range(nd, config.num_layers)), acfg.proxy_ratio)
    pairs: list[dict[str, Any]] = []
    for ex in progress(chosen, desc=desc, unit="ex", leave=False):
        cap = capture_dense(model, config, ex.prompt_ids, acfg.num_blocks, params)
        for j in range(len(cap.block_starts) - 1):
            r = analyse_pair(model, config, cap, j, acfg, chans)
            if r is not None:
                pairs.append({"example": ex.example_id, **r})
        del cap
    cfg = {k: getattr(acfg, k) for k in acfg.__dataclass_fields__}
    return {"config": cfg, "pairs": pairs, "summary": summarise(pairs, acfg.oracle_budget)}


def summarise(pairs: list[dict[str, Any]], oracle_budget: float) -> dict[str, Any]:
    """Means over every (pair, offloaded layer): ``mean[variant][budget]``; the Fig. 7 buckets at
    the oracle budget (``fig7``: per bucket of the omitted recall, the count and the mean recall of
    omitted / drafted / completed; ``fig7_all``: the same over every (pair, layer), unbucketed,
    since bucketing by one bar biases the comparison); the number of pairs."""
    mean: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        per_budget: dict[str, list[float]] = {}
        for p in pairs:
            for budget, vals in p["recall"].get(variant, {}).items():
                per_budget.setdefault(budget, []).extend(vals)
        if per_budget:
            mean[variant] = {
                x: sum(v) / len(v) for x, v in sorted(per_budget.items(), key=lambda t: float(t[0]))
            }
    key = f"{oracle_budget:g}"
    trio = [v for v, _ in FIG7_BARS]
    inst = [
        tuple(p["recall"][v][key][i] for v in trio) for p in pairs for i in range(len(p["layers"]))
    ]

    def bars(rows: list[tuple[float, ...]]) -> dict[str, Any]:
        out: dict[str, Any] = {"count": len(rows)}
        for k, v in enumerate(trio):
            out[v] = sum(r[k] for r in rows) / len(rows) if rows else None
        return out

    fig7 = [
        {"bucket": [lo, min(hi, 1.0)], **bars([r for r in inst if lo <= r[0] < hi])}
        for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:], strict=True)
    ]
    return {"num_pairs": len(pairs), "mean": mean, "fig7": fig7, "fig7_all": bars(inst)}
