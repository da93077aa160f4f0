"""The throughput benchmark's runner: resumable sweeps over JSONL records.

:class:`Runner` walks the selected sweeps in plan order and measures each pending point
(:func:`herald.bench.throughput_point.measure_point`), appending one JSON line per point to
``OUT/throughput.jsonl`` the moment it is measured, after a ``run`` line (command, machine) and a
``machine`` line (PCIe and DRAM bandwidth probes). A point already recorded with the same
settings (:func:`~herald.bench.throughput_records.run_setting`: every flag that changes what a
point measures) is skipped, so a run cut short (time limit, a killed command) resumes where it
stopped, and parts of a plan run in separate commands, or on separate machines, merge by putting
their JSONL files into one folder. A folder holds one set of settings: a run whose settings
differ from its points' is refused (:meth:`Runner.conflicts`), so its report never mixes them.
The model and the CPU pool are built once per model and reused by every point; the GPU-memory
cap is switched between sweeps. With ``--mixed-contexts`` each point is measured twice, one
after the other: uniform (every request at the context), then its sweep's mixed twin (each
request at its own context), recorded with ``"contexts": "mixed"``, ``mean_context`` and
``min_context``. The records themselves: :mod:`herald.bench.throughput_records`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from herald.bench import throughput_plan as plan
from herald.bench.throughput_plan import VARIANTS, Sweep
from herald.bench.throughput_records import (
    JSONL_NAME,
    POINT_SETTINGS,
    SETTING_FLAGS,
    append_record,
    is_offload_record,
    load_records,
    log,
    peak,
    point_records,
    record_setting,
    refine_todo,
    run_setting,
    run_settings,
    setting_differs,
    show_setting,
    sweep_status,
)

_GIB = 1 << 30


def probes_line(rec: dict[str, Any]) -> str:
    """The machine record's bandwidths in one line; PCIe n/a where there is no CUDA GPU (its
    probe measured nothing)."""
    pcie = rec.get("pcie")
    link = (
        f"PCIe H2D {pcie['h2d_gbs']:.1f} GB/s, D2H {pcie['d2h_gbs']:.1f} GB/s"
        if pcie
        else "PCIe n/a (no CUDA GPU)"
    )
    return f"{link}; DRAM read {rec['dram']['reference_gbs']:.1f} GB/s"


class Runner:
    """Runs the selected sweeps' pending points in order, appending each record at once."""

    def __init__(self, args: argparse.Namespace, sweeps: list[Sweep], context: list[Sweep]):
        self.args, self.sweeps, self.context = args, sweeps, context
        self.out: Path = args.out
        self.jsonl = self.out / JSONL_NAME
        self.records = load_records(self.out) if self.out.exists() else []
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.run_id = f"{_dt.datetime.now(_dt.UTC):%Y%m%dT%H%M%SZ}-{os.getpid()}"
        self.t_start = time.perf_counter()
        self.model_name: str | None = None
        self.model: Any = None
        self.config: Any = None
        self.pool: Any = None
        self.cap: float | None | str = "unset"
        self.last_wall: dict[tuple[Any, ...], tuple[int, float]] = {}
        self.measured: list[dict[str, Any]] = []
        from herald.bench.common import machine_info

        self.here_gib: float | None = machine_info().get("mem_total_gib")

    def setting(self, sweep: Sweep) -> dict[str, Any]:
        """The settings a recorded point of ``sweep`` must share to count as done."""
        return run_setting(self.args, VARIANTS[sweep.variant].offload)

    def conflicts(self) -> list[str]:
        """The settings in which the folder's points differ from this run's, device aside
        (:func:`herald.bench.throughput.run` guards it apart), one text per flag, e.g.
        ``"--block-size 32 (this run: 16)"``; [] when every point matches."""
        runs = run_settings(self.records)
        seen: dict[str, tuple[set[str], str]] = {}
        for r in self.records:
            if r.get("kind") != "point":
                continue
            offload = is_offload_record(r)
            want = run_setting(self.args, offload)
            have = record_setting(r, runs)
            for k in setting_differs(have, want):
                if k == "device":
                    continue
                flag = "--dense-kv-pad" if k == "kv_pad" and not offload else SETTING_FLAGS[k]
                seen.setdefault(flag, (set(), show_setting(k, want[k])))[0].add(
                    show_setting(k, have[k])
                )
        return [
            f"{flag} {'/'.join(sorted(vals))} (this run: {mine})"
            for flag, (vals, mine) in seen.items()
        ]

    def twins(self, sweep: Sweep) -> list[Sweep]:
        """``sweep``, and with ``--mixed-contexts`` its mixed twin
        (:mod:`herald.bench.throughput_plan`)."""
        if not getattr(self.args, "mixed_contexts", False):
            return [sweep]
        return [sweep, replace(sweep, contexts=plan.MIXED)]

    def plan_sweep(self, sweep: Sweep) -> tuple[str, list[int]]:
        """("run", batches to measure) | ("defer", []) | ("reuse", []) | ("done", []). A peak sweep
        (no batches) of mixed contexts measures its uniform twin's batch: the uniform reference
        sweep's peak."""
        if sweep.reuse_cap_gb is not None:
            ref = self.planned(sweep.reference(cap=sweep.reuse_cap_gb))
            ref_recs = point_records(self.records, ref, self.setting(ref), self.here_gib)
            if sweep_status(ref_recs, ref.batches)[0]:
                return ("defer", [])
            if not any(r["status"] == "oom" for r in ref_recs.values()):
                return ("reuse", [])
        batches = sweep.batches
        if not batches:
            uniform = replace(sweep, contexts=plan.UNIFORM)
            ref = self.planned(uniform.reference(steps=sweep.peak_steps))
            ref_recs = point_records(self.records, ref, self.setting(ref), self.here_gib)
            if ref.batches and sweep_status(ref_recs, ref.batches)[0]:
                return ("defer", [])
            top = peak(ref_recs)
            batches = (top["batch"] if top else sweep.peak_default or 1,)
        recs = point_records(self.records, sweep, self.setting(sweep), self.here_gib)
        todo, ended = sweep_status(recs, batches, self.args.retry_errors)
        if not todo and ended:
            todo = refine_todo(recs, sweep.variant, bool(sweep.batches))
        return ("run", todo) if todo else ("done", [])

    def planned(self, ref: Sweep) -> Sweep:
        """The plan's own sweep with ``ref``'s key (its batch list; a mixed ``ref``: its uniform
        twin's, as mixed), else ``ref``."""
        key = replace(ref, contexts=plan.UNIFORM).key
        found = next((s for s in self.context if s.key == key), None)
        return ref if found is None else replace(found, contexts=ref.contexts)

    def time_left(self) -> float:
        if self.args.time_limit_s is None:
            return float("inf")
        return self.args.time_limit_s - (time.perf_counter() - self.t_start)

    def estimate(self, sweep: Sweep, batch: int) -> float:
        est = self.args.first_point_estimate_s
        key = replace(sweep, contexts=plan.UNIFORM).key  # twins take about as long
        if key in self.last_wall:
            bs, wall = self.last_wall[key]
            est = wall * max(1.0, batch / bs)
        if self.model_name != sweep.model:
            est += 30.0  # model build
        return est

    def ensure_model(self, sweep: Sweep) -> None:
        from herald.models.loader import load_model

        if self.model_name == sweep.model:
            return
        self.free_model()
        t0 = time.perf_counter()
        self.model, self.config, _ = load_model(
            sweep.model,
            device=self.device,
            dtype=torch.bfloat16,
            random_init_seed=0,
            block_size=self.args.block_size,
        )
        self.model_name = sweep.model
        log(f"built {sweep.model} (random bf16 weights) in {time.perf_counter() - t0:.1f} s")

    def free_model(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.model = self.config = self.pool = self.model_name = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def ensure_pool(self, pending: list[tuple[Sweep, list[int]]]) -> None:
        """One CPU pool per model, sized for this run's largest offloading point of the model,
        at most DRAM available minus ``--dram-reserve-gb`` (or ``--cpu-kv-gb``)."""
        from herald.bench.throughput_point import mem_available_gib, new_cpu_pool
        from herald.bench.throughput_point import pages_per_request as ppr

        if self.pool is not None:
            return
        cfg = self.config
        new = (self.args.warmup_blocks + self.args.timed_blocks + 1) * cfg.block_size
        need = max(
            (max(bs or s.batches or (s.peak_default or 1,)) * ppr(s.context, new, cfg.block_size)
             for s, bs in pending if s.model == self.model_name and VARIANTS[s.variant].offload),
            default=1,
        )  # fmt: skip
        per_page = pool_page_bytes(cfg)
        if self.args.cpu_kv_gb is not None:
            pages = int(self.args.cpu_kv_gb * _GIB) // per_page
        else:
            avail = mem_available_gib()
            room = need if avail is None else int((avail - self.args.dram_reserve_gb) * _GIB)
            pages = max(1, min(need, room // per_page))
        t0 = time.perf_counter()
        self.pool = new_cpu_pool(cfg, 2, pages)
        log(f"{self.pool.describe()}; random fill + pin in {time.perf_counter() - t0:.1f} s")

    def apply_cap(self, cap: float | None) -> None:
        from herald.bench.common import cap_gpu_memory

        if not self.cuda or cap == self.cap:
            return
        torch.cuda.empty_cache()
        if cap is None:
            torch.cuda.set_per_process_memory_fraction(1.0)
        else:
            cap_gpu_memory(cap)
        self.cap = cap

    def header(self) -> None:
        from herald.bench import ceilings
        from herald.bench.common import code_version, command_line, machine_info
        from herald.bench.throughput_point import mem_available_gib
        from herald.offload.selection.cpu import kernel_info

        run = {
            "kind": "run", "run_id": self.run_id, "command": command_line(),
            "plan": self.args.plan, "part": self.args.part, "machine": machine_info(),
            "code": code_version(),
            "kernel": kernel_info(), "mem_available_gib": mem_available_gib(),
            "settings": {k: getattr(self.args, k) for k in (
                "warmup_blocks", "timed_blocks", "slow_block_s", "offload_cuda_graph", "kv_pad",
                "dense_kv_pad", "real_prefill", "cpu_kv_gb", "dram_reserve_gb", "time_limit_s")},
        }  # fmt: skip
        append_record(self.jsonl, run)
        self.records.append(run)
        rec: dict[str, Any] = {"kind": "machine", "run_id": self.run_id}
        rec["pcie"] = ceilings.pcie_bandwidth(int(self.args.pcie_probe_mib) << 20)
        rec["dram"] = ceilings.dram_bandwidth(self.args.dram_probe_gib)
        append_record(self.jsonl, rec)
        self.records.append(rec)
        log(probes_line(rec))

    def run(self) -> int:
        pending: list[tuple[Sweep, list[int]]] = []
        for s in (t for u in self.sweeps for t in self.twins(u)):
            state, todo = self.plan_sweep(s)
            if state == "run":
                pending.append((s, todo))
            elif state == "defer":
                log(f"{s.label}: deferred (its reference sweep is not complete yet)")
                pending.append((s, []))
            elif state == "reuse":
                log(f"{s.label}: = the {s.reuse_cap_gb:g} GB sweep (no GPU out-of-memory there)")
        n_points = sum(len(b) for _, b in pending)
        log(f"{len(self.sweeps)} sweeps selected, {n_points} points pending")
        if self.args.dry_run:
            for s, todo in pending:
                print(f"  {s.label}: batches {todo or 'deferred'}")
            return 0
        if not pending:
            return 0
        self.header()
        starts: dict[Sweep, int] = {}  # uniform sweep -> its first pending entry (its twins')
        for i, (s, _) in enumerate(pending):
            starts.setdefault(replace(s, contexts=plan.UNIFORM), i)
        for sweep, i in starts.items():
            if not self.run_twins(self.twins(sweep), pending[i:]):
                break
        return self.finish()

    def run_twins(self, twins: list[Sweep], pending: list[tuple[Sweep, list[int]]]) -> bool:
        """Measure the pending points of a sweep and its mixed twin, batch by batch, the uniform
        point first; False when the time limit stopped it."""
        tried: set[tuple[str, int]] = set()
        while True:  # planned again after each point: earlier sweeps may resolve a peak,
            # an OOM ends the list, and a dense sweep's OOM end is narrowed (refine_batch)
            todo = []
            for n, t in enumerate(twins):
                state, batches = self.plan_sweep(t)
                if state == "run":
                    todo += [(b, n, t) for b in batches if (t.contexts, b) not in tried]
            if not todo:
                return True
            bs, _, sweep = min(todo, key=lambda x: x[:2])
            if self.estimate(sweep, bs) > self.time_left():
                log(f"time limit: stopping before {sweep.label} batch {bs}")
                return False
            tried.add((sweep.contexts, bs))
            self.run_point(sweep, bs, pending)

    def finish(self) -> int:
        """The exit code: 1 when a point of this call failed with an error (not a capacity
        failure: those are results), else 0."""
        left = sum(len(self.plan_sweep(t)[1]) for s in self.sweeps for t in self.twins(s))
        log(f"measured {len(self.measured)} points; {left} pending in this selection"
            + (" (rerun the same command to resume)" if left else ""))  # fmt: skip
        errors = [r for r in self.measured if r["status"] == "error"]
        if errors:
            first = errors[0].get("error")
            log(f"{len(errors)} point(s) failed with an error, e.g. {first}; after a fix, "
                "rerun with --retry-errors (--debug for a traceback)")  # fmt: skip
            return 1
        return 0

    def run_point(self, sweep: Sweep, batch: int, pending: list[tuple[Sweep, list[int]]]) -> str:
        from herald.bench import throughput_point as tp

        t0 = time.perf_counter()
        self.ensure_model(sweep)
        self.apply_cap(sweep.gpu_cap_gb)
        var = VARIANTS[sweep.variant]
        if var.offload:
            self.ensure_pool(pending)
        ps = tp.PointSettings(
            self.model, self.config, self.device,
            warmup_blocks=self.args.warmup_blocks, timed_blocks=self.args.timed_blocks,
            slow_block_s=self.args.slow_block_s, offload_cuda_graph=self.args.offload_cuda_graph,
            kv_pad=self.args.kv_pad, dense_kv_pad=self.args.dense_kv_pad,
            real_prefill=self.args.real_prefill, selection_threads=self.args.selection_threads,
            cpu_pool=self.pool if var.offload else None,
        )  # fmt: skip
        rec: dict[str, Any] = {
            "kind": "point", "run_id": self.run_id,
            "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "figure": sweep.figure, "model": sweep.model,
            "model_name": plan.model_name(sweep.model),
            "context": sweep.context, "variant": sweep.variant, "mode": var.mode,
            "budget": sweep.budget, "gpu_cap_gb": sweep.gpu_cap_gb, "steps": sweep.steps,
            "block_size": self.config.block_size, "batch": batch,
            "warmup_blocks": self.args.warmup_blocks,
            "prefill": "real" if self.args.real_prefill else "synthetic",
            "kv_geometry": vars(tp.kv_geometry(self.config, 2)),
            "cpu_pool_gib": self.pool.nbytes / _GIB if var.offload and self.pool else None,
            **{k: v for k, v in self.setting(sweep).items() if k in POINT_SETTINGS},
        }  # fmt: skip
        if sweep.contexts == plan.MIXED:
            lens = plan.mixed_context_lengths(sweep.context, batch, self.config.block_size)
            rec.update(contexts=plan.MIXED, mean_context=sum(lens) / batch, min_context=min(lens))
        try:
            rec.update(tp.measure_point(ps, sweep, batch))
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001  (recorded, the sweep goes on or stops cleanly)
            rec["status"] = tp.classify_failure(e)
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if self.args.fail_fast and rec["status"] == "error":
                raise
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        rec["wall_seconds"] = time.perf_counter() - t0
        append_record(self.jsonl, rec)
        self.records.append(rec)
        self.measured.append(rec)
        self.last_wall[replace(sweep, contexts=plan.UNIFORM).key] = (batch, rec["wall_seconds"])
        log(describe_point(sweep, rec))
        return str(rec["status"])


def pool_page_bytes(config: Any) -> int:
    """Bytes of one CPU pool page (one block of K and V, bf16) over the offloaded layers (all
    but the first two, which the engines keep dense)."""
    layers = config.num_layers - min(2, config.num_layers)
    return int(layers * 2 * config.num_kv_heads * config.block_size * config.head_dim * 2)


def model_config(model: str, block_size: int) -> Any:
    """The :class:`~herald.models.config.ModelConfig` ``model`` (a preset, bundled checkpoint or
    checkpoint directory) has at ``block_size``, without building the model."""
    from herald.models.loader import load_config

    return load_config(model, block_size=block_size)


def describe_point(sweep: Sweep, r: dict[str, Any]) -> str:
    head = f"{sweep.label} bs {r['batch']}:"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()} ({r.get('error', '')[:160]})"
    parts = [
        f"{r['decode_tokens_per_s']:.0f} tok/s",
        f"fwd {r['forward_median_s'] * 1e3:.1f} ms",
    ]
    if r.get("block_main_s"):
        parts.append(
            f"main {sum(r['block_main_s']) / len(r['block_main_s']):.2f} s, retrieval "
            f"{sum(r['block_retrieval_s']) / len(r['block_retrieval_s']):.2f} s, stall "
            f"{sum(r['block_stall_s']) / len(r['block_stall_s']):.2f} s per block"
        )
    if r.get("selection_kernel"):
        parts.append(f"selection {r['selection_kernel']['block_s']:.2f} s/block")
    if r.get("peak_gpu_gib") is not None:
        parts.append(f"peak {r['peak_gpu_gib']:.1f} GiB")
    parts.append(f"{r['wall_seconds']:.0f} s")
    return f"{head} " + ", ".join(parts)
