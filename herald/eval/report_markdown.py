"""The markdown of the evaluation report (:mod:`herald.eval.report`): the header (model,
machine, tasks, decoding), the Table I analog per context, an overview by context, the
acceptance checks (:mod:`herald.eval.acceptance`), the Fig. 7 / Fig. 9 analogs of the
selection-recall analysis (:mod:`herald.eval.recall`) and the example selections.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

from typing import Any

from herald.eval.acceptance import acceptance
from herald.eval.recall import FIG7_BARS, FIG9_VARIANTS, VARIANTS
from herald.eval.runner import OPERATING_BUDGET
from herald.eval.stats import crossing_budget
from herald.eval.summary import label_order, summary_table

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


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


_NEEDLE = "`# magic number for <key>: <value>` lines hidden in standard-library files"
_RULER_TEXT = {
    "niah_single": "one `# magic number for <key>: <value>` line hidden in standard-library files; answer its value",
    "niah_multikey": "{multikey_keys} {needle} with distinct keys, one asked; answer its value",
    "niah_multivalue": "{multivalue_values} {needle} with one key; answer every value, any order",
    "niah_multiquery": "{multiquery_keys} {needle}, every key asked; answer the values in the order asked",
    "vt": "variable tracking: {vt_chains} chains of {vt_hops} hops (`VAR_A = 12345`, `VAR_B = VAR_A`, ...) hidden in standard-library files; answer every name bound to the asked value, any order",
    "cwe": "common words: a list of standard-library words, {cwe_common} of them {cwe_common_freq} times, the others {cwe_rare_freq}; answer the {cwe_common} common ones, any order",
}


def _task_text(task: str, cfg: dict[str, Any]) -> str:
    """One task's description for the report header, from the run's recorded settings."""
    tasks = cfg.get("tasks", {})
    if task in _RULER_TEXT:
        sizes = tasks.get("ruler", {})
        try:
            text = _RULER_TEXT[task].format(needle=_NEEDLE, **sizes)
        except KeyError:  # settings not recorded
            text = _RULER_TEXT[task].replace("{needle}", _NEEDLE)
        control = cfg.get("decode", {}).get("control_tokens", 512)
        tail = "" if task == "cwe" else f"; no needle in the last {control} tokens"
        return (
            f"**{task}** = RULER-style, {text}{tail}; prompt <= context - "
            f"{sizes.get('answer_tokens', '?')} tokens (headline = EM of the answer line)"
        )
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
        "# herald eval: long-context accuracy (HERALD §VI-B)",
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
        for label in sorted(rows, key=label_order):
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
    labels = sorted({lb for rows in table["rows"].values() for lb in rows}, key=label_order)
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
