"""README.md and plots of the throughput benchmark (:mod:`herald.bench.throughput`), rebuilt from
the raw JSONL records alone (``--report DIR``), e.g. where the GPU machine lacks matplotlib.

Tables: Table II analog (peak throughput and its batch per mode, context and model; at the 80 GB
cap and on the whole GPU), Fig. 12 analog (throughput vs batch at 32K with the ceilings), Fig. 13
analog (the ablation ladder), Fig. 14 analog (T sweep with per-block main / retrieval latency),
the targets of issue 5 with, where one is missed, the limiting ceiling and what would lift it.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from herald.bench import ceilings as ceil
from herald.bench import throughput_plan as plan
from herald.bench import throughput_plots as tplots
from herald.bench.throughput_plan import CAP_H100, K16, K32, LLADA, SDAR, VARIANTS
from herald.bench.throughput_plan import ctx_label as _ctx
from herald.bench.throughput_run import host_memory, refine_todo, smaller_host_dram_ends

TARGET_RATIO = 2.28  # HERALD / Dense, LLaDA2.0-mini 32K, 80 GB cap (the paper's Table II)
CEILING_NAMES = ceil.NAMES
LIFT = {
    "cpu_selection": "a cheaper selection pass per block: the kernel streams the whole prefix KV "
    "once per block, so more DRAM bandwidth (the paper's server: 307 GB/s), fewer bytes read "
    "(the `selected` output mode reads K only) or a kernel closer to the DRAM-speed ceiling",
    "gpu_forward": "a faster main stream at this batch: the offloading engine's forward (CUDA "
    "graphs, batched KV hand-offs, a fused MoE), or a larger batch where memory allows",
    "per_block_fetch": "fewer bytes per block (a smaller budget) or a faster host link",
    "dram": "more DRAM for the CPU pool (the two-GPU machine variant has 256 GiB): the batch "
    "would grow until a throughput ceiling binds (`results/throughput_256g/` measured that host; "
    "it also has twice the cores and a faster DRAM probe, so its gain is not DRAM size alone)",
}


LIFT_SELECTED = (
    "a cheaper selection pass per block: the `selected` mode already reads K only, so more DRAM "
    "bandwidth (the paper's server: 307 GB/s), a kernel closer to the DRAM-speed ceiling, the "
    "gather of the selected rows fused into the kernel (it re-reads them today), or a compact "
    "copy of K for scoring"
)


# The ceilings that can bind each variant: HERALD-like modes fetch the selected rows once per block
# and select on the CPU; MAGE with GPU selection moves the full KV every block; InfiniGen fetches
# its (proxy-selected) rows once per block; Dense only runs forwards.
_CPU_SELECTING = ("per_block_fetch", "cpu_selection", "gpu_forward")
RELEVANT = {
    "dense": ("gpu_forward",),
    "herald": _CPU_SELECTING,
    "herald-selected": _CPU_SELECTING,
    "mage-cpu-rep": _CPU_SELECTING,
    "mage-cpu": _CPU_SELECTING,
    "mage": ("full_kv_per_block_fetch", "gpu_forward"),
    "infinigen": ("per_block_fetch", "gpu_forward"),
}


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
        self.host = _hosts(self.runs)  # run -> (cores, DRAM GiB)
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
        steps: int = 20,
    ) -> tuple[dict[int, dict[str, Any]], str]:  # fmt: skip
        """Points of a sweep and a note: uncapped offloading sweeps fall back to the 80 GB one
        when it never ran out of GPU memory (as the benchmark itself does)."""
        key = plan.sweep_key(model, ctx, variant, budget, cap, steps)
        recs = self.sweeps.get(key, {})
        if recs or cap is not None or not VARIANTS[variant].offload:
            return recs, self.aside_note(key)
        capped = self.sweeps.get(plan.sweep_key(model, ctx, variant, budget, CAP_H100, steps), {})
        if capped and not any(r["status"] == "oom" for r in capped.values()):
            return capped, "= 80 GB run"
        return {}, ""

    def machine_note(self, rec: dict[str, Any] | None) -> str:
        """A note such as " (on 32 cores, 251.8 GiB)" when ``rec`` ran on another host shape (cores, DRAM) than
        most points did (e.g. SDAR-8B on the two-GPU machine for its DRAM); else ""."""
        mine = None if rec is None else self.host.get(rec["run_id"])
        if mine is None or mine == self.common_host:
            return ""
        return f" (on {mine[0]} cores, {mine[1]} GiB)"

    def aside_note(self, key: tuple[Any, ...]) -> str:
        """ "bs 40: DRAM on 16 cores, 125.9 GiB" for the DRAM ends of a smaller host that do not
        end the sweep (:func:`herald.bench.throughput_run.smaller_host_dram_ends`); else ""."""
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


def _hosts(runs: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
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


def peak(recs: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in recs.values() if r["status"] == "ok"]
    return max(ok, key=lambda r: r["decode_tokens_per_s"]) if ok else None


def planned_batches(model: str, ctx: int, variant: str) -> tuple[int, ...]:
    """The plan's batch list of a sweep; empty where the plan has none (a custom model/context)."""
    try:
        return plan.batches_for(model, ctx, variant)
    except ValueError:
        return ()


def pending(recs: dict[int, dict[str, Any]], planned: tuple[int, ...]) -> list[int]:
    """Planned batches not measured yet. A sweep that ended (GPU OOM or DRAM at some batch) has
    none past its end; a planned dense sweep whose GPU OOM end is still more than 8 batches past
    its last fit has the next narrowing batch (:func:`herald.bench.throughput_run.refine_todo`,
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


def _blk(rec: dict[str, Any] | None, key: str) -> Any:
    """A per-block stream stat (``block_main_s`` ...) of a point's timed pass, else of its
    rehearsal pass (:data:`REHEARSAL_NOTE`), else None."""
    if not rec:
        return None
    got = rec.get(key)
    return got if got is not None else (rec.get("rehearsal") or {}).get(key)


def _rh(rec: dict[str, Any] | None) -> str:
    """:data:`REHEARSAL_MARK` when ``rec``'s block stats come from its rehearsal pass."""
    if rec and rec.get("block_main_s") is None and _blk(rec, "block_main_s") is not None:
        return REHEARSAL_MARK
    return ""


def _mean(xs: list[float] | None) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _cap(cap: float | None) -> str:
    return f"{cap:g} GB cap" if cap else "whole GPU"


# -- sections -----------------------------------------------------------------------------------


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
            f"| {m.get('torch')} | {_f((mc.get('pcie') or {}).get('h2d_gbs'), '.1f')} "
            f"| {_f((mc.get('dram') or {}).get('reference_gbs'), '.1f')} | {count[r['run_id']]} |"
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


def table2(d: Data, cap: float | None) -> list[str]:
    models = [m for m in d.models() if m in (LLADA, SDAR)] or d.models()
    head = "| ctx | method |" + "".join(
        f" {plan.model_name(m)}: bs | tok/s (x Dense) | paper bs / tok/s | sweep ended by |"
        for m in models
    )
    lines = [f"### {_cap(cap)}", ""]
    if d.common_host is not None:
        lines += [
            f"Points ran on a host with {d.common_host[0]} cores and {d.common_host[1]} GiB of "
            "DRAM unless a row says otherwise.",
            "",
        ]
    lines += [head, "|" + " --- |" * (2 + 4 * len(models))]
    for ctx in d.contexts():
        for v in plan.TABLE2_VARIANTS:
            var = VARIANTS[v]
            name = var.label + (f" {var.default_budget:.1%}" if var.default_budget else "")
            row = f"| {_ctx(ctx)} | {name} |"
            for m in models:
                recs, note = d.sweep(m, ctx, v, var.default_budget, cap)
                top = peak(recs)
                dense = peak(d.sweep(m, ctx, "dense", None, cap)[0])
                ratio = (
                    f" ({top['decode_tokens_per_s'] / dense['decode_tokens_per_s']:.2f}x)"
                    if top and dense else ""
                )  # fmt: skip
                pb, pt = plan.PAPER_TABLE2.get((m, ctx, v), ("-", "-"))
                row += (
                    f" {top['batch'] if top else '-'} | {_f(top['decode_tokens_per_s'] if top else None)}{ratio}"
                    f" | {pb} / {pt} | {stop_reason(recs, planned_batches(m, ctx, v))}{f' ({note})' if note else ''}{d.machine_note(top)} |"
                )
            lines.append(row)
    return lines


_POOL_END = re.compile(r"CPU pool holds (\d+) pages \(([\d.]+) GiB\), batch (\d+) needs (\d+)")


H100_MIB = 81559
"""An H100 80GB's memory as nvidia-smi reports it (79.6 GiB): more than the 80 GB cap's 80e9
bytes (74.5 GiB)."""
H100_MARGIN_GIB = 2.0
"""What a point's allocated peak must leave of an H100's memory to be taken as fitting: the CUDA
context (~0.5 GiB; outside the cap here, inside the H100's memory) and the allocator's reserve
over what it allocates (LLaDA2.0-mini 16K dense bs 64 allocated at most 73.8 GiB and did not
fit under the 74.5 GiB cap)."""


def h100_room(d: Data) -> list[str]:
    """What the 80 GB cap's 5.1 GiB below a real H100 costs: of the 80 GB sweeps that ended in
    GPU OOM, those with a whole-GPU point that peaked under an H100's memory and beat the
    capped peak (such a point would fit on the H100 too, less its CUDA context, ~0.5 GiB), and
    HERALD / Dense at that context with that point."""
    h100 = H100_MIB / 1024
    room = h100 - H100_MARGIN_GIB
    lines = [
        f"The 80 GB cap is 80e9 bytes ({CAP_H100 * 1e9 / 2**30:.1f} GiB); an H100 80GB holds "
        f"{H100_MIB:,} MiB ({h100:.1f} GiB). Sweeps the cap ended in GPU OOM, against the same "
        f"mode on the whole GPU, where a point whose allocated peak stayed under {room:.1f} GiB "
        f"would likely fit on an H100 too ({H100_MARGIN_GIB:g} GiB left for the CUDA context and "
        "the allocator's reserve over what it allocates):",
        "",
    ]
    rows = 0
    for m in d.models():
        for ctx in d.contexts(m):
            hr = peak(d.sweep(m, ctx, "herald", 0.05, CAP_H100)[0])
            dn = peak(d.sweep(m, ctx, "dense", None, CAP_H100)[0])
            for v in plan.TABLE2_VARIANTS:
                budget = VARIANTS[v].default_budget
                capped = d.sweep(m, ctx, v, budget, CAP_H100)[0]
                if not stop_reason(capped).startswith("GPU OOM"):
                    continue
                whole, note = d.sweep(m, ctx, v, budget, None)
                known = {b: r for b, r in whole.items()
                         if r["status"] == "ok" and r.get("peak_gpu_gib") is not None}  # fmt: skip
                if note.startswith("=") or not known:
                    continue  # no whole-GPU sweep with memory peaks: nothing to say
                top = peak(capped)
                fit = peak({b: r for b, r in known.items() if r["peak_gpu_gib"] <= room})
                nxt = min(
                    (r for r in known.values() if r["peak_gpu_gib"] > room),
                    key=lambda r: r["batch"], default=None,
                )  # fmt: skip
                name = f"- {plan.model_name(m)} {_ctx(ctx)} {VARIANTS[v].label}:"
                rows += 1
                if (
                    top
                    and fit
                    and fit["batch"] > top["batch"]
                    and fit["decode_tokens_per_s"] > top["decode_tokens_per_s"]
                ):
                    lines.append(
                        f"{name} bs {fit['batch']} peaked at {fit['peak_gpu_gib']:.1f} GiB on the "
                        f"whole GPU, {fit['decode_tokens_per_s']:.0f} tok/s, against "
                        f"{top['decode_tokens_per_s']:.0f} (bs {top['batch']}) under the cap"
                    )
                    if v == "dense" and hr and dn:
                        lines.append(
                            f"  - so on an H100, HERALD / Dense at {plan.model_name(m)} {_ctx(ctx)} "
                            f"would be about {hr['decode_tokens_per_s'] / fit['decode_tokens_per_s']:.2f}x, "
                            f"not {hr['decode_tokens_per_s'] / dn['decode_tokens_per_s']:.2f}x"
                        )
                else:
                    more = (
                        f": its next batch on the whole GPU, bs {nxt['batch']}, peaked at "
                        f"{nxt['peak_gpu_gib']:.1f} GiB"
                        if nxt
                        else ""
                    )
                    lines.append(f"{name} no larger, faster batch fits in {room:.1f} GiB{more}")
    return lines if rows else []


def dram_bounds(d: Data) -> list[str]:
    """One line per (model, context) whose offloading sweeps ended on the CPU pool: how many
    requests the pool held (from the DRAM end's message: pool pages // pages per request) and
    on which host. The issue asks for the DRAM-bounded batch to be stated where a bigger host
    was not available."""
    got: dict[tuple[str, int], tuple[int, float, int, Any]] = {}
    for p in d.points:
        m = _POOL_END.search(p.get("error") or "") if p["status"] == "dram" else None
        if not m:
            continue
        pages, gib, batch, need = int(m[1]), float(m[2]), int(m[3]), int(m[4])
        fits = pages // -(-need // batch)
        key = (p["model"], p["context"])
        if key not in got or fits < got[key][2]:
            got[key] = (pages, gib, fits, d.host.get(p.get("run_id", "")))
    if not got:
        return []
    return [
        "Sweeps ended by DRAM: the CPU pool (the DRAM free at a run's start less a reserve) "
        "bounds the batch there, not a throughput ceiling; a larger batch of an offloading mode "
        "needs more DRAM (the two-GPU machine variant has 256 GiB):",
        "",
        *(
            f"- {plan.model_name(m)} {_ctx(c)}: at most **{fits} requests** (pool {gib:.1f} GiB "
            f"= {pages} pages" + (f"; host: {h[0]} cores, {h[1]} GiB)" if h else ")")
            for (m, c), (pages, gib, fits, h) in sorted(got.items())
        ),
    ]


def _bound(c: dict[str, float], keys: tuple[str, ...]) -> str:
    have = {k: c[k] for k in keys if k in c}
    return min(have, key=lambda k: have[k]) if have else "-"


def fig12(d: Data, out: Path, model: str, cap: float | None, plots: list[str]) -> list[str]:
    ctx = max(d.contexts(model))  # 32K in the plan
    lines = [f"### {plan.model_name(model)}, {_ctx(ctx)}, {_cap(cap)}", ""]
    series = {
        v: d.sweep(model, ctx, v, VARIANTS[v].default_budget, cap)[0] for v in plan.TABLE2_VARIANTS
    }
    if not any(series.values()):
        return lines + ["(no points yet)"]
    lines += ["| mode | bs | tok/s | fwd ms | per-step fetch | per-block fetch | per-block fetch, full KV | CPU selection | CPU sel. at DRAM speed (est.) | GPU forward | main s/block | retrieval s/block | stall s/block | lowest ceiling of the mode |",
              "| --- |" + " --- |" * 13]  # fmt: skip
    for v, recs in series.items():
        for bs in sorted(recs):
            r = recs[bs]
            if r["status"] != "ok":
                lines.append(f"| {v} | {bs} | {r['status']} |" + " |" * 11)
                continue
            c = d.ceilings(r)
            keys = RELEVANT.get(v, tuple(c))
            lines.append(
                f"| {v} | {bs} | {r['decode_tokens_per_s']:.0f} | {r['forward_median_s'] * 1e3:.1f} "
                f"| {_f(c.get('per_step_fetch'))} | {_f(c.get('per_block_fetch'))} | {_f(c.get('full_kv_per_block_fetch'))} "
                f"| {_f(c.get('cpu_selection'))} "
                f"| {_f(c.get('cpu_selection_dram'))} | {_f(c.get('gpu_forward'))} "
                f"| {_f(_mean(_blk(r, 'block_main_s')), '.2f')}{_rh(r)} | {_f(_mean(_blk(r, 'block_retrieval_s')), '.2f')} "
                f"| {_f(_mean(_blk(r, 'block_stall_s')), '.2f')} | {CEILING_NAMES.get(_bound(c, keys), '-')} |"
            )
    name = f"fig12_{plan.model_name(model)}_{'cap' + format(cap, 'g') if cap else 'h200'}.png"
    if tplots.plot_fig12(
        d.ceilings, series, out / name, f"{plan.model_name(model)} {_ctx(ctx)}, {_cap(cap)}"
    ):
        plots.append(name)
        lines += ["", f"![Fig. 12 analog]({name})"]
    return lines


def fig13(d: Data, out: Path, plots: list[str]) -> list[str]:
    lines = ["| ctx | configuration (5%, 80 GB cap) | bs | peak tok/s | x previous | x MAGE (GPU sel.) | paper tok/s | sweep ended by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    bars: dict[int, list[tuple[str, float]]] = {}
    for ctx in d.contexts(LLADA):
        base = prev = None
        for v in plan.FIG13_RUNGS:
            recs, _ = d.sweep(LLADA, ctx, v, 0.05, CAP_H100)
            top = peak(recs)
            tps = top["decode_tokens_per_s"] if top else None
            if v == plan.FIG13_RUNGS[0]:  # the ratio column is against MAGE (GPU selection) only
                base = tps
            lines.append(
                f"| {_ctx(ctx)} | {VARIANTS[v].label} | {top['batch'] if top else '-'} | {_f(tps)} "
                f"| {_f(tps / prev if tps and prev else None, '.2f')} | {_f(tps / base if tps and base else None, '.2f')} "
                f"| {plan.PAPER_FIG13.get(ctx, {}).get(v, '-')} | {stop_reason(recs, planned_batches(LLADA, ctx, v))} |"
            )
            prev = tps if tps else prev
            if tps and base:  # bars are speed-ups over MAGE (GPU selection): none without it
                bars.setdefault(ctx, []).append((VARIANTS[v].label, tps / base))
    if tplots.plot_bars(bars, out / "fig13_ablation.png"):
        plots.append("fig13_ablation.png")
        lines += ["", "![Fig. 13 analog](fig13_ablation.png)"]
    return lines


def fig14(d: Data, out: Path, plots: list[str]) -> list[str]:
    # the T = 20 row is the Table II sweeps' point, often from another run than the other T
    # rows: the time column shows it (see Repeatability for how much runs differ)
    lines = ["| ctx | T | Dense bs | Dense tok/s | HERALD bs | HERALD tok/s | HERALD / Dense | main s/block | retrieval s/block | stall s/block | HERALD measured (UTC) |",
             "| --- |" + " --- |" * 10]  # fmt: skip
    data: dict[int, list[tuple[int, float | None, float | None, float | None, float | None]]] = {}
    for ctx in d.contexts(LLADA):
        for t in plan.FIG14_STEPS:
            # a T sweep has one batch: the peak batch of the T = 20 sweep (or the paper's)
            dn = _single(d, ctx, "dense", None, t)
            hr = _single(d, ctx, "herald", 0.05, t)
            if not dn and not hr:
                continue
            dt, ht = (r["decode_tokens_per_s"] if r else None for r in (dn, hr))
            main, retr = _mean(_blk(hr, "block_main_s")), _mean(_blk(hr, "block_retrieval_s"))
            lines.append(
                f"| {_ctx(ctx)} | {t} | {dn['batch'] if dn else '-'} | {_f(dt)} | {hr['batch'] if hr else '-'} "
                f"| {_f(ht)} | {_f(ht / dt if ht and dt else None, '.2f')} | {_f(main, '.2f')}{_rh(hr)} | {_f(retr, '.2f')} "
                f"| {_f(_mean(_blk(hr, 'block_stall_s')), '.2f')} "
                f"| {(hr.get('time_utc') or '-')[:16] if hr else '-'} |"
            )
            data.setdefault(ctx, []).append((t, dt, ht, main, retr))
    if tplots.plot_fig14(data, out / "fig14_steps.png"):
        plots.append("fig14_steps.png")
        lines += ["", "![Fig. 14 analog](fig14_steps.png)"]
    return lines


def _single(d: Data, ctx: int, v: str, budget: float | None, t: int) -> dict[str, Any] | None:
    """The Fig. 14 point at T = t: the T = 20 sweep's peak batch, else any measured batch."""
    recs, _ = d.sweep(LLADA, ctx, v, budget, CAP_H100, t)
    ref = peak(d.sweep(LLADA, ctx, v, budget, CAP_H100, 20)[0])
    if ref and ref["batch"] in recs and recs[ref["batch"]]["status"] == "ok":
        return recs[ref["batch"]]
    return peak(recs)


def _open(recs: dict[int, dict[str, Any]], model: str, ctx: int, variant: str) -> bool:
    """Whether a sweep still has planned batches pending."""
    return bool(pending(recs, planned_batches(model, ctx, variant)))


def targets(d: Data) -> list[str]:
    """The issue's targets. A comparison whose sweeps still have planned batches pending says
    "pending" (its peaks may still rise), not met or missed."""
    lines = ["## Targets (issue 5)", ""]
    dn = d.sweep(LLADA, K32, "dense", None, CAP_H100)[0]
    dt = peak(dn)
    for v in ("herald", "herald-selected"):
        h = d.sweep(LLADA, K32, v, 0.05, CAP_H100)[0]
        ht = peak(h)
        name = (
            "HERALD"
            if v == "herald"
            else "HERALD (`selected` kernel output, our step beyond the paper)"
        )
        if not (ht and dt):
            lines.append(f"- LLaDA2.0-mini 32K, 80 GB cap: {name} / Dense: **not measured yet**")
            continue
        ratio = ht["decode_tokens_per_s"] / dt["decode_tokens_per_s"]
        ok = ratio >= TARGET_RATIO
        open_ = _open(h, LLADA, K32, v) or _open(dn, LLADA, K32, "dense")
        verdict = "pending (sweep incomplete)" if open_ and not ok else ("met" if ok else "missed")
        lines.append(
            f"- LLaDA2.0-mini 32K, 80 GB cap: {name} / Dense = {ht['decode_tokens_per_s']:.0f} / "
            f"{dt['decode_tokens_per_s']:.0f} = **{ratio:.2f}x** (target >= {TARGET_RATIO}x): "
            f"**{verdict}**"
        )
        if not ok:
            lines += diagnose(d, h, dt, v, need=TARGET_RATIO * dt["decode_tokens_per_s"])
    pairs = repeat_pairs(d)
    noise = noise_pct(pairs)
    noise_kind = (
        "two runs' measurements"
        if any(a["run_id"] != b["run_id"] for a, b, _ in pairs)
        else "two measurements in one run (two runs differ more)"
    )
    for cap in (CAP_H100, None):
        for m in d.models():
            for ctx in d.contexts(m):
                hr, hnote = d.sweep(m, ctx, "herald", 0.05, cap)
                top = peak(hr)
                if not top:  # a comparison must not vanish because HERALD has no number
                    lines += _no_herald(d, hr, m, ctx, cap)
                    continue
                hnote = f" ({hnote})" if hnote else ""
                for v in ("mage", "infinigen"):
                    orecs = d.sweep(m, ctx, v, VARIANTS[v].default_budget, cap)[0]
                    other = peak(orecs)
                    head = (
                        f"- {plan.model_name(m)} {_ctx(ctx)}, {_cap(cap)}: HERALD "
                        f"{top['decode_tokens_per_s']:.0f}{hnote} vs {v}"
                    )
                    if other is None:
                        if orecs:  # measured, and not one batch fit: HERALD ran, it did not
                            lines.append(f"{head}: no batch fits ({stop_reason(orecs)}): **met**")
                        else:  # no points (none yet, or superseded): decide nothing
                            lines.append(f"{head}: **not measured**")
                        continue
                    ok = top["decode_tokens_per_s"] > other["decode_tokens_per_s"]
                    open_ = _open(hr, m, ctx, "herald") or _open(orecs, m, ctx, v)
                    verdict = "pending (sweep incomplete)" if open_ else ("met" if ok else "missed")
                    margin = 100 * (top["decode_tokens_per_s"] / other["decode_tokens_per_s"] - 1)
                    close = (
                        f" (by {margin:.1f}%, less than the {noise:.1f}% median difference "
                        f"between {noise_kind} of one configuration: see Repeatability)"
                        if ok and noise is not None and margin < noise
                        else ""
                    )
                    lines.append(
                        f"{head} {other['decode_tokens_per_s']:.0f} tok/s: **{verdict}**{close}"
                        + _list_end_note(d, orecs, m, ctx, v)
                    )
                    if not ok and not open_:
                        lines += diagnose(d, hr, other)
    return lines


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


def _no_herald(
    d: Data, hr: dict[int, dict[str, Any]], model: str, ctx: int, cap: float | None
) -> list[str]:
    """Target lines where HERALD has no fitting batch (``hr`` holds only failures) or no point
    at all, one per baseline that was measured."""
    out = []
    for v in ("mage", "infinigen"):
        orecs = d.sweep(model, ctx, v, VARIANTS[v].default_budget, cap)[0]
        if not orecs and not hr:
            continue  # nothing on either side: no line
        other = peak(orecs)
        head = f"- {plan.model_name(model)} {_ctx(ctx)}, {_cap(cap)}: HERALD"
        mine = f"no batch fits ({stop_reason(hr)})" if hr else "not measured"
        theirs = (
            f"{other['decode_tokens_per_s']:.0f} tok/s"
            if other
            else f"no batch fits ({stop_reason(orecs)})"
            if orecs
            else "not measured"
        )
        verdict = "**missed**" if hr and other else "**not decided**"
        out.append(f"{head} {mine} vs {v} {theirs}: {verdict}")
    return out


def _list_end_note(
    d: Data, recs: dict[int, dict[str, Any]], model: str, ctx: int, variant: str
) -> str:
    """For a baseline whose sweep ended at the end of its batch list (no batch failed, so a
    larger one might be faster): its lowest ceiling at its largest batch, which bounds what a
    larger batch could reach while that ceiling does not grow with the batch."""
    if not stop_reason(recs, planned_batches(model, ctx, variant)).startswith("end of list"):
        return ""
    last = recs[max(recs)]
    c = d.ceilings(last)
    key = _bound(c, RELEVANT.get(variant, tuple(c)))
    if key == "-":
        return ""
    return (
        f" (its sweep ended at the end of its list, at bs {last['batch']} with "
        f"{last['decode_tokens_per_s']:.0f} tok/s; its lowest ceiling there: "
        f"{CEILING_NAMES[key]} {c[key]:.0f} tok/s)"
    )


def _retrieval_parts(rec: dict[str, Any]) -> str:
    """ " (CPU kernel a s, gather + copies b s, query to host c s)" from a point's retrieval
    parts (the mean over its timed blocks), or "" for points recorded without them."""
    parts = _blk(rec, "block_retrieval_parts_s")
    if not parts:
        return ""
    names = {
        "kernel": "CPU kernel",
        "gather_copy": "gather + copies",
        "query_to_host": "query to host",
    }
    mean = {k: sum(p.get(k, 0.0) for p in parts) / len(parts) for k in names}
    return " (" + ", ".join(f"{names[k]} {mean[k]:.2f} s" for k in names) + ")"


def diagnose(
    d: Data,
    herald: dict[int, dict[str, Any]],
    other: dict[str, Any],
    variant: str = "herald",
    need: float | None = None,
) -> list[str]:
    """The limiting ceiling of HERALD's peak point, its number and what would lift it; with
    ``need`` (tokens/s the target asks for), which of HERALD's ceilings at that batch lie below
    it, so that lifting only the limiting one would not be enough."""
    top = peak(herald)
    if top is None:
        return ["  - HERALD has no measured point"]
    c = d.ceilings(top)
    out = [
        f"  - HERALD's peak: bs {top['batch']}, {top['decode_tokens_per_s']:.0f} tok/s; the other side: bs {other['batch']}, {other['decode_tokens_per_s']:.0f} tok/s"
    ]
    bigger = [r for b, r in sorted(herald.items()) if b > top["batch"]]
    dram_bound = bool(bigger) and bigger[0]["status"] == "dram"
    if dram_bound:
        out.append(
            f"  - batch bound: bs {bigger[0]['batch']} did not fit in DRAM ({bigger[0].get('error', '')[:120]}); "
            f"lift: {LIFT['dram']}"
        )
    main, retr = _mean(_blk(top, "block_main_s")), _mean(_blk(top, "block_retrieval_s"))
    stall = _mean(_blk(top, "block_stall_s"))
    if main is not None and retr is not None:
        whose = f" (the rehearsal pass's blocks {_rh(top)})" if _rh(top) else ""
        stream = "retrieval (CPU selection)" if retr > main else "main (GPU forwards)"
        overlap = ""
        if stall is not None:  # a block's wall time is the main stream plus its stall
            wall = main + stall
            overlap = (
                f"; block wall = main + stall = {wall:.2f} s against the longer stream's "
                f"{max(main, retr):.2f} s ({100 * (wall / max(main, retr) - 1):+.0f}%: the streams "
                "overlap imperfectly)"
            )
        out.append(
            f"  - per block{whose}: main stream {main:.2f} s, retrieval stream {retr:.2f} s, stall {_f(stall, '.2f')} s: the {stream} stream is the longer"
            + _retrieval_parts(top)
            + overlap
        )
    keys = RELEVANT["herald"]
    key = _bound(c, keys)
    if key != "-":
        detail = ", ".join(f"{CEILING_NAMES[k]} {c[k]:.0f}" for k in keys if k in c)
        out.append(
            f"  - limiting ceiling: **{CEILING_NAMES[key]} = {c[key]:.0f} tok/s** at bs {top['batch']} (HERALD's ceilings there: {detail} tok/s); lift: {LIFT_SELECTED if key == 'cpu_selection' and variant == 'herald-selected' else LIFT[key]}"
        )
        spread = _ceiling_spread(d, top, key)
        if spread:
            out.append(spread)
        if need is not None:
            below = [k for k in keys if k in c and c[k] < need]
            if below:
                names = ", ".join(f"{CEILING_NAMES[k]} {c[k]:.0f}" for k in below)
                out.append(
                    f"  - the target needs {need:.0f} tok/s; "
                    + (
                        f"below it at bs {top['batch']}: {names}: lifting the limiting ceiling "
                        "alone is not enough"
                        if len(below) > 1
                        else f"the only ceiling below it at bs {top['batch']} is the limiting "
                        f"one, {names}"
                    )
                    + (
                        "; the next batch did not fit in DRAM, so a larger batch needs more DRAM too"
                        if dram_bound
                        else ""
                    )
                )
    return out


def _ceiling_spread(d: Data, top: dict[str, Any], key: str) -> str:
    """For a measured ceiling that other points of the same configuration and batch measured
    too (the CPU selection kernel's time does not depend on T, so the Fig. 14 points at that
    batch time it again): the range over them, a line; "" when there is no other."""
    if key != "cpu_selection":
        return ""
    same = (top["model"], top["context"], top["variant"], top.get("budget"), top.get("gpu_cap_gb"))
    got = [
        (p["steps"], d.ceilings(p).get(key))
        for p in d.points
        if p["status"] == "ok"
        and p["batch"] == top["batch"]
        and (p["model"], p["context"], p["variant"], p.get("budget"), p.get("gpu_cap_gb")) == same
    ]
    vals: list[tuple[int, float]] = [(t, v) for t, v in got if v is not None]
    if len(vals) < 2:
        return ""
    lo, hi = min(v for _, v in vals), max(v for _, v in vals)
    return (
        f"  - that ceiling is one timing of the kernel: {len(vals)} points of this configuration "
        f"at bs {top['batch']} (T = {', '.join(str(t) for t, _ in sorted(vals))}) timed it at "
        f"{lo:.0f}-{hi:.0f} tok/s ({100 * (hi / lo - 1):.0f}% apart)"
    )


def repeat_pairs(d: Data) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    """Points measured twice with the same configuration, the 80 GB cap and the whole GPU,
    where the capped point's peak GPU memory stayed under the cap (so the cap did not change
    it): (capped, whole GPU, difference in %), by configuration."""
    by_key: dict[tuple[Any, ...], dict[Any, dict[str, Any]]] = defaultdict(dict)
    for p in d.points:
        if p["status"] == "ok":
            key = (p["model"], p["context"], p["variant"], p.get("budget"), p["steps"], p["batch"])
            by_key[key][p.get("gpu_cap_gb")] = p
    out = []
    # budget may be None, so the configuration sorts by its text, then by batch as a number
    for _, caps in sorted(by_key.items(), key=lambda kv: (str(kv[0][:5]), kv[0][5])):
        a, b = caps.get(CAP_H100), caps.get(None)
        if a is None or b is None or a.get("peak_gpu_gib") is None:
            continue
        if a["peak_gpu_gib"] * 2**30 >= CAP_H100 * 1e9:  # the cap may have bound: not a repeat
            continue
        out.append((a, b, 100 * (b["decode_tokens_per_s"] / a["decode_tokens_per_s"] - 1)))
    return out


def noise_pct(pairs: list[tuple[dict[str, Any], dict[str, Any], float]]) -> float | None:
    """The median absolute difference (%) between two measurements of one configuration made in
    different runs (the methods of a table were measured in different runs), or over every
    pair when no pair spans two runs; None without pairs (``pairs``: :func:`repeat_pairs`)."""
    cross = [abs(x) for a, b, x in pairs if a["run_id"] != b["run_id"]]
    diffs = cross or [abs(x) for _, _, x in pairs]
    return statistics.median(diffs) if diffs else None


def repeats(d: Data) -> list[str]:
    """How much one measurement varies (:func:`repeat_pairs`). Each point times one or two
    blocks, and every peak in the tables above is one such measurement."""
    rows: list[str] = []
    diffs: list[float] = []
    cross: list[float] = []
    one: list[float] = []
    for a, b, diff in repeat_pairs(d):
        diffs.append(abs(diff))
        (cross if a["run_id"] != b["run_id"] else one).append(abs(diff))
        runs = a["run_id"] if a["run_id"] == b["run_id"] else f"{a['run_id']}, {b['run_id']}"
        rows.append(
            f"| {plan.model_name(a['model'])} | {_ctx(a['context'])} | {a['variant']} "
            f"| {a['steps']} | {a['batch']} | {a['decode_tokens_per_s']:.0f} "
            f"| {b['decode_tokens_per_s']:.0f} | {diff:+.1f}% | {runs} |"
        )
    if not rows:
        return []
    split = (
        f" {len(cross)} pairs come from two runs, hours apart: {statistics.median(cross):.1f}% "
        f"(median), up to {max(cross):.1f}%"
        + (
            f"; {len(one)} from one run, minutes apart: {statistics.median(one):.1f}% (median)."
            if one
            else "."
        )
        + " The modes of a table were measured in different runs, so compare them by more than "
        "the two-run figure (the Targets do)."
        if cross
        else " Each pair comes from one run, so this is a lower bound for two runs' noise."
    )
    return [
        "## Repeatability",
        "",
        f"{len(rows)} configurations were measured twice (once under the 80 GB cap, once on the "
        "whole GPU, with the capped point's peak memory under the cap, so the cap did not bind): "
        f"the two differ by {statistics.median(diffs):.1f}% (median) and up to {max(diffs):.1f}%. "
        "Every peak in this report is one such measurement." + split,
        "",
        "| model | ctx | mode | T | bs | 80 GB cap tok/s | whole GPU tok/s | difference | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def remeasured(d: Data, files: list[Path]) -> list[str]:
    """Points measured again: configurations of ``superseded/remeasured*.jsonl`` (points moved
    out only so that a later run measures them again, not because a fix changed them) that the
    current points measure too, same sweep (model, context, mode, budget, cap, T) and batch.
    Their difference is the noise between runs hours apart plus whatever the code changed in
    between, so it is given per mode (a mode whose code changed shifts as a whole). Old points
    that ran but whose configuration now failed (out of memory, DRAM) are listed too."""
    from herald.bench.throughput_run import load_records_file

    def key(p: dict[str, Any]) -> tuple[Any, ...]:
        return (*plan.record_sweep_key(p), p["batch"])

    def rate(p: dict[str, Any]) -> float:
        x = p.get("decode_tokens_per_s")
        return float(x) if isinstance(x, (int, float)) else 0.0

    cuda = any(p.get("device") == "cuda" for p in d.points)
    old: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in files:
        for p in load_records_file(path):
            if p.get("kind") != "point" or p.get("status") != "ok" or rate(p) <= 0:
                continue
            if cuda and p.get("device") != "cuda":  # as Data keeps only the GPU points
                continue
            old[key(p)] = p  # later records win, as in the tables
    now = {key(p): p for p in d.points}
    both = [(old[k], p) for k, p in now.items() if k in old and p["status"] == "ok" and rate(p) > 0]
    failed = [(old[k], p) for k, p in now.items() if k in old and p["status"] != "ok"]
    if not both and not failed:
        return []

    def host(p: dict[str, Any]) -> Any:
        return d.host.get(p.get("run_id", ""))

    # a pair from two hosts (cores, DRAM) measures the host too, not run-to-run noise
    pairs = [(a, b) for a, b in both if host(a) == host(b)]
    moved = [(a, b) for a, b in both if host(a) != host(b)]
    lines = ["### Measured again", ""]
    names = ", ".join(f"`superseded/{f.name}`" for f in files)
    if moved:
        by_hosts: dict[tuple[Any, Any, str], list[float]] = defaultdict(list)
        for a, b in moved:
            by_hosts[(host(a), host(b), _mode(b))].append(100 * (rate(b) / rate(a) - 1))

        def name(h: Any) -> str:
            return f"{h[0]} cores, {h[1]} GiB" if h else "host unknown"

        lines += [
            f"{len(moved)} configurations of {names} were measured again on another host "
            "(cores, DRAM: the CPU selection kernel's threads and bandwidth differ), so their "
            "difference is the host's as much as the run's; they are left out of the noise "
            "figures below:",
            "",
            "| before on | again on | mode | configurations | median signed difference | range |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {name(h0)} | {name(h1)} | {m} | {len(xs)} | {statistics.median(xs):+.1f}% "
                f"| {min(xs):+.1f}% to {max(xs):+.1f}% |"
                for (h0, h1, m), xs in sorted(by_hosts.items(), key=str)
            ),
            "",
        ]
    if pairs:
        diffs = [100 * (rate(b) / rate(a) - 1) for a, b in pairs]
        absd = [abs(x) for x in diffs]
        by_mode: dict[str, list[float]] = defaultdict(list)
        for (_, b), x in zip(pairs, diffs, strict=True):
            by_mode[_mode(b)].append(x)
        lines += [
            f"{len(pairs)} configurations of {names} were measured again by the runs above on "
            f"the same host (hours later, at a later code version): the two differ by {statistics.median(absd):.1f}% "
            f"(median of the absolute differences), {sum(x >= 10 for x in absd)} by 10% or more "
            f"and up to {max(absd):.1f}%. A mode whose code changed in between shifts as a whole "
            "(its signed median), the rest is run-to-run noise:",
            "",
            "| mode | configurations | median signed difference | median absolute | largest |",
            "| --- | --- | --- | --- | --- |",
            *(
                f"| {v} | {len(xs)} | {statistics.median(xs):+.1f}% "
                f"| {statistics.median(abs(x) for x in xs):.1f}% | {max(xs, key=abs):+.1f}% |"
                for v, xs in sorted(by_mode.items())
            ),
            "",
        ]
        rows = [
            f"{_config_cells(b)} {rate(a):.0f} | {rate(b):.0f} | {x:+.1f}% |"
            for (a, b), x in sorted(zip(pairs, diffs, strict=True), key=lambda t: -abs(t[1]))
            if abs(x) >= 20
        ]  # same host only
        if rows:
            lines += [
                "Configurations that differ by 20% or more:",
                "",
                "| model | ctx | mode | cap GB | T | bs | before tok/s | again tok/s | difference |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *rows,
                "",
            ]
    if failed:
        dram = any(b["status"] == "dram" for _, b in failed)

        def hosts(a: dict[str, Any], b: dict[str, Any]) -> str:
            h0, h1 = host(a), host(b)
            return "same" if h0 == h1 else f"{h0[1]} -> {h1[1]} GiB" if h0 and h1 else "?"

        lines += [
            f"{len(failed)} configuration(s) that ran before did not fit when measured again"
            + (
                " (DRAM: a run's CPU pool takes the DRAM free at its start less a reserve, so a "
                "host with less DRAM, or a run that found less of it free, holds fewer requests):"
                if dram
                else ":"
            ),
            "",
            "| model | ctx | mode | cap GB | T | bs | before tok/s | again | host DRAM |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *(
                f"{_config_cells(b)} {rate(a):.0f} | {b['status']} | {hosts(a, b)} |"
                for a, b in failed
            ),
            "",
        ]
    return lines


def _config_cells(p: dict[str, Any]) -> str:
    """A point's "| model | ctx | mode | cap GB | T | bs |" cells."""
    return (
        f"| {plan.model_name(p['model'])} | {_ctx(p['context'])} | {_mode(p)} "
        f"| {p['gpu_cap_gb'] or 'whole GPU'} | {p['steps']} | {p['batch']} |"
    )


def _mode(p: dict[str, Any]) -> str:
    """``variant budget%`` (``dense`` has no budget)."""
    return f"{p['variant']} {100 * p['budget']:g}%" if p.get("budget") else p["variant"]


def all_points(d: Data) -> list[str]:
    lines = ["<details><summary>Every measured point</summary>", "",
             "| model | ctx | variant | budget | cap | T | bs | status | tok/s | fwd ms | step0 ms | step1 ms | commit ms | main s | retrieval s | stall s | selection s/block | peak GiB | wall s |",
             "| --- |" + " --- |" * 18]  # fmt: skip
    for p in sorted(
        d.points,
        key=lambda p: (
            p["model"],
            p["context"],
            p["variant"],
            p["gpu_cap_gb"] or 1e9,
            p["steps"],
            p["batch"],
        ),
    ):
        ms = _ms_of(p)
        sel = (p.get("selection_kernel") or {}).get("block_s")
        lines.append(
            f"| {p['model_name']} | {p['context']} | {p['variant']} | {_f(p['budget'], '.3f') if p['budget'] else '-'} "
            f"| {p['gpu_cap_gb'] or '-'} | {p['steps']} | {p['batch']} | {p['status']} "
            f"| {_f(p.get('decode_tokens_per_s'))} | {ms('forward_median_s')} | {ms('step0_median_s')} | {ms('step1_median_s')} "
            f"| {ms('commit_median_s')} | {_f(_mean(_blk(p, 'block_main_s')), '.2f')}{_rh(p)} | {_f(_mean(_blk(p, 'block_retrieval_s')), '.2f')} "
            f"| {_f(_mean(_blk(p, 'block_stall_s')), '.2f')} | {_f(sel, '.2f')} | {_f(p.get('peak_gpu_gib'), '.1f')} | {_f(p.get('wall_seconds'))} |"
        )
    return lines + ["", "</details>"]


def _ms_of(p: dict[str, Any]) -> Any:
    def ms(key: str) -> str:
        x = p.get(key) if p["status"] == "ok" else None
        return _f(x * 1e3 if x else None, ".1f")

    return ms


def sweeps_summary(d: Data) -> list[str]:
    lines = ["## Every sweep", "",
             "| model | ctx | variant | budget | cap | T | batches | peak bs | peak tok/s | sweep ended by |",
             "| --- |" + " --- |" * 9]  # fmt: skip
    for key in sorted(d.sweeps, key=lambda k: (k[0], k[1], k[2], k[4] or 1e9, k[5], k[3] or 0)):
        recs = d.sweeps[key]
        model, ctx, v, budget, cap, t = key
        top = peak(recs)
        lines.append(
            f"| {plan.model_name(model)} | {ctx} | {v} | {_f(budget, '.3f') if budget else '-'} | {cap or '-'} | {t} "
            f"| {', '.join(str(b) for b in sorted(recs))} | {top['batch'] if top else '-'} "
            f"| {_f(top['decode_tokens_per_s'] if top else None)} "
            f"| {stop_reason(recs, planned_batches(model, ctx, v) if t == 20 else ())} |"
        )
    return lines


def write_report(out: Path) -> Path:
    """README.md (+ fig12_*.png, fig13_ablation.png, fig14_steps.png) in ``out`` from its JSONL.

    Raises ValueError if ``out`` is not a folder or its ``*.jsonl`` hold no measured point."""
    from herald.bench.throughput_run import load_records

    if not out.is_dir():
        raise ValueError(f"{out}: no such results folder")
    d = Data(load_records(out))
    if not d.points:
        raise ValueError(f"{out}: no measured point in its *.jsonl (nothing to report)")
    plots: list[str] = []
    lines = [
        "# Decode throughput vs batch, with measured ceilings (issue 5)",
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
    if any(_rh(p) for p in d.points):
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
    lines += repeats(d) + [""]
    lines += remeasured(d, sorted((out / "superseded").glob("remeasured*.jsonl")))
    lines += [METHOD, ""] + provenance(d) + [""] + all_points(d)
    if tplots.pyplot() is None and d.points:
        lines += ["", "(no plots: matplotlib is not installed here; rerun `--report` where it is)"]
    else:  # a plot this report no longer draws (its data superseded) must not linger beside it
        for old in [*out.glob("fig12_*.png"), out / "fig13_ablation.png", out / "fig14_steps.png"]:
            if old.is_file() and old.name not in plots:
                old.unlink()
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
