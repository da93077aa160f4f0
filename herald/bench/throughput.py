"""Decode throughput vs batch size, with measured ceilings (HERALD §VI-C, §VI-D).

``herald bench throughput`` (or ``python -m herald.bench.throughput``) sweeps the batch size of
one engine configuration on one model and context, B = 32, fixed T, and reports decode
throughput = generated tokens / decode wall time (prefill excluded; the prefill is synthetic,
random KV, unless ``--real-prefill``), the peak and the batch reaching it. A point that does not
fit is recorded as ``oom`` (GPU memory, cap included) or ``dram`` (CPU pool / DRAM) and ends its
sweep. In the same run: PCIe and DRAM bandwidth, the selection kernel's time per block and the
GPU forward time at each batch, for the ceilings.

One sweep:

    herald bench throughput --model llada2-mini --context 32768 --mode herald --kv-budget 0.05 \\
        --batches 16,32,64 --gpu-memory-gb 80

A plan (``--plan all`` regenerates every table and figure of results/throughput/README.md),
runnable piecewise: ``--part i/n``, filters (``--models``, ``--contexts``, ``--modes``,
``--caps``, ``--figures``) and ``--time-limit-s``. Every point is appended to
``OUT/throughput.jsonl`` as soon as it is measured; a rerun skips the points already there, so
parts resume and merge. A folder holds one set of measurement settings (device, block size,
warm-up and timed blocks, prefill, pool, threads, kv_pad, graphs): a run with other settings is
refused (give another ``--out``), a dry run says so. ``--report DIR`` rebuilds README.md and the
plots from ``DIR/*.jsonl``.

``--mixed-contexts`` measures every point twice in the same run, one after the other: uniform
(every request at the context) and mixed (request i at its own context, whole blocks spread
evenly over [context / 2, context]: rows of different KV lengths, as a server's); the report
shows the mixed points as their own rows and compares the two.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from herald.bench import throughput_plan as plan
from herald.bench.common import (
    SELECTION_THREADS_HELP,
    benchmark_main,
    benchmark_parser,
    register_benchmark,
)
from herald.bench.throughput_plan import VARIANTS, Sweep
from herald.bench.throughput_records import JSONL_NAME, load_records, log
from herald.bench.throughput_run import Runner, model_config, pool_page_bytes
from herald.cliargs import add_list, deprecated_alias, token_count
from herald.config import DEFAULT_KV_PAD, check_kv_pad

__all__ = ["JSONL_NAME", "load_records", "main", "register", "run"]

# -- command line -------------------------------------------------------------------------------

MAX_BLOCK_SIZE = 1024  # as `herald generate --block-size`


def _cap(text: str) -> float | None:
    return None if text.lower() in ("none", "0", "off") else float(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "one sweep (without --plan)",
        "--model, --context and --mode name the sweeps to run; --models, --contexts and --modes "
        "(below) only filter the sweeps selected",
    )
    g.add_argument(
        "--model",
        help="the model to sweep: a preset name or checkpoint directory (default: none; needed "
        "without --plan)",
    )
    add_list(
        g,
        "--context",
        kind=token_count,
        metavar="TOKENS",
        help="the context length(s) to sweep in tokens, one sweep each (default: none; needed "
        "without --plan)",
    )
    add_list(
        g,
        "--mode",
        metavar="VARIANT",
        default=None,
        help=f"the variant(s) to sweep, one sweep each: {', '.join(VARIANTS)} (default: herald)",
    )
    g.add_argument(
        "--kv-budget",
        dest="budget",
        metavar="KV_BUDGET",
        type=float,
        default=None,
        help="KV budget of offloading modes (default: the mode's, e.g. herald 0.05)",
    )
    add_list(
        g, "--batches", kind=int, metavar="BATCH",
        help="batch sizes, measured in order until one does not fit (default: the report's "
        f"list for the mode, for {plan.default_batches_help()} only; other models and contexts "
        "need --batches)",
    )  # fmt: skip
    g.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="cap GPU memory at this many GB (emulates a smaller GPU; default: no cap)",
    )
    g.add_argument("--steps", type=int, default=20, help="fixed denoising steps T per block")
    g = p.add_argument_group(
        "plans and filters",
        "--models, --contexts, --modes, --caps and --figures keep only the selected sweeps (of "
        "--plan, or of --model, --context, --mode) that match; they name no sweep themselves",
    )
    g.add_argument(
        "--plan",
        choices=["all", "table2", "fig13", "fig14", "smoke"],
        default=None,
        help="run the sweeps of a table or figure of the report (all: every one), instead of "
        "one sweep (default: none, the one sweep of --model, --context, --mode)",
    )
    g.add_argument(
        "--part",
        default=None,
        help="i/n: run part i of n of the selected sweeps (default: all of them)",
    )
    add_list(
        g, "--models", metavar="MODEL",
        help="filter: run only the selected sweeps of these models (default: every one)",
    )  # fmt: skip
    add_list(
        g, "--contexts", kind=token_count, metavar="TOKENS",
        help="filter: run only the selected sweeps at these contexts (default: every one)",
    )  # fmt: skip
    add_list(
        g, "--modes", metavar="VARIANT",
        help="filter: run only the selected sweeps of these variants (default: every one)",
    )  # fmt: skip
    add_list(
        g,
        "--caps",
        kind=_cap,
        metavar="CAP",
        help="filter: GPU caps in GB, none: uncapped (default: every one)",
    )
    add_list(
        g,
        "--figures",
        metavar="FIGURE",
        help="filter: figures, table2, fig13, ... (default: every one)",
    )
    g.add_argument("--dry-run", action="store_true", help="list pending points and exit")
    g = p.add_argument_group("measurement")
    _add_engine_arguments(g)
    _add_run_arguments(g)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")  # fmt: skip
    deprecated_alias(p, "--budget", "--kv-budget")


def _add_engine_arguments(g: Any) -> None:
    """The measurement group's first part: where, and the engines' settings."""
    g.add_argument(
        "--out",
        type=Path,
        default=Path("results/throughput"),
        help="folder of the records (throughput.jsonl), the report and the plots",
    )
    g.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda[:N] (default: cuda if available)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=32,
        help=f"tokens per block, a power of two up to {MAX_BLOCK_SIZE} (default %(default)s)",
    )
    g.add_argument("--warmup-blocks", type=int, default=1, help="blocks decoded before timing")
    g.add_argument("--timed-blocks", type=int, default=2, help="blocks timed per point")
    g.add_argument(
        "--slow-block-s",
        type=float,
        default=15.0,
        help="time one block only when a warm-up block took longer than this",
    )
    g.add_argument(
        "--cpu-kv-gb",
        type=float,
        default=None,
        help="CPU KV pool size in GiB (bounds DRAM; default: what the run needs, at "
        "most available DRAM minus --dram-reserve-gb)",
    )
    g.add_argument(
        "--dram-reserve-gb",
        type=float,
        default=16.0,
        help="GiB of DRAM the CPU KV pool leaves free when it is sized from available DRAM: room "
        "for each point's pinned staging buffers, which the pool's size does not count, and a "
        "margin (default: %(default)s; bench forward keeps 4, its estimate counting those "
        "buffers)",
    )
    g.add_argument(
        "--selection-threads",
        type=int,
        default=None,
        help=SELECTION_THREADS_HELP,
    )
    g.add_argument(
        "--offload-cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offloading engines replay their forwards from CUDA graphs (default on; the "
        "dense engine always does)",
    )
    g.add_argument(
        "--kv-pad",
        type=int,
        default=DEFAULT_KV_PAD,
        help="offloading engines' kv_pad (default %(default)s: one cuDNN plan per that many "
        "tokens instead of one per block)",
    )
    g.add_argument(
        "--dense-kv-pad",
        type=int,
        default=0,
        help="dense engine's kv_pad (default 0: a uniform batch needs no mask, the fastest "
        "dense measured: 903 vs 784 tok/s with 512, LLaDA2.0-mini 32K x 16 on an H200 GPU)",
    )


def _add_run_arguments(g: Any) -> None:
    """The measurement group's second part: the points' prompts (mixed contexts, real prefill),
    the run's time limit, probes, errors, reports."""
    g.add_argument(
        "--mixed-contexts",
        action="store_true",
        help="measure every point twice, one after the other: as without the flag (every "
        "request at the context: one KV length) and with mixed contexts, where each request of "
        "the batch has a prompt of its own length, as served requests do (attention and the "
        "pools then take their paths for rows of different KV lengths): request i of a batch "
        "of n is round(i x span / (n - 1)) blocks shorter than the context, span = context // "
        "2 // block size, so the lengths fall evenly from the context to about half of it. "
        "Engine, steps, pool and the KV-page and DRAM checks are the uniform point's (the "
        'longest context). Mixed points are recorded with "contexts": "mixed", mean_context '
        "and min_context, and reported in rows of their own",
    )
    g.add_argument(
        "--real-prefill",
        action="store_true",
        help="run real prompt forwards instead of the synthetic prefill (slow)",
    )
    g.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="start no point that would end after this many seconds (default: no limit)",
    )
    g.add_argument(
        "--first-point-estimate-s",
        type=float,
        default=60.0,
        help="--time-limit-s: seconds a sweep's first point is assumed to take (later points "
        "are estimated from the last one)",
    )
    g.add_argument(
        "--dram-probe-gib", type=float, default=2.0, help="GiB copied to measure DRAM bandwidth"
    )
    g.add_argument(
        "--pcie-probe-mib", type=int, default=1024, help="MiB copied to measure PCIe bandwidth"
    )
    g.add_argument("--retry-errors", action="store_true", help="remeasure points that errored")
    g.add_argument("--fail-fast", action="store_true", help="raise on a non-memory error")
    g.add_argument(
        "--report",
        type=Path,
        default=None,
        help="only rebuild DIR/README.md and the plots from DIR/*.jsonl (default: measure)",
    )


def check_measurement_args(args: argparse.Namespace) -> None:
    """One-line errors for measurement settings no point can run with (plans and single sweeps
    alike), before any probe or model build.

    Raises:
        ValueError: an unknown ``--device``; a ``--block-size`` that is not a power of two up to
            :data:`MAX_BLOCK_SIZE` (the models' blocks are: SDAR's 4, LLaDA2.0's 32; an odd size
            is a typo, not a setting worth measuring); warm-up or timed blocks below 1; a
            negative ``--slow-block-s`` or ``--dram-reserve-gb``; a ``--cpu-kv-gb`` or
            ``--selection-threads`` that is not positive; a ``--dram-probe-gib`` that is not
            positive; a kv_pad outside [0, 65536].
    """
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (or cuda:N), got {args.device!r}")
    bs = args.block_size
    if not (1 <= bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
        raise ValueError(
            f"--block-size must be a power of two in [1, {MAX_BLOCK_SIZE}] (SDAR's blocks are "
            f"4 tokens, LLaDA2.0's 32), got {bs}"
        )
    if args.warmup_blocks < 1 or args.timed_blocks < 1:
        raise ValueError("--warmup-blocks and --timed-blocks must be >= 1 (block 0 holds prefill)")
    for name, value in (("--slow-block-s", args.slow_block_s),
                        ("--dram-reserve-gb", args.dram_reserve_gb)):  # fmt: skip
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value:g}")
    if not args.dram_probe_gib > 0:
        raise ValueError(
            "--dram-probe-gib must be positive (GiB the DRAM probe reads), got "
            f"{args.dram_probe_gib:g}"
        )
    if args.cpu_kv_gb is not None and not args.cpu_kv_gb > 0:
        raise ValueError(
            f"--cpu-kv-gb must be positive (GiB of CPU KV pool), got {args.cpu_kv_gb:g}"
        )
    if args.selection_threads is not None and args.selection_threads < 1:
        raise ValueError(f"--selection-threads must be >= 1, got {args.selection_threads}")
    check_kv_pad(args.kv_pad, "--kv-pad")
    check_kv_pad(args.dense_kv_pad, "--dense-kv-pad")


def check_cpu_pool(args: argparse.Namespace, sweeps: list[Sweep]) -> None:
    """ValueError when ``--cpu-kv-gb`` holds not even one page of the CPU pool of a model that an
    offloading sweep of ``sweeps`` runs on (the pool is built after the probes and the model)."""
    if args.cpu_kv_gb is None:
        return
    for model in dict.fromkeys(s.model for s in sweeps if VARIANTS[s.variant].offload):
        page = pool_page_bytes(model_config(model, args.block_size))
        if int(args.cpu_kv_gb * 2**30) < page:
            raise ValueError(
                f"--cpu-kv-gb {args.cpu_kv_gb:g} is too small for even one page of "
                f"{plan.model_name(model)}'s CPU KV pool ({args.block_size} tokens: "
                f"{page / 2**30:.3g} GiB)"
            )


def check_sweep_args(args: argparse.Namespace) -> None:
    """One-line errors for values no sweep can run with, before any probe or model build
    (``args.block_size`` and ``args.device`` already checked: :func:`check_measurement_args`).

    Raises:
        ValueError: a batch, step count or GPU cap below 1, a context shorter than one block (a
            context not a multiple of the block size is accepted: the engines round it up to
            whole blocks), a budget outside (0, 1], or a GPU cap on a CPU run.
    """
    bad = [v for v in args.batches or () if v < 1]
    if bad:
        raise ValueError(f"--batches must be >= 1, got {bad[0]}")
    bad = [v for v in args.context or () if v < max(1, args.block_size)]
    if bad:
        raise ValueError(
            f"--context must be >= 1 and at least one block (--block-size {args.block_size}), "
            f"got {bad[0]}"
        )
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.budget is not None and not 0 < args.budget <= 1:
        raise ValueError(f"--kv-budget is a fraction of the context in (0, 1], got {args.budget}")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory-gb must be positive, got {args.gpu_memory_gb}")
    if args.gpu_memory_gb is not None and torch.device(args.device).type != "cuda":
        raise ValueError(
            f"--gpu-memory-gb caps GPU memory: it needs --device cuda, not --device {args.device}"
        )
    if args.model is not None:
        from herald.models.loader import BUNDLED_CHECKPOINTS, is_preset
        from herald.models.registry import list_presets

        m = args.model
        if not (Path(m).is_dir() or is_preset(m) or str(m) in BUNDLED_CHECKPOINTS):
            raise ValueError(
                f"--model {m!r} is neither a checkpoint directory nor a preset "
                f"({', '.join(list_presets())})"
            )


def custom_sweeps(args: argparse.Namespace) -> list[Sweep]:
    if not args.model or not args.context:
        raise ValueError("give --plan, or --model and --context (and --batches) for one sweep")
    check_sweep_args(args)
    out = []
    for mode in args.mode or ["herald"]:
        if mode not in VARIANTS:
            raise ValueError(f"unknown --mode {mode!r}; one of {', '.join(VARIANTS)}")
        var = VARIANTS[mode]
        budget = (
            (var.default_budget if args.budget is None else args.budget) if var.offload else None
        )
        for ctx in args.context:
            batches = tuple(args.batches or plan.batches_for(args.model, ctx, mode))
            out.append(
                Sweep("custom", args.model, ctx, mode, budget, args.gpu_memory_gb, args.steps,
                      batches)
            )  # fmt: skip
    return out


def run(args: argparse.Namespace) -> int:
    from herald.bench.throughput_report import write_report

    if args.report is not None:
        log(f"wrote {write_report(args.report)}")
        return 0
    check_measurement_args(args)
    # --dry-run --device cuda on a machine without a GPU lists what a GPU run would measure.
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.dry_run:
        raise ValueError(
            "--device cuda but no CUDA GPU; on a CPU try a tiny preset, e.g. --device cpu "
            "--model tiny-sdar --context 512 --mode dense,herald --batches 1,2"
        )
    everything = plan.build_plan(args.plan) if args.plan else plan.merge(custom_sweeps(args))
    sweeps = plan.filter_sweeps(
        everything, args.models, args.contexts, args.modes, args.caps, args.figures
    )
    if not sweeps:
        raise ValueError(
            "the filters (--models, --contexts, --modes, --caps, --figures) select no sweep"
        )
    if args.part:
        sweeps = plan.split_parts(sweeps, *plan.parse_part(args.part))
    check_cpu_pool(args, sweeps)
    runner = Runner(args, sweeps, everything)
    devices = {r.get("device") for r in runner.records if r.get("kind") == "point"}
    other = sorted(map(str, devices - {torch.device(args.device).type}))
    clash = runner.conflicts()
    notes = []
    if other:
        if not args.dry_run:
            raise ValueError(
                f"--out {args.out} holds {'/'.join(other)} points; a {args.device} run would mix "
                "into them (the default --out is the committed GPU results): give another --out"
            )
        notes.append(
            f"{args.out} holds {'/'.join(other)} points, which count as done only for their "
            f"device; this dry run plans for {args.device}: add --device {other[0]} to see "
            f"what a {other[0]} run would measure"
        )
    elif clash:
        if not args.dry_run:
            raise ValueError(
                f"--out {args.out} holds points measured with other settings: "
                f"{'; '.join(clash)}; one folder holds one set (its report would mix them): give "
                "another --out, or the folder's settings"
            )
        notes.append(
            f"{args.out} holds points measured with other settings ({'; '.join(clash)}): they "
            "count as not done, and a run with these settings refuses this --out"
        )
    try:
        rc = runner.run()
    finally:
        runner.free_model()
    for note in notes:
        log(f"note: {note}")
    if runner.measured:
        try:
            log(f"wrote {write_report(args.out)}")
        except Exception as e:  # noqa: BLE001  (the raw records are safe; rerun --report)
            log(f"report failed ({type(e).__name__}: {e}); rerun with --report {args.out}")
    return rc


def register(subparsers: Any) -> None:
    """Add ``herald bench throughput`` to the ``herald`` command line."""
    what = "decode throughput vs batch size, with measured ceilings (HERALD §VI-C)"
    register_benchmark(subparsers, "throughput", what, __doc__, add_arguments, run)


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser("python -m herald.bench.throughput", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
