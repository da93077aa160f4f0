"""Records of the throughput benchmark: the JSONL files, the settings a point was measured
with, and which points of a sweep are done.

Every measured point is one JSON line of ``OUT/throughput.jsonl`` (after a ``run`` line: command,
machine, settings; and a ``machine`` line: the PCIe and DRAM probes). A point counts as done for
a command only when it was measured with the same settings (:func:`run_setting`: every flag that
changes what a point measures); a sweep ends at its first point that does not fit, and a dense
sweep's GPU-out-of-memory end is narrowed (:func:`refine_batch`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from herald.bench import throughput_plan as plan
from herald.bench.throughput_plan import VARIANTS, Sweep

JSONL_NAME = "throughput.jsonl"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- records ------------------------------------------------------------------------------------


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every record of every ``*.jsonl`` under ``out`` (sorted by name; a partial last line, from
    a run killed mid-write, is skipped)."""
    return [rec for path in sorted(out.glob("*.jsonl")) for rec in load_records_file(path)]


def load_records_file(path: Path) -> list[dict[str, Any]]:
    """The records of one ``.jsonl`` file (a malformed line is skipped, with a log line)."""
    recs: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                log(f"skipping a malformed line in {path}")
    return recs


def append_record(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def host_memory(records: list[dict[str, Any]]) -> dict[str, float]:
    """run_id -> the DRAM (GiB) of the host each run record ran on."""
    return {
        r["run_id"]: float(r["machine"]["mem_total_gib"])
        for r in records
        if r.get("kind") == "run" and (r.get("machine") or {}).get("mem_total_gib") is not None
    }


def smaller_host_dram_ends(
    recs: dict[int, dict[str, Any]], memory: dict[str, float], here_gib: float | None = None
) -> dict[int, dict[str, Any]]:
    """The ``dram`` points of a sweep that do not end it: measured on a host with less DRAM than
    one that measured an ``ok`` point of the sweep (e.g. SDAR-8B 32K, measured on the two-GPU
    machine's 256 GiB, resumed on the one-GPU machine's 125 GiB): that host's DRAM bounds the
    batch, not the sweep's own host. With ``here_gib`` (the host running now), a point from a
    host with at least that much DRAM still ends the sweep here: it would not fit here either."""
    ok = [
        memory[r["run_id"]]
        for r in recs.values()
        if r["status"] == "ok" and r.get("run_id") in memory
    ]
    if not ok:
        return {}
    most = max(ok)
    out = {}
    for b, r in recs.items():
        gib = memory.get(r.get("run_id", ""))
        if r["status"] != "dram" or gib is None or gib >= 0.95 * most:  # same host kind
            continue
        if here_gib is not None and gib >= here_gib:
            continue
        out[b] = r
    return out


# -- settings: what a point measures besides its sweep -----------------------------------------

# Each setting that changes what a point measures, and the flag that sets it (``kv_pad`` is
# ``--dense-kv-pad``'s on a dense point). ``--dram-reserve-gb`` is not one: like the host's DRAM,
# it only bounds the automatic pool (a smaller host's DRAM end is handled apart, see
# :func:`smaller_host_dram_ends`); nor are the time limit and the probes' sizes.
SETTING_FLAGS = {
    "device": "--device",
    "block_size": "--block-size",
    "warmup_blocks": "--warmup-blocks",
    "timed_blocks": "--timed-blocks",
    "slow_block_s": "--slow-block-s",
    "prefill": "--real-prefill",
    "kv_pad": "--kv-pad",
    "offload_cuda_graph": "--offload-cuda-graph",
    "cpu_kv_gb": "--cpu-kv-gb",
    "selection_threads": "--selection-threads",
}
# Read from the point's run record (``settings``), not from the point: a point's own
# ``timed_blocks`` is how many blocks it timed (one after a slow warm-up), not the flag's value.
RUN_SETTINGS = ("timed_blocks", "slow_block_s", "cpu_kv_gb")
# The settings a point record carries from :meth:`Runner.setting`. It has block_size,
# warmup_blocks and prefill under those names anyway, and an offloading point that ran has the
# selection_threads it ran with (from measure_point); the rest are in its run's ``settings``.
POINT_SETTINGS = ("device", "kv_pad", "offload_cuda_graph")
# The values of the runs that did not record a setting (the only ones there were then).
UNRECORDED: dict[str, Any] = {
    "block_size": 32,
    "warmup_blocks": 1,
    "timed_blocks": 2,
    "slow_block_s": 15.0,
    "prefill": "synthetic",
    "cpu_kv_gb": None,
}


def run_setting(args: argparse.Namespace, offload: bool) -> dict[str, Any]:
    """The settings this command measures a dense (``offload`` False) or offloading point with,
    as :func:`record_setting` reads them back. ``--selection-threads`` counts only when given:
    left out, the kernel takes the host's cores, and the host is not a setting."""
    s: dict[str, Any] = {
        "device": torch.device(args.device).type,
        "block_size": args.block_size,
        "warmup_blocks": args.warmup_blocks,
        "timed_blocks": args.timed_blocks,
        "slow_block_s": args.slow_block_s,
        "prefill": "real" if args.real_prefill else "synthetic",
    }
    if offload:
        s["offload_cuda_graph"] = args.offload_cuda_graph
        s["kv_pad"] = args.kv_pad
        s["cpu_kv_gb"] = args.cpu_kv_gb
        if args.selection_threads is not None:
            s["selection_threads"] = args.selection_threads
    else:
        s["kv_pad"] = args.dense_kv_pad
    return s


def run_settings(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """run_id -> the ``settings`` of its run record."""
    return {
        r["run_id"]: r.get("settings") or {}
        for r in records
        if r.get("kind") == "run" and "run_id" in r
    }


def record_setting(rec: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The settings point ``rec`` was measured with (the keys of :data:`SETTING_FLAGS`): its own
    fields, those of :data:`RUN_SETTINGS` from its run's ``settings`` (``runs``:
    :func:`run_settings`), :data:`UNRECORDED` where neither has one (None for the rest). No
    ``selection_threads`` where the point has none (a failed point, a dense one): any matches."""
    run = runs.get(rec.get("run_id", ""), {})
    out = {}
    for k in SETTING_FLAGS:
        src = run if k in RUN_SETTINGS else rec
        out[k] = src[k] if k in src else UNRECORDED.get(k)
    if "selection_threads" not in rec:
        del out["selection_threads"]
    return out


def setting_differs(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The settings of ``want`` that ``have`` (:func:`record_setting`) holds another value of."""
    return [k for k, v in want.items() if k in have and have[k] != v]


def show_setting(setting: str, value: Any) -> str:
    """A setting's value as its flag takes it (the prefill and switches as on / off)."""
    if setting == "prefill":
        value = value == "real"
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def is_offload_record(rec: dict[str, Any]) -> bool:
    v = VARIANTS.get(rec.get("variant", ""))
    return v.offload if v is not None else rec.get("mode", "dense") != "dense"


def point_records(
    records: list[dict[str, Any]],
    sweep: Sweep,
    setting: dict[str, Any] | None = None,
    here_gib: float | None = None,
) -> dict[int, dict[str, Any]]:
    """The latest record per batch of ``sweep`` (measured with ``setting``, :func:`run_setting`,
    if given), less the DRAM ends of smaller hosts (:func:`smaller_host_dram_ends`)."""
    out: dict[int, dict[str, Any]] = {}
    runs = run_settings(records) if setting else {}
    for r in records:
        if r.get("kind") != "point" or plan.record_sweep_key(r) != sweep.key:
            continue
        if setting and setting_differs(record_setting(r, runs), setting):
            continue
        if r["status"] == "ok" and VARIANTS[sweep.variant].rehearses and "rehearsal" not in r:
            continue  # timed before its variant rehearsed: one-time costs in its timed blocks
        out[r["batch"]] = r
    for b in smaller_host_dram_ends(out, host_memory(records), here_gib):
        del out[b]
    return out


def sweep_status(
    recs: dict[int, dict[str, Any]], batches: tuple[int, ...], retry_errors: bool = False
) -> tuple[list[int], bool]:
    """(batches still to measure, whether the sweep ended on a capacity failure). A sweep stops
    at its first ``oom`` / ``dram`` point: larger batches cannot fit either."""
    todo = []
    for bs in sorted(batches):
        r = recs.get(bs)
        if r is None or (retry_errors and r["status"] == "error"):
            todo.append(bs)
        elif r["status"] in ("oom", "dram"):
            return todo, True
    return todo, False


REFINE_GRAIN = 8  # dense sweeps bisect a GPU OOM end until this close to the last fit


def refine_batch(recs: dict[int, dict[str, Any]], grain: int = REFINE_GRAIN) -> int | None:
    """The next batch that narrows a sweep's GPU-out-of-memory end: about halfway (the last
    fit plus a multiple of 4) between the largest batch that fit below the first OOM and that
    OOM, while they are more than ``grain`` apart; None when close enough, or when the sweep
    did not end on an OOM. So the dense baseline runs at (nearly) the largest batch that fits,
    not the largest one on a coarse list (HERALD §VI-C: Dense at its largest batch that fits)."""
    fails = sorted(b for b, r in recs.items() if r["status"] == "oom")
    if not fails:
        return None
    ok = [b for b, r in recs.items() if r["status"] == "ok" and b < fails[0]]
    if not ok or fails[0] - max(ok) <= grain:
        return None
    lo = max(ok)
    mid = lo + max(4, (fails[0] - lo) // 2 // 4 * 4)
    return mid if lo < mid < fails[0] and mid not in recs else None


def refine_todo(recs: dict[int, dict[str, Any]], variant: str, planned: bool) -> list[int]:
    """[the next narrowing batch] of a planned dense sweep that ended on a GPU OOM more than
    ``REFINE_GRAIN`` past its last fit (:func:`refine_batch`), else [] (offloading sweeps and
    custom ones are not narrowed). The runner measures it; the report lists it as pending."""
    if not planned or VARIANTS[variant].offload:
        return []
    mid = refine_batch(recs)
    return [] if mid is None else [mid]


def peak(recs: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in recs.values() if r["status"] == "ok"]
    return max(ok, key=lambda r: r["decode_tokens_per_s"]) if ok else None
