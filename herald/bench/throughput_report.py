"""README.md and plots of the throughput benchmark (:mod:`herald.bench.throughput`), rebuilt from
the raw JSONL records alone (``--report DIR``), e.g. where the GPU machine lacks matplotlib (the
``plot`` extra: without it the tables are written and the plots skipped, with one line saying so).

Sections, in README order: the targets (:mod:`herald.bench.throughput_targets`: HERALD / Dense
against the paper's Table II ratio, HERALD against the baselines, HERALD §VI-C; where one is
missed, the limiting ceiling and what would lift it), the Table II analog (peak throughput and
its batch per mode, context and model; at the 80 GB cap and on the whole GPU), the Fig. 12
analog (throughput vs batch at 32K with the ceilings), the Fig. 13 analog (the ablation ladder,
§VI-D), the Fig. 14 analog (T sweep with per-block main / retrieval latency), every sweep
(:mod:`herald.bench.throughput_tables`), uniform vs mixed contexts (only where
``--mixed-contexts`` measured points: they appear nowhere else but in every sweep and every
point, as their own rows; every other table is uniform points'), repeatability (:mod:`herald.bench.throughput_repeats`),
method, provenance and every point. The records are read by :mod:`herald.bench.throughput_data`.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from herald.bench import plotting
from herald.bench.throughput_data import REHEARSAL_NOTE, Data, cell, rehearsal_mark
from herald.bench.throughput_plan import CAP_H100, VARIANTS
from herald.bench.throughput_records import load_records
from herald.bench.throughput_repeats import remeasured, repeats
from herald.bench.throughput_tables import (
    all_points,
    dram_bounds,
    fig12,
    fig13,
    fig14,
    h100_room,
    mixed_contexts,
    sweeps_summary,
    table2,
)
from herald.bench.throughput_targets import targets


def _code(run: dict[str, Any]) -> str:
    """The run's code version: git commit if known, else the source hash; "-" for runs recorded
    before versions were (the commit log dates them)."""
    code = run.get("code") or {}
    return code.get("git") or (f"src {code['source_sha256']}" if "source_sha256" in code else "-")


def provenance(d: Data) -> list[str]:
    lines = ["## Provenance", ""]
    lines += ["| run | date (UTC) | command | code | GPU | CPU | DRAM GiB | torch | PCIe H2D GB/s | DRAM read GB/s | points |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    count: dict[str, int] = defaultdict(int)
    for p in d.points:
        count[p["run_id"]] += 1
    for r in d.runs:
        if not count.get(r["run_id"]):
            continue
        m, mc = r["machine"], d.machines.get(r["run_id"], {})
        lines.append(
            f"| {r['run_id']} | {m.get('date_utc', '')} | `{r['command']}` | {_code(r)} "
            f"| {m.get('gpu', 'cpu')} "
            f"| {m.get('cpu_model', '?')} x{m.get('cpu_count')} | {m.get('mem_total_gib')} "
            f"| {m.get('torch')} | {cell((mc.get('pcie') or {}).get('h2d_gbs'), '.1f')} "
            f"| {cell((mc.get('dram') or {}).get('reference_gbs'), '.1f')} | {count[r['run_id']]} |"
        )
    # The measurement settings of each run (its time limit bounds the run, not a point: the
    # command line shows it); one line per distinct set, naming its runs when there are several.
    runs_of: dict[tuple[tuple[str, Any], ...], list[str]] = defaultdict(list)
    for r in d.runs:
        if count.get(r["run_id"]):
            kept = {k: v for k, v in r.get("settings", {}).items() if k != "time_limit_s"}
            runs_of[tuple(sorted(kept.items()))].append(r["run_id"])
    for s in sorted(runs_of, key=str):  # a stable order: the README is rebuilt, not edited
        who = "every run" if len(runs_of) == 1 else "runs " + ", ".join(runs_of[s])
        lines += ["", f"Settings ({who}): " + ", ".join(f"{k} = {v}" for k, v in s)]
    return lines


METHOD = """## Method

Full-size architectures with random bf16 weights (speed does not depend on weight values), B = 32,
fixed T denoising steps per block (T = 20 unless stated) plus one commit forward, EOS ignored.
Every request of a point is admitted at once with a **synthetic prefill** (random KV in the GPU
stores and the CPU pool, random initial sparse pools: decode speed does not depend on KV values;
real prefill throughput is in `results/dense`). Each point decodes warm-up blocks (CUDA graph
capture, compilation of new shapes, the first block) and then timed blocks; **decode throughput =
tokens generated in the timed blocks / their wall time** (two timed blocks; one where the warm-up
took longer than `slow_block_s`: the `timed_blocks` field of each point). **Dense and HERALD
points rehearse** first: they decode the same prompts' blocks once, abort them, admit them again
and time the second pass (the `rehearsal` field keeps the first pass), because some one-time
costs fall inside the timed blocks however many blocks warm up, costs a serving process pays
once: dense's key length grows by one block per block (no padding, so no mask) and each new
length costs an attention plan (40-70 ms in a block's first step); HERALD's draft forward runs
once per block and is captured into a CUDA graph on its second use, the first timed block
(about 60 ms). The other modes run forwards of fixed shapes, which the warm-up block repeats.
Each point is one such
measurement, not a mean of repeats: see Repeatability for how much two differ. A sweep ends at its first point that does
not fit: `GPU OOM` (out of GPU memory under the cap) or `DRAM` (CPU pool or pinned staging). The
80 GB cap limits PyTorch's allocator to 80e9 bytes (the CUDA context and library workspaces,
~1 GB, are outside it), 5.1 GiB less than an H100 80GB holds: the section after Table II shows
what that changes. Uncapped offloading sweeps whose 80 GB sweep never ran out of GPU memory
are not rerun (`= 80 GB run`): their batch is bounded by DRAM, not by the GPU.

Ceilings (tokens/s; the paper's Fig. 5), with k = ceil(budget x S) rows per KV head and
offloaded layer and bytes/token = offloaded layers x 2 x KV heads x head_dim x 2:

- per-step fetch = B / (T x k x bytes/token / PCIe): the selected KV reloaded every step (MAGE / AR style)
- per-block fetch = B / (k x bytes/token / PCIe): once per block (HERALD); full KV: k = S
- CPU selection (measured) = batch x B / (offloaded layers x (select + gather time of one layer at that batch)),
  with the selection kernel on random KV of the point's shape (1 query for the representative query, B for MAGE)
- CPU selection at DRAM speed = B x DRAM read bandwidth / (S x bytes read per token: K, and V in the `full` output mode)
- GPU forward (measured) = batch x B / (T x median plain denoising forward at that batch)

PCIe (pinned host-to-device, 1 GiB, best of 3) and DRAM read bandwidth (all threads) are measured at
the start of every run, and each point's ceilings use its own run's probes: the DRAM probe varies
between runs (Provenance), so "CPU selection at DRAM speed" is an estimate that a measured point can
exceed when its run's probe read low."""


def cold_points(d: Data) -> list[str]:
    """A warning, placed before the targets, when points of a rehearsing variant (Method) were
    measured before it rehearsed: their timed blocks paid one-time costs."""
    cold = Counter(
        p["variant"] for p in d.points
        if p["status"] == "ok" and VARIANTS[p["variant"]].rehearses and "rehearsal" not in p
    )  # fmt: skip
    if not cold:
        return []
    what = ", ".join(f"{n} {v}" for v, n in sorted(cold.items()))
    return [
        f"**Points measured before their mode rehearsed ({what})**: their timed blocks paid "
        "one-time costs (dense: attention plans; HERALD: the draft forward's CUDA graph capture), "
        "so they are slower than a warm server; `results/throughput/superseded/README.md` says "
        "by how much on the one-GPU host. Ratios below that involve them are biased by it.",
        "",
    ]


def write_report(out: Path) -> Path:
    """README.md (+ fig12_*.png, fig13_ablation.png, fig14_steps.png) in ``out`` from its JSONL.

    Raises ValueError if ``out`` is not a folder or its ``*.jsonl`` hold no measured point."""
    if not out.is_dir():
        raise ValueError(f"{out}: no such results folder")
    d = Data(load_records(out))
    if not d.points:
        raise ValueError(f"{out}: no measured point in its *.jsonl (nothing to report)")
    plots: list[str] = []
    lines = [
        "# Decode throughput vs batch, with measured ceilings (HERALD §VI-C)",
        "",
        "Written by `python -m herald.bench.throughput --report` from the raw records in "
        "`throughput.jsonl` (one line per measured point, per run and per machine probe).",
        "",
    ]
    if (out / "superseded").is_dir():
        lines += [
            "Points measured before a fix that changed them are kept in `superseded/` (its README "
            "says which and why) and left out of every table here until measured again.",
            "",
        ]
    lines += cold_points(d)
    if any(rehearsal_mark(p) for p in d.points):
        lines += [REHEARSAL_NOTE + ".", ""]
    lines += targets(d) + [""]
    lines += ["## Table II analog: peak decode throughput and its batch", ""]
    for cap in (CAP_H100, None):
        lines += table2(d, cap) + [""]
    for part in (h100_room(d), dram_bounds(d)):
        lines += [*part, ""] if part else []
    lines += ["## Fig. 12 analog: throughput vs batch at 32K, with the ceilings", ""]
    for m in d.models():
        for cap in (CAP_H100, None):
            lines += fig12(d, out, m, cap, plots) + [""]
    lines += ["## Fig. 13 analog: ablation ladder (LLaDA2.0-mini, 5%, 80 GB cap)", ""]
    lines += fig13(d, out, plots) + [""]
    lines += ["## Fig. 14 analog: denoising steps T (LLaDA2.0-mini, 80 GB cap)", ""]
    lines += fig14(d, out, plots) + [""]
    lines += sweeps_summary(d) + [""]
    mixed = mixed_contexts(d)
    lines += [*mixed, ""] if mixed else []
    lines += repeats(d) + [""]
    lines += remeasured(d, sorted((out / "superseded").glob("remeasured*.jsonl")))
    lines += [METHOD, ""] + provenance(d) + [""] + all_points(d)
    if plotting.pyplot() is None and d.points:
        plotting.skipped("throughput report")
        lines += [
            "",
            f"(no plots: matplotlib is not installed here; {plotting.INSTALL_HINT}, then rerun "
            "`--report`)",
        ]
    else:  # a plot this report no longer draws (its data superseded) must not linger beside it
        for old in [*out.glob("fig12_*.png"), out / "fig13_ablation.png", out / "fig14_steps.png"]:
            if old.is_file() and old.name not in plots:
                old.unlink()
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
