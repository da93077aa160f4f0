"""The acceptance checks of the evaluation report (:mod:`herald.eval.report`), one markdown
bullet each: at every context, dense clearly above the no-context control on each task (a
95% paired bootstrap), and each offloading mode near-lossless (HERALD §VI-B: its average within
:data:`NEAR_LOSSLESS` point of dense's) at its operating budget and from which budget on.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import math
from typing import Any

from herald.eval.metrics import HEADLINE
from herald.eval.runner import OFFLOAD_MODES, OPERATING_BUDGET, Unit
from herald.eval.stats import mean_paired_bootstrap, paired_bootstrap
from herald.eval.summary import per_example

NEAR_LOSSLESS = 1.0
"""Points of average score below dense that count as near-lossless (paper §VI-B)."""


SMALL_N = 30
"""Fewer examples than this: the acceptance line says the bootstrap is only a rough check."""
MIN_VERDICT_N = 10
"""Fewer paired examples than this: the acceptance line gives no verdict at all."""


def _scores(
    units: dict[str, dict[str, Any]], task: str, ctx: int, first: str, second: str
) -> tuple[list[float], list[float]] | None:
    """Per-example headline scores of units ``<task>_<ctx>_<first>`` and ``..._<second>`` on the
    same examples (None when either unit is missing or they ran on different selections)."""
    x, y = units.get(f"{task}_{ctx}_{first}"), units.get(f"{task}_{ctx}_{second}")
    if x is None or y is None or x["selection_sha256"] != y["selection_sha256"]:
        return None
    return per_example(x, HEADLINE[task]), per_example(y, HEADLINE[task])


def _paired(
    units: dict[str, dict[str, Any]], task: str, ctx: int, first: str, second: str
) -> tuple[list[float], list[float], float, float] | None:
    """``_scores`` and the 95% paired-bootstrap interval of first minus second."""
    pair = _scores(units, task, ctx, first, second)
    if pair is None:
        return None
    return (*pair, *paired_bootstrap(*pair))


def acceptance(units: dict[str, dict[str, Any]], table: dict[str, Any]) -> list[str]:
    """The acceptance checks (module docstring), one markdown bullet each."""
    lines = []
    for ctx in table["contexts"]:
        for task in table["tasks"]:
            pair = _paired(units, task, ctx, "dense", "control")
            if pair is None:
                continue
            m = HEADLINE[task]
            a, b, lo, hi = pair
            diff = 100 * (sum(a) - sum(b)) / len(a)
            clear = "clearly above" if lo > 0 else "NOT clearly above"
            if len(a) < MIN_VERDICT_N:  # a bootstrap of a handful of examples means nothing
                clear = f"no verdict below {MIN_VERDICT_N} examples"
            lines.append(
                f"- {ctx} tokens, {task} ({m.upper()}): dense {100 * sum(a) / len(a):.1f} vs control {100 * sum(b) / len(b):.1f}: "
                f"{diff:+.1f} points, 95% paired bootstrap [{100 * lo:+.1f}, {100 * hi:+.1f}] -> {clear}"
                + (" (acceptance applies at 8K+)" if ctx < 8192 else "")
                + (
                    f" (only {len(a)} example{'s' if len(a) != 1 else ''}: a rough check)"
                    if len(a) < SMALL_N
                    else ""
                )
            )
    for ctx in table["contexts"]:
        rows = table["rows"][str(ctx)]
        for mode in OFFLOAD_MODES:
            cands = sorted(
                (r["budget"], r["delta"])
                for r in rows.values()
                if r["mode"] == mode and r["delta"] is not None
            )
            if not cands:
                continue
            ok = [b for b, dlt in cands if dlt >= -NEAR_LOSSLESS]
            op = OPERATING_BUDGET[mode]
            at_op = next((dlt for b, dlt in cands if math.isclose(b, op)), None)
            tasks = table["tasks"]
            op_txt = (
                f"{at_op:+.2f}{_average_interval(units, tasks, ctx, mode, op)}"
                f" at its operating budget {op:g}"
                if at_op is not None
                else f"at its operating budget {op:g}: "
                + (
                    "not run for every task"
                    if any(Unit(t, ctx, mode, op).key in units for t in tasks)
                    else "not run"
                )
            )
            if ok:
                low = min(ok)
                at_first = next(dlt for b, dlt in cands if b == low)
                first = f"within {NEAR_LOSSLESS:g} point of dense from budget {low:g}" + (
                    f" ({at_first:+.2f}{_average_interval(units, tasks, ctx, mode, low)})"
                    if not math.isclose(low, op)
                    else ""
                )
            else:
                first = f"never within {NEAR_LOSSLESS:g} point of dense in {[b for b, _ in cands]}"
            lines.append(
                f"- {ctx} tokens, {mode}: average {op_txt}; {first}"
                + _per_task_delta(units, tasks, ctx, mode, op)
            )
    return lines


def _average_interval(
    units: dict[str, dict[str, Any]], tasks: list[str], ctx: int, mode: str, budget: float
) -> str:
    """ " [lo, hi]": the 95% bootstrap interval of the Avg column's Δ (mode at ``budget`` minus
    dense, averaged over ``tasks``), or "" when a task's pair is missing (then the Avg is not
    over every task either)."""
    pairs = []
    for task in tasks:
        pair = _scores(units, task, ctx, f"{mode}_{budget:g}", "dense")
        if pair is None:
            return ""
        pairs.append(pair)
    lo, hi = mean_paired_bootstrap(pairs)
    return f" [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def _per_task_delta(
    units: dict[str, dict[str, Any]], tasks: list[str], ctx: int, mode: str, budget: float
) -> str:
    """ " (mode minus dense per task, 95% paired bootstrap: line +0.6 [-1.2, +2.5], ...)": how
    far the average's difference is from noise."""
    parts = []
    for task in tasks:
        pair = _paired(units, task, ctx, f"{mode}_{budget:g}", "dense")
        if pair is None:
            continue
        a, b, lo, hi = pair
        parts.append(
            f"{task} {100 * (sum(a) - sum(b)) / len(a):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
        )
    if not parts:
        return ""
    return f" (minus dense at {budget:g} per task, 95% paired bootstrap: {', '.join(parts)})"
