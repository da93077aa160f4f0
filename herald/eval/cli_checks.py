"""The checks ``herald eval`` (:mod:`herald.eval.cli`) makes before any unit runs: every flag
(before the model loads or ``--out`` is touched), the ``--exclude-examples`` files, the facts
recorded about the model, and that the finished units already under ``--out`` share this
command's settings (so that none is skipped and reported as if this command had run it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from herald.eval.runner import DEFAULT_BUDGETS, OFFLOAD_MODES, Unit
from herald.eval.tasks import TASK_FIELDS, TASK_GROUPS, TaskConfig


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before the model loads or --out is touched (errors name the flag).
    Expands the ``--task`` groups (``ruler``)."""
    args.contexts = list(dict.fromkeys(args.contexts))  # a repeated context would run twice
    tasks = [t for name in args.task for t in TASK_GROUPS.get(name, (name,))]
    args.task = list(dict.fromkeys(tasks))
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
        raise ValueError(f"--time-limit-s must be > 0 seconds, got {args.time_limit}")
    if args.first_pass != "none" and "herald" not in args.modes:
        raise ValueError(
            f"--first-pass {args.first_pass} applies to the herald units and --modes "
            f"{' '.join(args.modes)} runs none; add herald to --modes or drop --first-pass"
        )
    if args.budgets is None:
        args.budgets = list(DEFAULT_BUDGETS)
    elif not set(args.modes) & set(OFFLOAD_MODES):
        raise ValueError(
            f"--kv-budget {' '.join(f'{b:g}' for b in args.budgets)}: the budgets apply to the "
            f"offloading modes ({', '.join(OFFLOAD_MODES)}) and --modes {' '.join(args.modes)} "
            "runs none of them; drop --kv-budget or add an offloading mode to --modes"
        )
    for flag, values in (
        ("--kv-budget", args.budgets),
        ("--threshold", [args.threshold]),
        ("--oracle-budget", [args.oracle_budget]),
    ):
        if any(not 0.0 < v <= 1.0 for v in values):  # also refuses nan
            shown = values if flag == "--kv-budget" else values[0]
            raise ValueError(f"{flag} must lie in (0, 1], got {shown}")
    shown = " ".join(map(str, args.contexts))
    if any(c < 1 for c in args.contexts):
        raise ValueError(f"--contexts {shown}: every context must be positive")
    if any(c <= args.control_tokens for c in args.contexts):
        # NOTE: --no-control too: every task picks targets absent from the control window
        raise ValueError(
            f"--contexts {shown}: every context must exceed --control-tokens "
            f"{args.control_tokens} (the tasks pick targets absent from the prompt's last "
            "--control-tokens tokens, with --no-control too); lower it, e.g. --control-tokens "
            f"{max(1, min(args.contexts) // 4)}"
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


def exclusions(
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
            pairs = {(e.get("file", ""), e["target"]) for e in sel["examples"]}
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


def model_info(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    ckpt_dir = checkpoint_dir(str(args.model))
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


def checkpoint_dir(model: str) -> Path | None:
    """The checkpoint directory ``--model`` names (a directory, the ``ckpt/`` of a run folder, or
    a bundled checkpoint: :func:`~herald.models.loader.checkpoint_path`), or None for a
    random-weight preset."""
    from herald.models.loader import checkpoint_path

    path = checkpoint_path(model)
    return path if path.is_dir() else None


RESUME_KEYS = ("model", "decode", "tasks", "analysis", "num_examples", "exclude_examples")
"""Settings a unit already under --out must share with this command to be skipped (the device
may differ: parts of one evaluation can run on different machines)."""
OTHER_TASK_KEYS = {
    task: tuple(sorted({k for keys in TASK_FIELDS.values() for k in keys} - set(own)))
    for task, own in TASK_FIELDS.items()
}
"""Task settings that do not change a unit of this task (not compared on resume)."""
ANSWER_BLOCK_KEYS = ("line_blocks", "recall_blocks", "ruler_blocks")
"""The decode settings of each task's answer length: the others' do not change a unit."""


DECODE_DEFAULTS = {"first_pass": "none"}
"""Decode settings added after results were first written: an older result without one ran
with this value."""


def other_decode_keys(unit: Unit) -> tuple[str, ...]:
    """The decode settings that do not change ``unit`` (not compared on resume): the other
    tasks' answer lengths, and the first pass outside the herald units."""
    own = {"line": "line_blocks", "recall": "recall_blocks"}.get(unit.task, "ruler_blocks")
    skip = tuple(k for k in ANSWER_BLOCK_KEYS if k != own)
    return skip if unit.mode == "herald" else (*skip, "first_pass")


def check_resume(runs: Path, units: list[Unit], config: dict[str, Any]) -> None:
    """Refuse to mix settings in one --out: a finished unit run with other settings would be
    skipped and reported as if this command had run it."""
    new = json.loads(json.dumps(config))  # as it would be stored (tuples -> lists)
    for u in units:
        path = runs / f"{u.key}.json"
        if not path.is_file():
            continue
        old = json.loads(path.read_text()).get("config", {})
        diff = []
        for key in RESUME_KEYS:
            if key not in old or old[key] == new[key]:
                continue  # older results may lack a key: nothing to compare
            if key == "exclude_examples":  # only this unit's task's exclusions change it
                was = old[key] if isinstance(old[key], dict) else {u.task: old[key]}  # 1st form
                if was.get(u.task, []) != new[key].get(u.task, []):
                    diff.append(f"{key}.{u.task}: {was.get(u.task)} -> {new[key].get(u.task)}")
                continue
            if isinstance(old[key], dict) and isinstance(new[key], dict):
                skip: tuple[str, ...] = ()
                if key == "tasks":
                    skip = OTHER_TASK_KEYS.get(u.task, ())
                elif key == "decode":
                    skip = other_decode_keys(u)
                was = {**DECODE_DEFAULTS, **old[key]} if key == "decode" else old[key]
                diff += [
                    f"{key}.{k}: {was.get(k)!r} -> {new[key].get(k)!r}"
                    for k in sorted(was.keys() | new[key].keys())
                    if was.get(k) != new[key].get(k) and k not in skip and k in was
                ]
            else:
                diff.append(f"{key}: {old[key]!r} -> {new[key]!r}")
        if diff:
            raise ValueError(
                f"{path} was run with other settings ({'; '.join(diff)}); rerun with the same "
                "settings to continue, or use a new --out"
            )
