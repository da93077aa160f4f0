"""``herald eval``: the whole accuracy evaluation in one command (HERALD §VI-B analogs).

Plans the units of work (a task, context, mode and budget each), builds each (task, context)'s
examples once, runs the units in priority order and writes, under ``--out``:

- ``examples/<task>_<context>.json``: the recorded selection (files, sha256, lines, Python);
- ``runs/<unit>.json``: one unit's raw results (every prediction, per-example scores, timing,
  config, machine, command, date);
- ``results.json``, ``README.md``, plots: the merged report.

Work can be split (``--part K/N`` takes every N-th unit) and bounded (``--time-limit-s``: no unit is
started that would not finish in time, judged by the slowest unit so far); finished units are
skipped on a rerun with the same ``--out``, so rerunning continues. ``--report`` only rewrites
the report from the results already under ``--out`` (parts copied into sub-folders merge).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from herald.cliargs import add_list, deprecated_alias, list_of, token_count
from herald.config import FIRST_PASSES, resolve_device
from herald.eval.cli_checks import check_args, check_resume, exclusions, model_info
from herald.eval.recall import AnalysisConfig
from herald.eval.runner import DEFAULT_BUDGETS, MODES, DecodeConfig, Unit, plan_units
from herald.eval.tasks import (
    DEFAULT_TASKS,
    LINE_SETTINGS,
    TASK_GROUPS,
    TASKS,
    TaskConfig,
    prompt_tokens,
)


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part must look like K/N, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--part K/N needs 1 <= K <= N, got {text!r}")
    return k, n


class _Budgets(argparse.Action):
    """``--kv-budget`` (or its old name ``--budgets``), add_list's parsing: several budgets go
    after one flag; a second flag with other budgets is refused, not silently dropped."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:  # fmt: skip
        budgets = [x for part in values for x in part]
        given = getattr(namespace, self.dest, None)
        if given is not None and given != budgets:
            shown = " ".join(f"{b:g}" for b in [*given, *budgets])
            raise argparse.ArgumentError(
                self,
                f"given twice (or with its old name --budgets): list every budget after one "
                f"--kv-budget, e.g. --kv-budget {shown}",
            )
        setattr(namespace, self.dest, budgets)


TASK_HELP = (
    "tasks, several allowed: line (next-line completion), recall (identifier recall), the "
    "RULER-style niah_single, niah_multikey, niah_multivalue, niah_multiquery, vt (variable "
    "tracking), cwe (common words); ruler = all six"
)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to ``herald``'s subparsers; it dispatches through
    ``set_defaults(handler=cmd_eval)``."""
    p = subparsers.add_parser(
        "eval",
        help="long-context accuracy of dense / mage / infinigen / herald (tables, plots)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="code-sdar",
        help="checkpoint directory, bundled checkpoint (code-sdar) or random-weight preset "
        "(default: code-sdar, the trained model; a preset's scores are noise)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--report", action="store_true", help="only rewrite the report from --out")
    add_list(
        p, "--task", "--tasks", choices=[*TASKS, *TASK_GROUPS], default=list(DEFAULT_TASKS),
        help=TASK_HELP,
    )  # fmt: skip
    add_list(
        p,
        "--contexts",
        kind=token_count,
        metavar="TOKENS",
        default=[4096, 8192, 16384],
        help="context lengths in tokens, e.g. 4096 or 4K",
    )
    add_list(
        p,
        "--modes",
        choices=[m for m in MODES if m != "control"],
        default=["dense", "mage", "infinigen", "herald"],
        help="methods (the no-context control runs too, unless --no-control)",
    )
    p.add_argument(
        "--kv-budget",
        dest="budgets",
        metavar="KV_BUDGET",
        type=list_of(float),
        nargs="+",
        action=_Budgets,
        default=None,
        help="KV budgets of the offloading modes (mage, infinigen, herald): fractions of the "
        "context kept, several after one --kv-budget; each offloading mode runs at every one "
        f"(default: {' '.join(f'{b:g}' for b in DEFAULT_BUDGETS)})",
    )
    p.add_argument(
        "-n", "--num-examples", type=int, default=64, help="examples per task/context (default: 64)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="requests decoding at once (default: 16)"
    )
    mode = p.add_mutually_exclusive_group()  # two modes: fixed steps use no threshold
    mode.add_argument(
        "--threshold", type=float, default=0.95, help="confidence threshold; not with --steps"
    )
    mode.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed denoising steps per block, no threshold; not with --threshold (default: "
        "none, the confidence threshold decides)",
    )
    p.add_argument(
        "--control-tokens", type=token_count, default=512, help="no-context control window"
    )
    p.add_argument("--no-control", action="store_true", help="skip the no-context control")
    p.add_argument(
        "--min-distance", type=token_count, default=2000, help="recall: tokens def -> use"
    )
    p.add_argument(
        "--infile-tokens",
        type=token_count,
        default=TaskConfig.infile_tokens,
        help="line: in-file prefix cap (tokens)",
    )
    p.add_argument(
        "--line-setting",
        choices=LINE_SETTINGS,
        default=TaskConfig.line_setting,
        help="line: target lines, after RepoBench's settings (default cross_file_random: random "
        "lines preferring uses of names imported from other files of the package; "
        "cross_file_later: a later use of such a name, absent from the control window, which is "
        "RepoBench's own cross_file_random plus that condition; cross_file_first: its first "
        "use, likewise)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="example selection seed (cross_file_first / cross_file_later: it orders one pool of "
        "every eligible target, so two seeds share targets once -n nears the pool's size)",
    )
    p.add_argument(
        "--exclude-examples",
        nargs="+",
        type=Path,
        default=[],
        metavar="JSON",
        help="examples/<task>_<context>.json files of earlier runs: their targets (file and line "
        "text) are not asked again, e.g. to confirm a choice made on them on other targets "
        "(default: none)",
    )
    p.add_argument(
        "--selection-threads",
        type=int,
        default=None,
        help="CPU kernel threads (default: every usable core, or $HERALD_SELECTION_THREADS)",
    )
    p.add_argument(
        "--first-pass",
        choices=list(FIRST_PASSES),
        default="none",
        help="the herald units' first pass (herald generate --first-pass): int8-gpu scores an "
        "int8 copy of K on the model's device, approximate (default: %(default)s, exact)",
    )
    p.add_argument(
        "--analysis-examples",
        type=int,
        default=8,
        help="examples per task and context for the Fig. 7/9 selection-recall analysis "
        "(default: 8; 0 = off; minutes per example on a CPU)",
    )
    p.add_argument("--analysis-blocks", type=int, default=4, help="blocks decoded per example")
    p.add_argument("--oracle-budget", type=float, default=0.025, help="oracle k as a budget")
    p.add_argument(
        "--part", type=_part, default="1/1", metavar="K/N", help="run every N-th unit from K"
    )
    p.add_argument(
        "--time-limit-s",
        dest="time_limit",
        metavar="SECONDS",
        type=float,
        default=None,
        help="start no unit that would end after this many seconds (default: no limit)",
    )
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    deprecated_alias(p, "--budgets", "--kv-budget")
    deprecated_alias(p, "--time-limit", "--time-limit-s")
    p.set_defaults(handler=cmd_eval)
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    from herald.eval.report import record_planned, write_report

    out: Path = args.out
    if args.report:
        print(f"wrote {write_report(out)}")
        return 0
    check_args(args)
    excluded, excluded_hashes, excluded_files = exclusions(args.exclude_examples, out)
    for task in sorted(set(excluded_files) - set(args.task)):
        print(
            f"NOTE: --exclude-examples {' '.join(excluded_files[task])}: {task} examples, "
            f"ignored (this run's tasks: {' '.join(args.task)})",
            file=sys.stderr,
        )
    from herald.bench.common import command_line, machine_info
    from herald.eval.recall import run_analysis
    from herald.eval.runner import run_unit
    from herald.eval.selection import select_examples
    from herald.eval.sources import Corpus
    from herald.eval.tasks import selection_hash
    from herald.models.loader import load_model
    from herald.progress import progress

    device = resolve_device(args.device)
    if device.type == "cpu" and args.analysis_examples > 0:
        print(
            f"NOTE: the Fig. 7/9 analysis runs on {args.analysis_examples} examples per task and "
            "context, minutes each on a CPU; --analysis-examples 0 skips it",
            file=sys.stderr,
        )
    torch.manual_seed(0)
    model, config, tokenizer = load_model(args.model, device=device, dtype=torch.bfloat16)
    dcfg = DecodeConfig(
        threshold=args.threshold,
        steps=args.steps,
        batch_size=args.batch_size,
        control_tokens=args.control_tokens,
        selection_threads=args.selection_threads,
        first_pass=args.first_pass,
    )
    tcfg = TaskConfig(
        seed=args.seed,
        control_tokens=args.control_tokens,
        infile_tokens=args.infile_tokens,
        min_distance=args.min_distance,
        line_setting=args.line_setting,
    )
    acfg = AnalysisConfig(
        oracle_budget=args.oracle_budget,
        num_blocks=args.analysis_blocks,
        num_examples=args.analysis_examples,
    )
    for task in args.task:  # a prompt and its answer blocks must fit the model's positions
        blocks = dcfg.answer_blocks(task)
        limit = config.max_position_embeddings - (blocks + 2) * config.block_size
        limit = limit // config.block_size * config.block_size
        too_long = [c for c in args.contexts if prompt_tokens(task, c, tcfg) > limit]
        if too_long:
            raise ValueError(
                f"--contexts {too_long[0]}: the {task} task fits at most {limit} prompt tokens "
                f"in this model (max_position_embeddings {config.max_position_embeddings})"
            )
    info = model_info(args, config)
    if info["random_weights"]:
        print(f"NOTE: '{args.model}' has RANDOM weights: scores are noise.", file=sys.stderr)
    units = plan_units(
        args.task,
        args.contexts,
        args.modes,
        args.budgets,
        control=not args.no_control,
        analysis=args.analysis_examples > 0,
    )
    plan_keys = [u.key for u in units]
    k, n = args.part
    units = units[k - 1 :: n]
    runs = out / "runs"
    run_config = {
        "model": info,
        "decode": asdict(dcfg),
        "tasks": asdict(tcfg),
        "analysis": asdict(acfg),
        "num_examples": args.num_examples,
        "exclude_examples": excluded_hashes,
        "device": str(device),
    }
    check_resume(runs, units, run_config)
    runs.mkdir(parents=True, exist_ok=True)
    (out / "examples").mkdir(exist_ok=True)
    todo = [u for u in units if not (runs / f"{u.key}.json").is_file()]
    print(
        f"{len(units)} units in part {k}/{n}, {len(units) - len(todo)} already done",
        file=sys.stderr,
    )
    corpus = Corpus(codec=tokenizer)
    examples: dict[tuple[str, int], list[Any]] = {}
    shared = {
        "command": command_line(),
        "machine": machine_info(),
        "config": run_config,
    }

    def examples_for(task: str, context: int) -> list[Any]:
        if (task, context) not in examples:
            examples[(task, context)] = select_examples(
                task,
                context,
                corpus,
                tokenizer,
                tcfg,
                args.num_examples,
                drop=excluded.get(task, set()),
                excluded_from=excluded_files.get(task, []),
                model=str(args.model),
                out=out,
            )
        return examples[(task, context)]

    t_start = time.perf_counter()
    slowest = 0.0
    skipped: list[Unit] = []
    bar = progress(todo, desc="units", unit="unit")
    for unit in bar:
        elapsed = time.perf_counter() - t_start
        if args.time_limit is not None and elapsed + 1.2 * slowest > args.time_limit:
            skipped.append(unit)
            continue
        bar.set_postfix_str(unit.key)
        t0 = time.perf_counter()
        exs = examples_for(unit.task, unit.context)
        if unit.mode == "analysis":
            params = dcfg.params(unit.task, config.block_size)
            res: dict[str, Any] = {
                "unit": unit.key,
                **asdict(unit),
                "analysis": run_analysis(exs, model, config, params, acfg, desc=unit.key),
                "selection_sha256": selection_hash(exs),
            }
        else:
            res = run_unit(unit, exs, model, config, tokenizer, dcfg)
        res.update(shared, date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        res["seconds_total"] = time.perf_counter() - t0
        (runs / f"{unit.key}.json").write_text(json.dumps(res, indent=1) + "\n")
        slowest = max(slowest, time.perf_counter() - t0)
        if "metrics" in res:
            m = res["metrics"]
            msg = f"score {m['score']:.2f} (EM {m['em']:.3f}, ES {m['es']:.3f})"
            bar.write(f"{unit.key}: {msg} in {res['seconds_total']:.1f} s")
        else:
            pairs = res["analysis"]["summary"]["num_pairs"]
            bar.write(f"{unit.key}: {pairs} block pairs in {res['seconds_total']:.1f} s")
    bar.close()
    # NOTE: recorded only once the call got through its units (a call refused mid-way, e.g. by a
    # different example selection under this --out, must not list its plan as "not run yet").
    record_planned(out, plan_keys)
    if skipped:
        print(
            f"time limit: {len(skipped)} unit(s) not started ({', '.join(u.key for u in skipped)});"
            " rerun the same command with the same --out to continue",
            file=sys.stderr,
        )
    if not args.no_report:
        print(f"wrote {write_report(out)}")
    return 0
