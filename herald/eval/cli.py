"""``herald eval``: the whole accuracy evaluation in one command (issue 6).

Plans units (:func:`herald.eval.runner.plan_units`), builds each (task, context)'s examples once,
runs the units in priority order and writes, under ``--out``:

- ``examples/<task>_<context>.json``: the recorded selection (files, sha256, lines, Python);
- ``runs/<unit>.json``: one unit's raw results (every prediction, per-example scores, timing,
  config, machine, command, date);
- ``results.json``, ``README.md``, plots: the merged report (:mod:`herald.eval.report`).

Work can be split (``--part K/N`` takes every N-th unit) and bounded (``--time-limit``: no unit is
started that would not finish in time, judged by the slowest unit so far); finished units are
skipped on a rerun with the same ``--out``, so rerunning continues. ``--report`` only rewrites
the report from the results already under ``--out`` (parts copied into sub-folders merge).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from herald.config import resolve_device
from herald.eval.recall import AnalysisConfig
from herald.eval.runner import DEFAULT_BUDGETS, MODES, DecodeConfig, Unit, plan_units
from herald.eval.tasks import LINE_SETTINGS, TASKS, TaskConfig


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part must look like K/N, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--part K/N needs 1 <= K <= N, got {text!r}")
    return k, n


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
    p.add_argument(
        "--task", nargs="+", choices=TASKS, default=list(TASKS), help="tasks (default: both)"
    )
    p.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        default=[4096, 8192, 16384],
        help="context lengths in tokens (default: 4096 8192 16384)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=[m for m in MODES if m != "control"],
        default=["dense", "mage", "infinigen", "herald"],
        help="methods, space-separated (default: dense mage infinigen herald; the no-context "
        "control runs unless --no-control)",
    )
    p.add_argument(
        "--budgets",
        nargs="+",
        type=float,
        default=list(DEFAULT_BUDGETS),
        help="selection budgets, fractions of the context (default: "
        + " ".join(f"{b:g}" for b in DEFAULT_BUDGETS)
        + ")",
    )
    p.add_argument(
        "-n", "--num-examples", type=int, default=64, help="examples per task/context (default: 64)"
    )
    p.add_argument(
        "--batch-size", type=int, default=16, help="requests decoding at once (default: 16)"
    )
    p.add_argument("--threshold", type=float, default=0.95, help="confidence threshold")
    p.add_argument("--steps", type=int, default=None, help="fixed denoising steps per block")
    p.add_argument("--control-tokens", type=int, default=512, help="no-context control window")
    p.add_argument("--no-control", action="store_true", help="skip the no-context control")
    p.add_argument("--min-distance", type=int, default=2000, help="recall: tokens def -> use")
    p.add_argument(
        "--infile-tokens",
        type=int,
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
        "text) are not asked again, e.g. to confirm a choice made on them on other targets",
    )
    p.add_argument("--selection-threads", type=int, default=None, help="CPU kernel threads")
    p.add_argument(
        "--analysis-examples",
        type=int,
        default=8,
        help="examples per task and context for the Fig. 7/9 selection-recall analysis "
        "(default: 8; 0 = off; minutes per example on a CPU)",
    )
    p.add_argument("--analysis-blocks", type=int, default=4, help="blocks decoded per example")
    p.add_argument("--oracle-budget", type=float, default=0.025, help="oracle k as a budget")
    p.add_argument("--part", type=_part, default=(1, 1), help="run every N-th unit from K: K/N")
    p.add_argument("--time-limit", type=float, default=None, help="seconds; then stop cleanly")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.set_defaults(handler=cmd_eval)
    return p


def _check(args: argparse.Namespace) -> None:
    """Every flag checked before the model loads or --out is touched (errors name the flag)."""
    args.contexts = list(dict.fromkeys(args.contexts))  # a repeated context would run twice
    positive = {
        "--num-examples": args.num_examples,
        "--batch-size": args.batch_size,
        "--control-tokens": args.control_tokens,
        "--infile-tokens": args.infile_tokens,
        "--min-distance": args.min_distance,
        "--analysis-blocks": args.analysis_blocks,
        "--selection-threads": args.selection_threads,
        "--steps": args.steps,
    }
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.analysis_examples < 0:
        n = args.analysis_examples
        raise ValueError(f"--analysis-examples must be >= 0 (0 = off), got {n}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    for flag, values in (
        ("--budgets", args.budgets),
        ("--threshold", [args.threshold]),
        ("--oracle-budget", [args.oracle_budget]),
    ):
        if any(not 0.0 < v <= 1.0 for v in values):  # also refuses nan
            shown = values if flag == "--budgets" else values[0]
            raise ValueError(f"{flag} must lie in (0, 1], got {shown}")
    if any(c <= args.control_tokens for c in args.contexts):
        raise ValueError(
            f"--contexts {' '.join(map(str, args.contexts))}: every context must exceed "
            f"--control-tokens {args.control_tokens}"
        )
    for ctx in args.contexts if "line" in args.task else []:
        cap = TaskConfig(infile_tokens=args.infile_tokens).infile_cap(ctx)
        if cap < args.control_tokens:
            raise ValueError(
                f"line at context {ctx}: the in-file context (min(--infile-tokens "
                f"{args.infile_tokens}, context / 2) = {cap} tokens) is shorter than "
                f"--control-tokens {args.control_tokens}, so the no-context control would see "
                "cross-file context; raise --infile-tokens or lower --control-tokens"
            )
    if "recall" in args.task and min(args.contexts) < args.min_distance + 64:
        raise ValueError(
            f"recall needs contexts >= --min-distance + 64 ({args.min_distance + 64}); "
            "lower --min-distance for short contexts"
        )


def _exclusions(
    paths: list[Path], out: Path
) -> tuple[dict[str, set[tuple[str, str]]], dict[str, list[str]], dict[str, list[str]]]:
    """``--exclude-examples``: task -> the (file, target line) pairs of the given example files,
    task -> the files' selection hashes (recorded, so a resumed run must exclude the same for
    that task), and task -> the paths given for it. A file under ``out`` is refused: this run
    rewrites it."""
    drop: dict[str, set[tuple[str, str]]] = {}
    hashes: dict[str, set[str]] = {}
    files: dict[str, list[str]] = {}
    for path in paths:
        if path.resolve().is_relative_to(out.resolve()):
            raise ValueError(
                f"--exclude-examples {path}: inside --out {out}, whose examples this run "
                "rewrites; copy it elsewhere or use another --out"
            )
        if not path.is_file():
            raise ValueError(f"--exclude-examples {path}: no such file")
        try:
            sel = json.loads(path.read_text())
            pairs = {(e["file"], e["target"]) for e in sel["examples"]}
            task, digest = sel["task"], sel["selection_sha256"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--exclude-examples {path}: not an examples/<task>_<context>.json file of a "
                f"herald eval run ({type(e).__name__}: {e})"
            ) from None
        drop.setdefault(task, set()).update(pairs)
        hashes.setdefault(task, set()).add(digest)
        files.setdefault(task, []).append(str(path))
    return drop, {task: sorted(h) for task, h in sorted(hashes.items())}, files


def _model_info(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    ckpt_dir = _checkpoint_dir(str(args.model))
    info = {
        "name": str(args.model),
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "block_size": config.block_size,
        "max_position_embeddings": config.max_position_embeddings,
        "random_weights": bool(config.hf_config.get("herald_random_weights")) or ckpt_dir is None,
    }
    if ckpt_dir is not None and (ckpt_dir / "config.json").is_file():
        info["config_sha256"] = hashlib.sha256((ckpt_dir / "config.json").read_bytes()).hexdigest()
    return info


def _checkpoint_dir(model: str) -> Path | None:
    """The checkpoint directory ``--model`` names (a directory or a bundled checkpoint), or None
    for a random-weight preset."""
    from herald.models.loader import bundled_checkpoint

    return Path(model) if Path(model).is_dir() else bundled_checkpoint(model)


_RESUME_KEYS = ("model", "decode", "tasks", "analysis", "num_examples", "exclude_examples")
"""Settings a unit already under --out must share with this command to be skipped (the device
may differ: parts of one evaluation can run on different machines)."""
_OTHER_TASK_KEYS = {
    "line": ("min_distance", "distance_margin"),
    "recall": ("infile_tokens", "min_package_chars", "line_setting"),
}
"""Task settings that do not change a unit of this task (not compared on resume)."""


def _check_resume(runs: Path, units: list[Unit], config: dict[str, Any]) -> None:
    """Refuse to mix settings in one --out: a finished unit run with other settings would be
    skipped and reported as if this command had run it."""
    new = json.loads(json.dumps(config))  # as it would be stored (tuples -> lists)
    for u in units:
        path = runs / f"{u.key}.json"
        if not path.is_file():
            continue
        old = json.loads(path.read_text()).get("config", {})
        diff = []
        for key in _RESUME_KEYS:
            if key not in old or old[key] == new[key]:
                continue  # older results may lack a key: nothing to compare
            if key == "exclude_examples":  # only this unit's task's exclusions change it
                was = old[key] if isinstance(old[key], dict) else {u.task: old[key]}  # 1st form
                if was.get(u.task, []) != new[key].get(u.task, []):
                    diff.append(f"{key}.{u.task}: {was.get(u.task)} -> {new[key].get(u.task)}")
                continue
            if isinstance(old[key], dict) and isinstance(new[key], dict):
                skip = _OTHER_TASK_KEYS.get(u.task, ()) if key == "tasks" else ()
                diff += [
                    f"{key}.{k}: {old[key].get(k)!r} -> {new[key].get(k)!r}"
                    for k in sorted(old[key].keys() | new[key].keys())
                    if old[key].get(k) != new[key].get(k) and k not in skip
                ]
            else:
                diff.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        if diff:
            raise ValueError(
                f"{path} was run with other settings ({'; '.join(diff)}); rerun with the same "
                "settings to continue, or use a new --out"
            )


def cmd_eval(args: argparse.Namespace) -> int:
    from herald.eval.report import record_planned, write_report

    out: Path = args.out
    if args.report:
        print(f"wrote {write_report(out)}")
        return 0
    _check(args)
    excluded, excluded_hashes, excluded_files = _exclusions(args.exclude_examples, out)
    for task in sorted(set(excluded_files) - set(args.task)):
        print(
            f"NOTE: --exclude-examples {' '.join(excluded_files[task])}: {task} examples, "
            f"ignored (this run's tasks: {' '.join(args.task)})",
            file=sys.stderr,
        )
    from tqdm import tqdm

    from herald.bench.common import command_line, machine_info
    from herald.eval.recall import run_analysis
    from herald.eval.runner import run_unit
    from herald.eval.sources import Corpus, fingerprint
    from herald.eval.tasks import build_examples, selection_hash
    from herald.models.loader import load_model

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
        blocks = dcfg.line_blocks if task == "line" else dcfg.recall_blocks
        limit = config.max_position_embeddings - (blocks + 2) * config.block_size
        limit = limit // config.block_size * config.block_size
        too_long = [c for c in args.contexts if c > limit]
        if too_long:
            raise ValueError(
                f"--contexts {too_long[0]}: the {task} task fits at most {limit} prompt tokens "
                f"in this model (max_position_embeddings {config.max_position_embeddings})"
            )
    info = _model_info(args, config)
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
    _check_resume(runs, units, run_config)
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
            t0 = time.perf_counter()
            drop = excluded.get(task, set())
            n_build = args.num_examples + len(drop)  # enough that n remain after the exclusion
            exs = build_examples(task, corpus, tokenizer, context, n_build, tcfg)
            if drop:
                n_built = len(exs)
                exs = [e for e in exs if (e.meta["file"], e.target) not in drop]
                print(
                    f"{task} at {context}: {n_built - len(exs)} of {n_built} built examples "
                    f"excluded (--exclude-examples)",
                    file=sys.stderr,
                )
            exs = exs[: args.num_examples]
            if not exs:
                raise ValueError(f"no {task} example could be built at context {context}")
            if len(exs) < args.num_examples:
                print(
                    f"NOTE: {task} at {context}: asked for {args.num_examples} examples, the "
                    f"corpus has {len(exs)} eligible ones; running {len(exs)}",
                    file=sys.stderr,
                )
            sel = {
                "task": task,
                "context": context,
                "effective_context": context,  # checked against the model up front
                "selection_sha256": selection_hash(exs),
                "corpus": corpus.describe(),
                "tokenizer": {"sha256": fingerprint(tokenizer), "model": str(args.model)},
                "task_config": asdict(tcfg),
                "build_seconds": time.perf_counter() - t0,
                "excluded_from": excluded_files.get(task, []),
                "examples": [{"id": e.example_id, "target": e.target, **e.meta} for e in exs],
            }
            path = out / "examples" / f"{task}_{context}.json"
            if path.is_file():
                old = json.loads(path.read_text())["selection_sha256"]
                new = selection_hash(exs)
                if old != new:
                    raise ValueError(
                        f"{path} holds a different selection ({old[:12]} != {new[:12]}: another "
                        "stdlib, tokenizer, seed or --num-examples); use a new --out"
                    )
            path.write_text(json.dumps(sel, indent=1) + "\n")
            examples[(task, context)] = exs
        return examples[(task, context)]

    t_start = time.perf_counter()
    slowest = 0.0
    skipped: list[Unit] = []
    bar = tqdm(todo, desc="units", unit="unit", file=sys.stderr)
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
