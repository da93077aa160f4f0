"""The GPU forward against its floor: time, kernels, bytes and FLOPs per model, context, batch.

``herald bench forward`` (or ``python -m herald.bench.forward``) builds each model preset with
random bf16 weights and, per context and batch, the engine of each mode with synthetic KV,
and measures:

- the forward time: median of ``--reps`` forwards after ``--warmup``, through the engine's own
  forward path (CUDA graphs where it uses them); ``dense`` (the dense engine's B-token forward),
  ``herald`` (HERALD's main-stream denoising forward over its sparse pool at ``--kv-budget``),
  ``herald-draft`` (HERALD's fused draft step: block and draft, 2B tokens);
- the engine step times around it (whole blocks of ``--steps`` steps: logits, sampling, host
  syncs, and for HERALD the retrieval stream running beside);
- with ``--profile``, its kernels by category and the top kernels, and the expert GEMMs' TB/s
  of expert weight bytes;
- its floor from bytes and FLOPs at ``--hbm-tbps`` and ``--peak-tflops`` (a GPU's), and
  measured / floor (left out of a CPU run's tables: a GPU's floor says nothing of CPU times);
- prefill tokens/s through the engines' real prefill at ``--prefill-prompts`` tokens
  (``--prefill-requests`` prompts queued at once).

Acceptance targets are printed beside the points that have one. Without ``--contexts`` and
``--batches`` the run measures the targets' points of the selected models and modes; with both,
every combination. Every point is checked against the device's free memory (and HERALD's CPU
pool against the host's) before anything is allocated. Records are appended to
``OUT/forward.jsonl`` as they are measured, headed by the run (machine, code, command);
``--report DIR`` (or the end of a run) writes ``DIR/forward.md`` and its plots.

    herald bench forward                                  # the targets, on the GPU
    herald bench forward --models llada2-mini --contexts 32K --batches 32 --modes dense
    herald bench forward --device cpu --models tiny-llada2 --contexts 256 --batches 2 \\
        --modes dense,herald --reps 1 --steps 3 --step-blocks 1 --out /tmp/fwd
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from herald.bench import forward_floor as ff
from herald.bench import forward_point as fp
from herald.bench import forward_report as report
from herald.bench.common import (
    SELECTION_THREADS_HELP,
    append_jsonl,
    benchmark_main,
    benchmark_parser,
    register_benchmark,
)
from herald.bench.forward_point import Point, check_memory
from herald.bench.throughput_records import log
from herald.cliargs import add_list, deprecated_alias, token_count

JSONL_NAME = "forward.jsonl"
DEFAULT_MODELS = ["llada2-mini", "sdar-8b-chat"]
DEFAULT_PREFILL = [4096, 16384, 32768]
_GIB = 1 << 30


_SKIP = ("none", "off")
"""``--prefill-prompts`` values that skip the prefill measurement."""


def _prefill_length(text: str) -> int | None:
    """One ``--prefill-prompts`` value: a token count, or None for none / off."""
    return None if text.strip().lower() in _SKIP else token_count(text)


def _prefill_prompts_given(values: list[int | None]) -> list[int]:
    """The parsed ``--prefill-prompts``: [] for none / off alone; ValueError for none / off
    beside lengths (which one was meant?)."""
    lengths = [v for v in values if v is not None]
    if lengths and len(lengths) < len(values):
        raise ValueError(
            "--prefill-prompts takes prompt lengths or none (or off) to skip, not both"
        )
    return lengths


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_list(p, "--models", metavar="PRESET", default=DEFAULT_MODELS, help="model presets")
    add_list(
        p, "--contexts", kind=token_count, metavar="TOKENS",
        help="contexts (prompt tokens), e.g. 2K 32K (with --batches; default: the targets')",
    )  # fmt: skip
    add_list(
        p,
        "--batches",
        kind=int,
        metavar="BATCH",
        help="batch sizes (with --contexts; default: the targets')",
    )
    add_list(p, "--modes", choices=ff.MODES, default=list(ff.MODES), help="forwards to time")
    p.add_argument(
        "--kv-budget", dest="budget", metavar="KV_BUDGET", type=float, default=0.05,
        help="HERALD's KV budget: fraction of the context kept per KV head, in (0, 1]",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=20, help="timed forwards per point (median)")
    p.add_argument(
        "--warmup", type=int, default=3,
        help="forwards before timing (on CUDA a new shape's first runs eagerly, its second "
        "captures the graphs: keep >= 2)",
    )  # fmt: skip
    p.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=None,
        help="kernel breakdown under torch.profiler (default: on for CUDA, off for the CPU)",
    )  # fmt: skip
    p.add_argument("--profile-reps", type=int, default=3, help="forwards profiled per point")
    p.add_argument("--steps", type=int, default=20, help="denoising steps T per block")
    p.add_argument(
        "--step-blocks", type=int, default=2, help="blocks of engine steps timed (0: none)"
    )
    add_list(
        p, "--prefill-prompts", kind=_prefill_length, default=None, metavar="TOKENS",
        help="prefill prompt lengths, e.g. 4K 16K 32K; none (or off) to skip (default: 4K 16K "
        "32K on CUDA, none on the CPU)",
    )  # fmt: skip
    p.add_argument("--prefill-requests", type=int, default=4, help="prompts queued at once")
    p.add_argument(
        "--prefill-only", action="store_true", help="measure prefill only (no forward points)"
    )
    p.add_argument("--out", type=Path, default=Path("results/forward"), help="records folder")
    p.add_argument("--hbm-tbps", type=float, default=ff.HBM_TBPS, help="HBM TB/s of the floor")
    p.add_argument(
        "--peak-tflops", type=float, default=ff.PEAK_TFLOPS, help="peak TFLOP/s of the floor"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda[:N] (default: cuda if available)",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=32, help="tokens per block")
    p.add_argument("--selection-threads", type=int, default=None, help=SELECTION_THREADS_HELP)
    p.add_argument(
        "--dram-reserve-gb", type=float, default=4.0,
        help="GiB of DRAM kept free beyond what the points are estimated to need, CPU pool and "
        "pinned staging buffers counted (default: %(default)s; bench throughput keeps 16, its "
        "pool being sized from available DRAM without those buffers)",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the points and floors only")
    p.add_argument(
        "--report", type=Path, default=None, help="only rebuild DIR/forward.md (default: measure)"
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    deprecated_alias(p, "--budget", "--kv-budget")


def check_args(args: argparse.Namespace) -> None:
    """One-line ValueErrors for flags no run can use, before any model is built."""
    from herald.models.registry import list_presets

    unknown = [m for m in args.models if m not in list_presets()]
    if unknown:
        raise ValueError(f"unknown preset {unknown[0]!r}; presets: {', '.join(list_presets())}")
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (or cuda:N), got {args.device!r}")
    if kind == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise ValueError(
            "--device cuda but no CUDA GPU; on a CPU try --device cpu --models tiny-llada2 "
            "--contexts 256 --batches 2 --reps 1"
        )
    if args.prefill_prompts is not None:
        args.prefill_prompts = _prefill_prompts_given(args.prefill_prompts)
    if args.prefill_only and (args.contexts or args.batches or args.prefill_prompts == []):
        raise ValueError("--prefill-only measures --prefill-prompts, not --contexts / --batches")
    if (args.contexts is None) != (args.batches is None):
        raise ValueError("give --contexts and --batches together (neither: the targets' points)")
    b = args.block_size
    if not (1 <= b <= 1024 and b & (b - 1) == 0):
        raise ValueError(f"--block-size must be a power of two in [1, 1024], got {b}")
    for name, vals, low in (("--contexts", args.contexts, b), ("--batches", args.batches, 1),
                            ("--prefill-prompts", args.prefill_prompts, b)):  # fmt: skip
        bad = [v for v in vals or () if v < low]
        if bad:
            skip = "; none (or off) skips the prefill" if name == "--prefill-prompts" else ""
            raise ValueError(f"{name} must be >= {low}, got {bad[0]}{skip}")
    if not 0 < args.budget <= 1:
        raise ValueError(f"--kv-budget is a fraction of the context in (0, 1], got {args.budget}")
    for name, value, low in (("--reps", args.reps, 1), ("--warmup", args.warmup, 0),
                             ("--profile-reps", args.profile_reps, 1), ("--steps", args.steps, 1),
                             ("--step-blocks", args.step_blocks, 0),
                             ("--prefill-requests", args.prefill_requests, 1)):  # fmt: skip
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    for name, value in (("--hbm-tbps", args.hbm_tbps), ("--peak-tflops", args.peak_tflops)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value:g}")
    if args.selection_threads is not None and args.selection_threads < 1:
        raise ValueError(f"--selection-threads must be >= 1, got {args.selection_threads}")
    if args.dram_reserve_gb < 0:
        raise ValueError(f"--dram-reserve-gb must be >= 0, got {args.dram_reserve_gb:g}")
    for name in ("models", "modes", "contexts", "batches"):  # a value given twice counts once
        if getattr(args, name) is not None:
            setattr(args, name, list(dict.fromkeys(getattr(args, name))))


def plan(args: argparse.Namespace) -> list[Point]:
    """The points: every model x context x batch x engine (dense, HERALD) with the modes of
    that engine, or the targets' points when no context or batch is given; none with
    ``--prefill-only``."""
    if args.prefill_only:
        return []
    kinds = {k: tuple(m for m in args.modes if fp.engine_kind(m) == k) for k in ("dense", "herald")}
    out: list[Point] = []
    if args.contexts is None:
        for model, mode, ctx, bs in ff.target_points(args.models, args.modes):
            pt = Point(model, ctx, bs, kinds[fp.engine_kind(mode)])
            if pt not in out:
                out.append(pt)
        if not out:
            raise ValueError(
                "no acceptance target for these --models and --modes; give --contexts and --batches"
            )
        return out
    for model in args.models:
        for ctx in args.contexts:
            for bs in args.batches:
                out += [Point(model, ctx, bs, ms) for ms in kinds.values() if ms]
    return out


def settings(args: argparse.Namespace) -> fp.Settings:
    device = torch.device(args.device)
    profile = device.type == "cuda" if args.profile is None else args.profile
    return fp.Settings(
        device, warmup=args.warmup, reps=args.reps, profile=profile,
        profile_reps=args.profile_reps, steps=args.steps, step_blocks=args.step_blocks,
        budget=args.budget, selection_threads=args.selection_threads, hbm_tbps=args.hbm_tbps,
        peak_tflops=args.peak_tflops, dram_reserve_gib=args.dram_reserve_gb,
    )  # fmt: skip


def prefill_prompts(args: argparse.Namespace) -> list[int]:
    if args.prefill_prompts is not None:
        return list(args.prefill_prompts)
    return list(DEFAULT_PREFILL) if torch.device(args.device).type == "cuda" else []


# -- the run --------------------------------------------------------------------------------------


class Recorder:
    """Appends records to ``OUT/forward.jsonl`` as they are measured: the first batch headed by
    the run (:func:`herald.bench.common.append_jsonl`), the later ones after it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.started = False

    def add(self, recs: list[dict[str, Any]]) -> None:
        if not self.started:
            append_jsonl(self.path, recs)
            self.started = True
        else:
            with self.path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)
        self.records += recs


def check_out(path: Path, device: str) -> None:
    """ValueError when ``path`` holds records of another device type (the default folder holds
    the committed GPU results: a CPU run must not mix into them)."""
    if not path.is_file():
        return
    other = {r.get("device") for r in report.load(path) if r.get("kind") in ("forward", "prefill")}
    other -= {device, None}
    if other:
        raise ValueError(
            f"{path} holds {'/'.join(sorted(map(str, other)))} records; a {device} run would mix "
            "into them: give another --out"
        )


def dry_run(points: list[Point], configs: dict, st: fp.Settings, prompts: list[int]) -> None:
    """The points with their floors (experts at the uniform-routing estimate) and targets."""
    rows = []
    for p in points:
        cfg = configs[p.model]
        for mode in p.modes:
            budget = None if mode == "dense" else st.budget
            shape = ff.ForwardShape(mode, p.context, p.batch, cfg.block_size, budget)
            fl = ff.floor(cfg, shape, hbm_tbps=st.hbm_tbps, peak_tflops=st.peak_tflops)
            tg = ff.target_for(p.model, mode, p.context, p.batch, budget)
            rows.append([p.model, mode, report.ctx_label(p.context), str(p.batch),
                         str(fl["tokens"]), f"{fl['weight_bytes'] / 1e9:.2f}",
                         f"{fl['kv_bytes'] / 1e9:.2f}", f"{fl['flops'] / 1e12:.2f}",
                         f"{fl['floor_ms']:.2f} ({fl['bound']})",
                         "" if tg is None else tg.describe(fl["floor_ms"])])  # fmt: skip
    head = ["model", "mode", "context", "batch", "tokens", "weights GB", "KV GB", "TFLOP",
            "floor ms", "target"]  # fmt: skip
    print(report.text_table(head, rows))
    if prompts:
        print(f"prefill: {', '.join(report.ctx_label(n) for n in prompts)} prompts")


def run_prefill(
    model: Any, cfg: Any, name: str, kinds: list[str], prompts: list[int], args: Any
) -> list[dict[str, Any]]:
    from herald.bench import throughput_point as tp
    from herald.bench.prefill import measure

    out = []
    for kind in kinds:
        for n in prompts:
            log(f"{name} prefill {report.ctx_label(n)} x {args.prefill_requests} {kind} ...")
            base = {"kind": "prefill", "model": name, "mode": kind, "prompt_tokens": n,
                    "requests": args.prefill_requests, "device": torch.device(args.device).type,
                    "target_tokens_per_s": ff.prefill_target(name, n)}  # fmt: skip
            try:
                rec = {
                    **base,
                    "status": "ok",
                    **measure(model, cfg, kind, n, args.prefill_requests),
                }
            except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
                if args.debug:
                    raise
                err = f"{type(e).__name__}: {str(e)[:300]}"
                rec = {**base, "status": tp.classify_failure(e), "error": err}
            out.append(rec)
            log(report.text_table(report.PREFILL_HEADER, [report.prefill_row(rec)]).splitlines()[1])
    return out


def run_model(name: str, points: list[Point], pages: int, prompts: list[int], args: Any,
              st: fp.Settings, rec: Recorder) -> None:  # fmt: skip
    """Build ``name``, measure its points, free its CPU pool, measure its prefill."""
    import gc
    import time

    from herald.bench import throughput_point as tp
    from herald.models.loader import load_model

    t0 = time.perf_counter()
    model, cfg, _ = load_model(name, device=st.device, dtype=torch.bfloat16, random_init_seed=0,
                               block_size=args.block_size)  # fmt: skip
    log(f"built {name} (random bf16 weights) in {time.perf_counter() - t0:.1f} s")
    pool = None
    try:
        if pages:
            t0 = time.perf_counter()
            pool = tp.new_cpu_pool(cfg, ff.NUM_DENSE_LAYERS, pages)
            log(f"{pool.describe()}; random fill in {time.perf_counter() - t0:.1f} s")
        ps = {k: fp.point_settings(model, cfg, st, pool if k == "herald" else None)
              for k in ("dense", "herald")}  # fmt: skip
        for i, p in enumerate(points):
            log(f"[{i + 1}/{len(points)}] {p.label}: {', '.join(p.modes)} ...")
            t0 = time.perf_counter()
            try:
                recs = fp.measure_point(ps[p.kind], name, p.context, p.batch, list(p.modes), st)
            except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
                if args.debug:
                    raise
                recs = fp.failed_records(name, p.context, p.batch, list(p.modes), st, e)
            for r in recs:
                r["wall_seconds"] = time.perf_counter() - t0
            rec.add(recs)
            for r in recs:
                log(report.progress_line(r))
                if r.get("profile"):
                    cats = r["profile"]["categories_ms"]
                    print(f"  {r['mode']} kernels: " + ", ".join(
                        f"{c} {ms:.2f}" for c, ms in cats.items() if ms > 0) + " ms")  # fmt: skip
                    print("\n".join("    " + x for x in report.top_kernels(r)))
        if pool is not None:
            pool.close()
            pool = None
        kinds = list(dict.fromkeys(fp.engine_kind(m) for m in args.modes))
        if prompts:
            rec.add(run_prefill(model, cfg, name, kinds, prompts, args))
    finally:
        if pool is not None:
            pool.close()
        del model
        gc.collect()
        if st.cuda:
            torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    from herald.models.loader import load_config

    if args.report is not None:
        log(f"wrote {report.write_report(args.report)}")
        return 0
    check_args(args)
    points = plan(args)
    st = settings(args)
    configs = {m: load_config(m, block_size=args.block_size) for m in args.models}
    prompts = prefill_prompts(args)
    if not points and not prompts:
        raise ValueError("nothing to measure: --prefill-only without --prefill-prompts")
    if args.dry_run:
        dry_run(points, configs, st, prompts)
        return 0
    kinds = list(dict.fromkeys(fp.engine_kind(m) for m in args.modes))
    pools = check_memory(
        points, [(k, n) for k in kinds for n in prompts], args.prefill_requests, configs, st
    )
    path = args.out / JSONL_NAME
    check_out(path, st.device.type)
    rec = Recorder(path)
    log(f"{len(points)} points, {len(prompts)} prefill lengths x {len(kinds)} engines per "
        f"model; records to {path}")  # fmt: skip
    for name in args.models:
        mine = [p for p in points if p.model == name]
        if mine or prompts:
            run_model(name, mine, pools[name], prompts, args, st, rec)
    fwd = [r for r in rec.records if r["kind"] == "forward"]
    pre = [r for r in rec.records if r["kind"] == "prefill"]
    if fwd:
        print(report.text_table(*report.forward_table(fwd)))
        if report.on_cpu(fwd):
            print(report.CPU_NOTE)
    if pre:
        print(report.text_table(report.PREFILL_HEADER, [report.prefill_row(r) for r in pre]))
    try:
        log(f"wrote {report.write_report(args.out)}")
    except Exception as e:  # noqa: BLE001  (the records are safe; rerun with --report)
        log(f"report failed ({type(e).__name__}: {e}); rerun with --report {args.out}")
    errors = [r for r in rec.records if r.get("status") == "error"]
    return 1 if errors else 0


def register(subparsers: Any) -> None:
    """Add ``herald bench forward`` to the ``herald`` command line."""
    what = "the GPU forward against its floor: time, kernels, bytes, FLOPs; prefill tok/s"
    register_benchmark(subparsers, "forward", what, __doc__, add_arguments, run)


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser("python -m herald.bench.forward", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
