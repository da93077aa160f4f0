"""The evaluation report: merges every unit result under an output directory into
``results.json`` (raw per-example numbers, summaries, provenance), ``README.md`` (Table I, Fig. 7
and Fig. 9 analogs as tables, acceptance checks) and plots (``accuracy_<context>.png``,
``fig7.png``, ``fig9.png``; matplotlib Agg, skipped with a note where it is not installed).

Unit results are read from ``**/runs/*.json`` (parts of a run copied into sub-folders merge);
a unit found twice keeps the newest. Example selections come from ``**/examples/*.json``.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

from herald.eval.metrics import HEADLINE
from herald.eval.recall import FIG7_BARS, FIG9_VARIANTS, VARIANTS, summarise
from herald.eval.runner import OFFLOAD_MODES, OPERATING_BUDGET, Unit

NEAR_LOSSLESS = 1.0
"""Points of average score below dense that count as near-lossless (paper §VI-B)."""


_LINE_SETTING_TEXT = {
    "cross_file_first": "`cross_file_first`, the first use of a name the file imports from another file of "
    "its package, absent from the control window; the in-file context holds the file's imports",
    "cross_file_random": "`cross_file_random`, random lines preferring uses of names imported from "
    "other files of the package; the in-file context holds the file's imports",
    "cross_file_later": "`cross_file_later`, a later (not the first) use of names the file imports from "
    "another file of its package, absent from the control window; the in-file context holds the "
    "file's imports",
}
_OLD_LINES = "tiered random lines, in-file context without its imports (runs before the settings)"


def collect(out: Path) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(unit key -> result, "task_context" -> example selection) found under ``out``, its
    sub-folders included (the parts of one run merge; a unit found twice keeps its newest result).

    Raises:
        ValueError: the folder mixes runs that must not merge: units of models with different
            configs, or two example selections of one task and context (other seeds, settings or
            corpora); merge only the parts of one run.
    """
    units: dict[str, dict[str, Any]] = {}
    models: dict[str, Path] = {}
    for path in sorted(out.rglob("runs/*.json")):
        res = json.loads(path.read_text())
        key = res["unit"]
        model = res.get("config", {}).get("model", {}).get("config_sha256")
        if model is not None:
            models.setdefault(model, path)
        if key not in units or res.get("date_utc", "") > units[key].get("date_utc", ""):
            units[key] = res
    if len(models) > 1:
        first, second = list(models.values())[:2]
        raise ValueError(
            f"{out} mixes runs of {len(models)} different models (e.g. {first} and {second}); "
            "merge only the parts of one run, or report each folder on its own"
        )
    selections: dict[str, dict[str, Any]] = {}
    paths: dict[str, Path] = {}
    for path in sorted(out.rglob("examples/*.json")):
        sel = json.loads(path.read_text())
        key = f"{sel['task']}_{sel['context']}"
        if key in selections and selections[key]["selection_sha256"] != sel["selection_sha256"]:
            raise ValueError(
                f"{out} holds two different {key} example selections ({paths[key]} and {path}: "
                "other seeds, settings or corpora); merge only the parts of one run, or report "
                "each folder on its own"
            )
        selections[key], paths[key] = sel, path
    return units, selections


def paired_bootstrap(
    a: list[float], b: list[float], level: float = 0.95, reps: int = 2000
) -> tuple[float, float]:
    """``level`` paired-bootstrap interval of mean(a) - mean(b): ``reps`` resamples of the
    example indices (seeded, so reports are reproducible); a and b are per-example scores of the
    same examples, in the same order."""
    return mean_paired_bootstrap([(a, b)], level, reps)


def mean_paired_bootstrap(
    pairs: list[tuple[list[float], list[float]]], level: float = 0.95, reps: int = 2000
) -> tuple[float, float]:
    """``level`` bootstrap interval of the mean over ``pairs`` of mean(a) - mean(b): each pair is
    one task's per-example scores of two methods on the same examples (same order); every
    resample draws each task's examples independently of the other tasks' (the tasks have
    different examples), and the tasks weigh equally whatever their sizes, so this is the
    interval of the tasks' average difference, the Avg column's Δ. One pair gives
    exactly ``paired_bootstrap``. Seeded: reports are reproducible.

    Raises ValueError for no pairs, an empty task, or a and b of different lengths."""
    if not pairs:
        raise ValueError("mean_paired_bootstrap needs at least one (a, b) pair")
    for a, b in pairs:
        if not a or len(a) != len(b):
            raise ValueError(
                f"paired scores must be non-empty and equal in length: {len(a)} vs {len(b)}"
            )
    rng = random.Random(0)
    diffs = []
    for _ in range(reps):
        total = 0.0
        for a, b in pairs:
            n = len(a)
            idx = [rng.randrange(n) for _ in range(n)]
            total += sum(a[i] - b[i] for i in idx) / n
        diffs.append(total / len(pairs))
    diffs.sort()
    tail = (1 - level) / 2
    return diffs[round(tail * reps)], diffs[round((1 - tail) * reps) - 1]


def _per_example(res: dict[str, Any], metric: str) -> list[float]:
    return [float(r[metric]) for r in res["examples"]]


def _agreement(res: dict[str, Any], dense: dict[str, Any] | None) -> float | None:
    if dense is None or res["selection_sha256"] != dense["selection_sha256"]:
        return None
    same = [
        a["prediction"] == b["prediction"]
        for a, b in zip(res["examples"], dense["examples"], strict=True)
    ]
    return sum(same) / len(same)


def summary_table(units: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per context: rows (dense, control, mode@budget) x per-task metrics, the average of the
    tasks' headline scores, its difference from dense, agreement with dense."""
    contexts = sorted({u["context"] for u in units.values() if u["mode"] != "analysis"})
    tasks = sorted({u["task"] for u in units.values() if u["mode"] != "analysis"})
    out: dict[str, Any] = {}
    for ctx in contexts:
        rows: dict[str, dict[str, Any]] = {}
        for u in units.values():
            if u["context"] != ctx or u["mode"] == "analysis":
                continue
            label = u["mode"] if u["budget"] is None else f"{u['mode']}@{u['budget']:g}"
            dense = units.get(f"{u['task']}_{ctx}_dense")
            row = rows.setdefault(label, {"mode": u["mode"], "budget": u["budget"], "tasks": {}})
            row["tasks"][u["task"]] = {
                "em": 100 * u["metrics"]["em"],
                "es": 100 * u["metrics"]["es"],
                "score": u["metrics"]["score"],
                "n": u["num_examples"],
                "agreement": _agreement(u, dense),
            }
        for row in rows.values():
            scores = [row["tasks"][t]["score"] for t in tasks if t in row["tasks"]]
            row["avg"] = sum(scores) / len(scores) if len(scores) == len(tasks) else None
        dense_avg = rows.get("dense", {}).get("avg")
        for row in rows.values():
            row["delta"] = (
                row["avg"] - dense_avg if row["avg"] is not None and dense_avg is not None else None
            )
        out[str(ctx)] = rows
    return {"contexts": contexts, "tasks": tasks, "rows": out}


def _order(label: str) -> tuple[int, float]:
    mode, _, budget = label.partition("@")
    rank = {"dense": 0, "control": 1, "mage": 2, "infinigen": 3, "herald": 4}.get(mode, 9)
    return rank, float(budget or 0)


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
    return _per_example(x, HEADLINE[task]), _per_example(y, HEADLINE[task])


def _paired(
    units: dict[str, dict[str, Any]], task: str, ctx: int, first: str, second: str
) -> tuple[list[float], list[float], float, float] | None:
    """``_scores`` and the 95% paired-bootstrap interval of first minus second."""
    pair = _scores(units, task, ctx, first, second)
    if pair is None:
        return None
    return (*pair, *paired_bootstrap(*pair))


def acceptance(units: dict[str, dict[str, Any]], table: dict[str, Any]) -> list[str]:
    """The issue's acceptance checks, one markdown bullet each."""
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


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _task_text(task: str, cfg: dict[str, Any]) -> str:
    """One task's description for the report header, from the run's recorded settings."""
    tasks = cfg.get("tasks", {})
    if task == "line":
        return (
            "**line** = RepoBench-P-style next-line completion (cross-file context + in-file "
            f"context of at most min({tasks.get('infile_tokens', '?')}, context / 2) tokens; "
            f"targets: {_LINE_SETTING_TEXT.get(tasks.get('line_setting'), _OLD_LINES)}; "
            "EM and edit similarity, ES = difflib.SequenceMatcher ratio, headline = ES)"
        )
    return (
        f"**recall** = complete a use of an identifier defined at least "
        f"{tasks.get('min_distance', '?')} tokens earlier and absent from the last "
        f"{cfg.get('decode', {}).get('control_tokens', 512)} tokens (headline = EM)"
    )


def markdown(
    units: dict[str, dict[str, Any]], selections: dict[str, Any], analysis: dict[str, Any] | None
) -> str:
    table = summary_table(units)
    any_unit = next(iter(units.values()))
    cfg = any_unit.get("config", {})
    # each task's header text comes from a unit of that task: a unit records every task's
    # settings, but only its own task's must match on resume (one --out may mix the others)
    task_cfg = {u.get("task"): u.get("config", {}) for u in reversed(units.values())}
    random_weights = any(
        u.get("config", {}).get("model", {}).get("random_weights") for u in units.values()
    )
    lines = [
        "# herald eval: long-context accuracy (issue 6)",
        "",
        *(
            [
                "**RANDOM WEIGHTS: the model has random weights, so every score below is noise "
                "(a harness check, not an accuracy measurement).**",
                "",
            ]
            if random_weights
            else []
        ),
        f"Model: `{cfg.get('model', {}).get('name', '?')}` ({cfg.get('model', {}).get('architecture', '?')}); "
        f"commands: "
        + ", ".join(sorted({f"`{u.get('command', '?')}`" for u in units.values()}))
        + ".",
        f"Machine: {any_unit.get('machine', {}).get('gpu', 'CPU')} / {any_unit.get('machine', {}).get('cpu_model', '?')}; "
        f"dates {min(u.get('date_utc', '') for u in units.values())} .. {max(u.get('date_utc', '') for u in units.values())}.",
        "",
        "Tasks (built at run time from the local Python standard library, see `examples/*.json` for the selection "
        "with sha256 of every file): "
        + "; ".join(_task_text(task, task_cfg.get(task, cfg)) for task in table["tasks"])
        + f". **control** = dense on only the last {cfg.get('decode', {}).get('control_tokens', 512)} "
        "prompt tokens. Avg = mean of the headline scores; "
        "Δ = Avg - dense; agree = % of predictions identical to dense's. Decoding: greedy, "
        + (
            f"{cfg['decode']['steps']} fixed steps per block"
            if cfg.get("decode", {}).get("steps")
            else f"confidence threshold {cfg.get('decode', {}).get('threshold', '?')}"
        )
        + "; bold = dense and each mode's operating budget (paper Table II).",
        "",
    ]
    for ctx in table["contexts"]:
        rows = table["rows"][str(ctx)]
        head = (
            "| method |"
            + "".join(f" {t} EM | {t} ES | {t} agree |" for t in table["tasks"])
            + " Avg (Δ) | n |"
        )
        lines += [
            f"## Table I analog: {ctx}-token contexts",
            "",
            head,
            "|" + " --- |" * (3 * len(table["tasks"]) + 3),
        ]
        for label in sorted(rows, key=_order):
            r = rows[label]
            cells = ""
            for t in table["tasks"]:
                c = r["tasks"].get(t)
                if c is None:
                    cells += " - | - | - |"
                    continue
                agree = None if c["agreement"] is None else 100 * c["agreement"]
                cells += f" {_fmt(c['em'])} | {_fmt(c['es'])} | {_fmt(agree, '.0f')} |"
            n = max((c["n"] for c in r["tasks"].values()), default=0)
            bold = (
                "**"
                if label in ("dense",)
                or any(label == f"{m}@{b:g}" for m, b in OPERATING_BUDGET.items())
                else ""
            )
            avg = (
                "-"
                if r["avg"] is None
                else f"{r['avg']:.2f}"
                + ("" if r["delta"] is None or label == "dense" else f" ({r['delta']:+.2f})")
            )
            lines.append(f"| {bold}{label}{bold} |{cells} {avg} | {n} |")
        lines.append("")
    lines += _overview(table)
    lines += [
        "## Acceptance checks",
        "",
        "Brackets are 95% bootstrap intervals of a difference: paired within a task (the same"
        " examples); for the average of the tasks, each task's examples are resampled"
        " independently of the other's. *Clearly above*: the interval's lower bound is above 0."
        " *Within 1 point*: the average's point estimate is at most 1 point below dense (above"
        " dense counts too); *from budget X*: the lowest budget, of those run for every task,"
        " where it holds (a higher budget may still miss).",
        "",
        *acceptance(units, table),
        "",
    ]
    if analysis is not None and analysis["summary"]["num_pairs"]:
        lines += _analysis_markdown(analysis)
    lines += [
        "## Selection",
        "",
        "| task | context | examples | prompt tokens (mean) | selection sha256 | Python |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for _key, sel in sorted(selections.items()):
        ex = sel["examples"]
        mean = sum(e["prompt_tokens"] for e in ex) / max(1, len(ex))
        lines.append(
            f"| {sel['task']} | {sel['context']} | {len(ex)} | {mean:.0f} | `{sel['selection_sha256'][:16]}` | {sel['corpus']['python']} |"
        )
    lines += [
        "",
        "Raw numbers: `results.json` (per-example scores and predictions in `runs/*.json`).",
        "",
    ]
    return "\n".join(lines)


def _overview(table: dict[str, Any]) -> list[str]:
    """Avg (Δ vs dense) of every method at every context, one row per method."""
    labels = sorted({lb for rows in table["rows"].values() for lb in rows}, key=_order)
    ctxs = [str(c) for c in table["contexts"]]
    lines = [
        "## Overview: Avg (Δ vs dense) by context",
        "",
        "| method | " + " | ".join(f"{c} tokens" for c in ctxs) + " |",
        "|" + " --- |" * (len(ctxs) + 1),
    ]
    for label in labels:
        cells = []
        for c in ctxs:
            r = table["rows"][c].get(label)
            if r is None or r["avg"] is None:
                cells.append("-")
            elif r["delta"] is None or label == "dense":
                cells.append(f"{r['avg']:.2f}")
            else:
                cells.append(f"{r['avg']:.2f} ({r['delta']:+.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _analysis_markdown(analysis: dict[str, Any]) -> list[str]:
    s, cfg = analysis["summary"], analysis["config"]
    ob = f"{cfg['oracle_budget']:g}"
    lines = [
        "## Fig. 7 analog: block n omitted / drafted / completed",
        "",
        f"Recall of block n+1's representative-query selection against the per-step oracle at k = k_o "
        f"(budget {ob} of the context), per (block pair, offloaded layer), bucketed by the recall with block n omitted; "
        f"{s['num_pairs']} block pairs from units {', '.join(analysis['units'])}. "
        "Bucketing by one of the three bars favours that bar in the upper buckets and the others "
        "in the lower ones (regression to the mean); the row *all* compares them unconditionally.",
        "",
        "| omitted recall | count | omitted | drafted | completed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in s["fig7"]:
        lines.append(
            f"| [{b['bucket'][0]:.1f}, {b['bucket'][1]:.1f}) | {b['count']} | {_fmt(b['rep_omitted'], '.3f')} | {_fmt(b['rep_draft'], '.3f')} | {_fmt(b['rep_completed'], '.3f')} |"
        )
    everything = s["fig7_all"]
    lines.append(
        f"| *all* | {everything['count']} | "
        + " | ".join(_fmt(everything[v], ".3f") for v, _ in FIG7_BARS)
        + " |"
    )
    mean = s["mean"]
    budgets = sorted({x for v in mean.values() for x in v}, key=float)
    lines += [
        "",
        "## Fig. 9 analog: recall vs selection budget (oracle k at budget " + ob + ")",
        "",
        "| variant | " + " | ".join(budgets) + " |",
        "|" + " --- |" * (len(budgets) + 1),
    ]
    for v, label in VARIANTS.items():
        if v in mean:
            lines.append(
                f"| {label} | " + " | ".join(_fmt(mean[v].get(x), ".3f") for x in budgets) + " |"
            )
    per_unit = analysis.get("per_unit", {})
    if len(per_unit) > 1:
        names = [v for v in VARIANTS if any(v in u["mean"] for u in per_unit.values())]
        lines += [
            "",
            f"Per unit, at the oracle budget {ob}:",
            "",
            "| unit | pairs | " + " | ".join(names) + " |",
            "|" + " --- |" * (len(names) + 2),
        ]
        for key, u in sorted(per_unit.items()):
            cells = [_fmt(u["mean"].get(v, {}).get(ob), ".3f") for v in names]
            lines.append(f"| {key} | {u['num_pairs']} | " + " | ".join(cells) + " |")
    base = mean.get("block_completed", {}).get(ob)
    if base is not None:
        lines += [
            "",
            f"MAGE at its base budget {ob}: recall {base:.3f}. Budget at which each variant first "
            "reaches it: the first budget swept, and the crossing interpolated linearly between "
            "the two budgets around it:",
            "",
        ]
        for v in FIG9_VARIANTS:
            if v in mean:
                b = crossing_budget({float(x): r for x, r in mean[v].items()}, base)
                txt = (
                    f"{b[0]:g} ({b[0] / float(ob):.2f}x; interpolated {b[1]:.3g}, "
                    f"{b[1] / float(ob):.2f}x)"
                    if b is not None
                    else "not within the budgets swept"
                )
                lines.append(f"- {VARIANTS[v]}: {txt}")
    lines.append("")
    return lines


def crossing_budget(recall: dict[float, float], target: float) -> tuple[float, float] | None:
    """The first budget of ``recall`` (budget fraction -> mean recall) whose recall reaches
    ``target``, and the budget where the line between it and the budget before crosses
    ``target`` (the first budget itself when it is the smallest); None if none reaches it."""
    pts = sorted(recall.items())
    for i, (b, r) in enumerate(pts):
        if r >= target:
            if i == 0:
                return b, b
            b0, r0 = pts[i - 1]
            return b, b0 + (target - r0) * (b - b0) / (r - r0)
    return None


def pooled_analysis(units: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Every analysis unit's pairs pooled (same oracle budget assumed; the first unit's)."""
    found = [u for u in units.values() if u["mode"] == "analysis"]
    if not found:
        return None
    cfg = found[0]["analysis"]["config"]
    pairs = [p for u in found for p in u["analysis"]["pairs"]]
    return {
        "units": [u["unit"] for u in found],
        "config": cfg,
        "summary": summarise(pairs, cfg["oracle_budget"]),
        "per_unit": {u["unit"]: u["analysis"]["summary"] for u in found},
    }


PLANNED_NAME = "planned.json"


def record_planned(out: Path, keys: list[str]) -> None:
    """Add ``keys`` (the unit keys of a command's whole plan, every part) to
    ``out/planned.json``, so that the report can list the ones without a result yet (a time
    limit, a part not run yet)."""
    path = out / PLANNED_NAME
    known: list[str] = json.loads(path.read_text())["units"] if path.is_file() else []
    merged = sorted(set(known) | set(keys))
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"units": merged}, indent=1) + "\n")


def not_run(out: Path, done: set[str]) -> list[str]:
    """Planned unit keys without a result: the union of every ``planned.json`` under ``out``
    (parts copied into sub-folders merge, like their results), minus ``done``."""
    planned: set[str] = set()
    for path in out.rglob(PLANNED_NAME):
        planned.update(json.loads(path.read_text())["units"])
    return sorted(planned - done)


def write_report(out: Path) -> Path:
    """Write ``results.json``, ``README.md`` and the plots into ``out``; returns the README path.

    Raises:
        FileNotFoundError: no unit result under ``out``.
    """
    units, selections = collect(out)
    if not units:
        raise FileNotFoundError(f"no unit results (runs/*.json) under {out}")
    analysis = pooled_analysis(units)
    table = summary_table(units)
    results = {
        "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commands": sorted({u.get("command", "") for u in units.values()}),
        "machines": list(
            {
                json.dumps(u.get("machine", {}), sort_keys=True): u.get("machine", {})
                for u in units.values()
            }.values()
        ),
        "table": table,
        "not_run": not_run(out, set(units)),
        "acceptance": acceptance(units, table),
        "analysis": analysis,
        "units": {
            k: {
                **{
                    f: u.get(f)
                    for f in (
                        "task",
                        "context",
                        "mode",
                        "budget",
                        "num_examples",
                        "metrics",
                        "selection_sha256",
                        "timing",
                        "date_utc",
                        "command",
                    )
                },
                **(
                    {
                        "em": [r["em"] for r in u["examples"]],
                        "es": [round(r["es"], 4) for r in u["examples"]],
                    }
                    if "examples" in u
                    else {}
                ),
            }
            for k, u in sorted(units.items())
        },
        "selections": {
            k: {
                **{f: v[f] for f in ("selection_sha256", "corpus", "tokenizer", "task_config")},
                # the context files of each prompt (paths, sha256) are in examples/<key>.json
                "examples": [{f: e[f] for f in e if f != "context_files"} for e in v["examples"]],
            }
            for k, v in selections.items()
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    from herald.eval.plots import write_plots

    notes = write_plots(out, table, analysis)
    readme = out / "README.md"
    missing = results["not_run"]
    if missing:
        notes.insert(
            0,
            f"**Not run yet: {len(missing)} planned unit(s)** (stopped by a time limit, or in a "
            f"part not run yet), absent from every table above: {', '.join(missing)}. Rerun the "
            "same command (or run the missing part) with the same --out to continue.",
        )
    readme.write_text(markdown(units, selections, analysis) + "".join(f"\n{n}\n" for n in notes))
    return readme
