"""The Table I analog's numbers (HERALD §VI-B) from the unit results of an evaluation: per
context, one row per method (dense, the no-context control, each mode at each budget) with each
task's EM, ES, headline score and agreement with dense, the tasks' average and its difference
from dense.
"""

from __future__ import annotations

from typing import Any


def per_example(res: dict[str, Any], metric: str) -> list[float]:
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
            fp = u.get("config", {}).get("decode", {}).get("first_pass", "none")
            mode = u["mode"] if fp == "none" else f"{u['mode']} ({fp})"  # herald --first-pass
            label = mode if u["budget"] is None else f"{mode}@{u['budget']:g}"
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


def label_order(label: str) -> tuple[int, float]:
    mode, _, budget = label.partition("@")
    rank = {"dense": 0, "control": 1, "mage": 2, "infinigen": 3, "herald": 4}.get(mode, 9)
    return rank, float(budget or 0)
