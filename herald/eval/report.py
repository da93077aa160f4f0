"""The evaluation report: merges every unit result under an output directory into
``results.json`` (raw per-example numbers, summaries, provenance), ``README.md`` (Table I, Fig. 7
and Fig. 9 analogs as tables, acceptance checks) and plots (``accuracy_<context>.png``,
``fig7.png``, ``fig9.png``; matplotlib Agg, the ``plot`` extra: where it is not installed the
tables are written, the plots skipped, and one line says so).

Unit results are read from ``**/runs/*.json`` (parts of a run copied into sub-folders merge);
a unit found twice keeps the newest. Example selections come from ``**/examples/*.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from herald.eval.acceptance import acceptance
from herald.eval.recall import summarise
from herald.eval.report_markdown import markdown
from herald.eval.summary import summary_table


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
