"""The throughput benchmark's records, indexed for its report
(:mod:`herald.bench.throughput_report`).

:class:`Data` holds the points of a results folder by sweep (later records win; GPU points only
where any ran on a GPU), the runs, their hosts and machine probes; the helpers here read a sweep
(its peak, why it ended, what is still pending) and format the table cells every section shares.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from herald.bench import ceilings as ceil
from herald.bench import throughput_plan as plan
from herald.bench.throughput_plan import CAP_H100, K16, K32, LLADA, SDAR, VARIANTS
from herald.bench.throughput_records import (
    host_memory,
    refine_todo,
    smaller_host_dram_ends,
)

# The ceilings that can bind each variant (keys of herald.bench.ceilings.NAMES): HERALD-like
# modes fetch the selected rows once per block and select on the CPU; MAGE with GPU selection
# moves the full KV every block; InfiniGen fetches its (proxy-selected) rows once per block;
# Dense only runs forwards.
_CPU_SELECTING = ("per_block_fetch", "cpu_selection", "gpu_forward")
RELEVANT = {
    "dense": ("gpu_forward",),
    "herald": _CPU_SELECTING,
    "herald-selected": _CPU_SELECTING,
    "herald-int8-gpu": ("per_block_fetch", "gpu_forward"),
    "mage-cpu-rep": _CPU_SELECTING,
    "mage-cpu": _CPU_SELECTING,
    "mage": ("full_kv_per_block_fetch", "gpu_forward"),
    "infinigen": ("per_block_fetch", "gpu_forward"),
}


def lowest_ceiling(c: dict[str, float], keys: tuple[str, ...]) -> str:
    """The key of the lowest of ``c``'s ceilings among ``keys`` ("-" when it has none)."""
    have = {k: c[k] for k in keys if k in c}
    return min(have, key=lambda k: have[k]) if have else "-"


class Data:
    """The records of a results folder, indexed for the tables."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.runs = [r for r in records if r.get("kind") == "run"]
        self.machines = {r["run_id"]: r for r in records if r.get("kind") == "machine"}
        pts = [r for r in records if r.get("kind") == "point"]
        if any(p.get("device") == "cuda" for p in pts):
            pts = [p for p in pts if p.get("device") == "cuda"]
        self.sweeps: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = defaultdict(dict)
        for p in pts:  # later records win
            self.sweeps[plan.record_sweep_key(p)][p["batch"]] = p
        # DRAM ends measured on a smaller host than the sweep's own do not end it (shown aside)
        memory = host_memory(records)
        self.aside: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
        for key, recs in self.sweeps.items():
            aside = smaller_host_dram_ends(recs, memory)
            for b in aside:
                del recs[b]
            if aside:
                self.aside[key] = aside
        self.points = [p for s in self.sweeps.values() for p in s.values()]
        self.points += [p for s in self.aside.values() for p in s.values()]
        self.host = hosts(self.runs)  # run -> (cores, DRAM GiB)
        common = Counter(self.host.get(p["run_id"]) for p in self.points).most_common(1)
        self.common_host = common[0][0] if common else None
        pcie = [m["pcie"]["h2d_gbs"] for m in self.machines.values() if m.get("pcie")]
        dram = [m["dram"]["reference_gbs"] for m in self.machines.values() if m.get("dram")]
        self.pcie = statistics.median(pcie) if pcie else None
        self.dram = statistics.median(dram) if dram else None

    def contexts(self, model: str | None = None) -> list[int]:
        """Contexts measured (for ``model``), else the paper's 16K and 32K."""
        got = sorted({p["context"] for p in self.points if model is None or p["model"] == model})
        return got or [K16, K32]

    def models(self) -> list[str]:
        seen = dict.fromkeys(p["model"] for p in self.points)
        first = [m for m in (LLADA, SDAR) if m in seen]
        return first + [m for m in seen if m not in first]

    def sweep(
        self, model: str, ctx: int, variant: str, budget: float | None, cap: float | None,
        steps: int = 20, contexts: str = plan.UNIFORM,
    ) -> tuple[dict[int, dict[str, Any]], str]:  # fmt: skip
        """Points of a sweep (uniform contexts unless ``contexts`` says) and a note: uncapped
        offloading sweeps fall back to the 80 GB one when it never ran out of GPU memory (as the
        benchmark itself does)."""
        key = plan.sweep_key(model, ctx, variant, budget, cap, steps, contexts)
        recs = self.sweeps.get(key, {})
        if recs or cap is not None or not VARIANTS[variant].offload:
            return recs, self.aside_note(key)
        capped_key = plan.sweep_key(model, ctx, variant, budget, CAP_H100, steps, contexts)
        capped = self.sweeps.get(capped_key, {})
        if capped and not any(r["status"] == "oom" for r in capped.values()):
            return capped, "= 80 GB run"
        return {}, ""

    def machine_note(self, rec: dict[str, Any] | None) -> str:
        """A note such as " (on 32 cores, 251.8 GiB)" when ``rec`` ran on another host shape
        (cores, DRAM) than most points did (e.g. SDAR-8B on the two-GPU machine for its DRAM);
        else ""."""
        mine = None if rec is None else self.host.get(rec["run_id"])
        if mine is None or mine == self.common_host:
            return ""
        return f" (on {mine[0]} cores, {mine[1]} GiB)"

    def aside_note(self, key: tuple[Any, ...]) -> str:
        """ "bs 40: DRAM on 16 cores, 125.9 GiB" for the DRAM ends of a smaller host that do not
        end the sweep (:func:`herald.bench.throughput_records.smaller_host_dram_ends`); else ""."""
        parts = []
        for b, r in sorted(self.aside.get(key, {}).items()):
            host = self.host.get(r["run_id"]) or ("?", "?")
            parts.append(f"bs {b}: DRAM on {host[0]} cores, {host[1]} GiB")
        return "; ".join(parts)

    def ceilings(self, rec: dict[str, Any]) -> dict[str, float]:
        m = self.machines.get(rec.get("run_id", ""), {})
        pcie = (m.get("pcie") or {}).get("h2d_gbs") or self.pcie
        dram = (m.get("dram") or {}).get("reference_gbs") or self.dram
        return ceil.point_ceilings(rec, pcie, dram)


HOST_DRAM_TOLERANCE_GIB = 2.0
"""Two runs whose DRAM totals differ by at most this are one host shape: the same machine
reports 125.8 or 125.9 GiB on different boots, and the kernel's own reservations move it."""


def hosts(runs: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """run_id -> (cores, DRAM GiB), DRAM totals within :data:`HOST_DRAM_TOLERANCE_GIB` of the
    smallest of their group shown as that group's (rounded) smallest, so that a boot-to-boot
    wobble does not split one host in two (plain rounding would: 125.4 vs 125.6)."""
    mems = sorted(
        {m for r in runs if isinstance(m := r.get("machine", {}).get("mem_total_gib"), int | float)}
    )
    canon: dict[float, int] = {}
    first: float | None = None
    for m in mems:
        if first is None or m - first > HOST_DRAM_TOLERANCE_GIB:
            first = m
        canon[m] = round(first)
    out = {}
    for r in runs:
        m = r.get("machine", {})
        mem = m.get("mem_total_gib")
        out[r["run_id"]] = (m.get("cpu_count"), canon.get(mem, mem))
    return out


def planned_batches(model: str, ctx: int, variant: str) -> tuple[int, ...]:
    """The plan's batch list of a sweep; empty where the plan has none (a custom model/context)."""
    try:
        return plan.batches_for(model, ctx, variant)
    except ValueError:
        return ()


def pending(recs: dict[int, dict[str, Any]], planned: tuple[int, ...]) -> list[int]:
    """Planned batches not measured yet. A sweep that ended (GPU OOM or DRAM at some batch) has
    none past its end; a planned dense sweep whose GPU OOM end is still more than 8 batches past
    its last fit has the next narrowing batch (:func:`herald.bench.throughput_records.refine_todo`,
    as the benchmark runs it)."""
    if any(r["status"] != "ok" for r in recs.values()):
        return refine_todo(recs, next(iter(recs.values()))["variant"], bool(planned))
    return [b for b in planned if b not in recs]


def stop_reason(recs: dict[int, dict[str, Any]], planned: tuple[int, ...] = ()) -> str:
    bad = sorted((b, r) for b, r in recs.items() if r["status"] != "ok")
    if bad:
        b, r = bad[0]
        what = {"oom": "GPU OOM", "dram": "DRAM"}.get(r["status"], r["status"])
        todo = pending(recs, planned)
        more = f"; **incomplete**: bs {todo[0]} pending (narrowing the OOM end)" if todo else ""
        return f"{what} at bs {b}{more}"
    if not recs:
        return "not measured"
    todo = pending(recs, planned)
    if todo:
        return f"**incomplete**: bs {', '.join(map(str, todo))} pending"
    return f"end of list (bs {max(recs)})"


REHEARSAL_MARK = "†"
REHEARSAL_NOTE = (
    f"{REHEARSAL_MARK} per-block stream times of the point's rehearsal pass (the same requests "
    "decoded once before the timed pass; its first timed block includes HERALD's one-time draft "
    "graph capture, about 60 ms): the timed pass's were not recorded (a bug, fixed; "
    "`scripts/diagnostics/relabel_rehearsal_block_stats.py` moved the mislabelled ones)"
)


def block_stat(rec: dict[str, Any] | None, key: str) -> Any:
    """A per-block stream stat (``block_main_s`` ...) of a point's timed pass, else of its
    rehearsal pass (:data:`REHEARSAL_NOTE`), else None."""
    if not rec:
        return None
    got = rec.get(key)
    return got if got is not None else (rec.get("rehearsal") or {}).get(key)


def rehearsal_mark(rec: dict[str, Any] | None) -> str:
    """:data:`REHEARSAL_MARK` when ``rec``'s block stats come from its rehearsal pass."""
    if rec and rec.get("block_main_s") is None and block_stat(rec, "block_main_s") is not None:
        return REHEARSAL_MARK
    return ""


MIXED_SUFFIX = " (mixed)"


def variant_label(rec: dict[str, Any]) -> str:
    """A point's variant, suffixed :data:`MIXED_SUFFIX` when its contexts are mixed (its rows
    are kept apart from the uniform point's)."""
    return rec["variant"] + (MIXED_SUFFIX if plan.record_contexts(rec) == plan.MIXED else "")


def mean_of(xs: list[float] | None) -> float | None:
    return sum(xs) / len(xs) if xs else None


def cell(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def cap_label(cap: float | None) -> str:
    return f"{cap:g} GB cap" if cap else "whole GPU"
