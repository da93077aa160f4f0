"""``herald train``: the training subcommand (registered by :mod:`herald.cli`).

Imports only argparse-level things at module load; the trainer (and the corpus scan) load when the
command runs.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from herald.cliargs import add_list, deprecated_alias, token_count
from herald.config import field_help
from herald.eval.ruler_formats import RULER_TASKS
from herald.train.config import (
    PRESET_STORAGE,
    PRESETS,
    RESERVE_S,
    SHAPE_FLAGS,
    ModelDims,
    TrainConfig,
    flag,
)
from herald.train.corpus import DATA_ORDERS

_RESUME_NOTE = "; on --resume, must match the checkpoint if given"
_SHAPE_HELP = {
    "hidden_size": "hidden size",
    "num_layers": "layers",
    "num_heads": "query heads",
    "num_kv_heads": "KV heads",
    "head_dim": "dims per head",
    "intermediate_size": "SwiGLU intermediate size",
}


def register(subparsers: Any) -> None:
    """Add the ``train`` subcommand to ``subparsers`` (an argparse sub-parsers action); the parsed
    namespace carries ``handler`` = :func:`cmd_train`."""
    d, m = TrainConfig(out_dir=Path(".")), ModelDims()
    p: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help="train a small SDAR block dLLM on this interpreter's third-party Python sources",
        description="Train an SDARForCausalLM block dLLM from scratch (or continue one) with the "
        "block-diffusion objective on the .py files of the installed third-party packages "
        "(the standard library is held out). Writes an HF checkpoint, a resume state and a "
        "JSON log.",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="checkpoint directory to write: a new or empty directory, the --resume checkpoint "
        "(continued in place) or, with --overwrite, an existing checkpoint",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing checkpoint directory at --out (and an existing --state-file); "
        "a directory without config.json is never replaced",
    )
    p.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="resume state written at the end: global step, tokens seen, data position and the "
        "history of runs, which --resume reads (default: OUT/../train_state.json, beside --out)",
    )
    p.add_argument(
        "--log-file",
        type=Path,
        default=None,
        help="JSON log written at the end: settings, data, loss history, timings (default: "
        "OUT/../train_log.json, beside --out)",
    )
    p.add_argument("--work-dir", type=Path, default=d.work_dir, help="token-stream cache")
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="checkpoint directory to continue (default: none, a fresh model)",
    )
    p.add_argument(
        "--resume-state",
        type=Path,
        default=None,
        help="its train_state.json (default: the one inside or beside --resume)",
    )
    p.add_argument(
        "--optimizer-file",
        type=Path,
        default=None,
        help="save fp32 weights + AdamW moments here (and restore them on --resume; default: none, "
        "moments start fresh on a resume)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--data-order",
        choices=DATA_ORDERS,
        default=d.data_order,
        help="files inside a package: package (shuffled by directory) or deps (each file after "
        "the package files it imports, as in repository-level pretraining)",
    )
    p.add_argument(
        "--seq-len", type=token_count, default=d.seq_len, help="tokens per window, e.g. 8192 or 8K"
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument(
        "--total-steps", type=int, default=None, help="cosine horizon (default: fit the budget)"
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after this many steps (default: none)"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock budget of the whole command (data, tokenizer, compile, training, save) "
        f"in minutes; --time-limit-s gives it in seconds instead (default: {d.max_minutes:g})",
    )
    budget.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the same budget in seconds, as eval and bench take it: --time-limit-s 480 is "
        "--max-minutes 8 (default: --max-minutes)",
    )
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient norm clip")
    p.add_argument("--loss-weighting", choices=["mean", "elbo"], default=d.loss_weighting)
    p.add_argument(
        "--long-range-weight",
        type=float,
        default=d.long_range_weight,
        help="loss weight of long-range tokens: name-like tokens whose n-gram last occurred at "
        "least --long-range-distance tokens earlier in the window (1 = off)",
    )
    p.add_argument("--long-range-distance", type=token_count, default=d.long_range_distance)
    p.add_argument("--long-range-ngram", type=int, default=d.long_range_ngram)
    p.add_argument(
        "--long-range-scope",
        choices=["vocab", "code"],
        default=d.long_range_scope,
        help="which tokens may be long-range: vocab (name-like vocabulary entries) or code "
        "(tokens of a Python name in code, not in strings or comments)",
    )
    p.add_argument(
        "--task-mix",
        type=float,
        default=d.task_mix,
        metavar="FRACTION",
        help="share of the training sequences that are RULER-style task instances (the tasks "
        "of herald eval --tasks ruler) with haystacks of the training corpus, never the "
        "standard library (0 = off)",
    )
    add_list(
        p, "--task-mix-tasks", choices=RULER_TASKS, default=list(d.task_mix_tasks),
        metavar="TASK", help=f"the mix's tasks, cycled in this order ({', '.join(RULER_TASKS)})",
    )  # fmt: skip
    add_list(
        p, "--task-mix-contexts", kind=token_count, default=None, metavar="C",
        help="the mix's contexts in tokens (a prompt holds at most C - 128 tokens, as in herald "
        "eval; each <= --seq-len); default: those of 4096 8192 16384 32768 that fit --seq-len, "
        "else --seq-len",
    )  # fmt: skip
    p.add_argument(
        "--task-answer-weight",
        type=float,
        default=d.task_answer_weight,
        help="loss weight of a task sequence's masked answer tokens",
    )
    p.add_argument("--task-mix-workers", type=int, default=d.task_mix_workers)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"BPE vocabulary of a fresh run (default: {d.vocab_size}{_RESUME_NOTE})",
    )
    p.add_argument("--tokenizer-sample-mb", type=float, default=d.tokenizer_sample_mb)
    p.add_argument(
        "--shape",
        choices=sorted(PRESETS),
        default=None,
        help="model shape of a fresh run: base (14.76M parameters, bf16, the default) or large "
        "(28.68M: hidden 512, 9 layers, SwiGLU 1344, int8 storage unless --storage); the shape "
        "flags below override its values",
    )
    for name in SHAPE_FLAGS:  # default None: --resume tells the given ones from the rest
        p.add_argument(
            flag(name),
            type=int,
            default=None,
            help=f"{_SHAPE_HELP[name]} of a fresh model (default: {getattr(m, name)}"
            f"{_RESUME_NOTE})",
        )
    p.add_argument(
        "--max-checkpoint-mb",
        type=float,
        default=d.max_checkpoint_mb,
        help="refuse shapes whose checkpoint tensors, in --storage, exceed this (MB; the "
        "tokenizer adds ~0.5 MB)",
    )
    p.add_argument(
        "--storage",
        choices=["bf16", "int8"],
        default=None,
        help="checkpoint tensors: bf16, or int8 with per-row scales (half the bytes: twice the "
        "parameters fit --max-checkpoint-mb); default: the resumed checkpoint's, else bf16",
    )
    p.add_argument("--max-shard-mb", type=float, default=d.max_shard_mb)
    p.add_argument("--no-compile", action="store_true", help="eager model on CUDA")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--site-dir",
        type=Path,
        action="append",
        default=None,
        help="third-party root, repeatable (default: this interpreter's site-packages)",
    )
    p.add_argument(
        "--stdlib-dir",
        type=Path,
        action="append",
        default=None,
        help="held-out stdlib root, repeatable (default: this interpreter's standard library)",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="scan processes (0 = all)")
    p.add_argument("--val-windows", type=int, default=d.val_windows)
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    for action in p._actions:  # the rest: TrainConfig's attribute docstrings
        if action.help is None:
            action.help = help_line(field_help(TrainConfig, action.dest, default=False))
    deprecated_alias(p, "--preset", "--shape")
    p.set_defaults(handler=cmd_train)


def help_line(doc: str) -> str:
    """An attribute docstring as option help, in the style of the others: lower-case start (not
    of an acronym such as MB) and no trailing period."""
    text = doc.strip().removesuffix(".")
    if len(text) > 1 and text[0].isupper() and not text[1].isupper():
        text = text[0].lower() + text[1:]
    return text


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` of parsed ``herald train`` arguments (defaults for the model-shape
    flags not given)."""
    shape: dict[str, Any] = dict(PRESETS[args.shape]) if args.shape else {}
    shape.update({n: getattr(args, n) for n in SHAPE_FLAGS if getattr(args, n) is not None})
    dims = ModelDims(**shape)
    storage = args.storage
    if storage is None and args.shape is not None and args.resume is None:
        storage = PRESET_STORAGE[args.shape]
    return TrainConfig(
        out_dir=args.out,
        state_file=args.state_file,
        log_file=args.log_file,
        work_dir=args.work_dir,
        resume=args.resume,
        resume_state=args.resume_state,
        optimizer_file=args.optimizer_file,
        seed=args.seed,
        data_order=args.data_order,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        total_steps=args.total_steps,
        max_steps=args.max_steps,
        max_minutes=max_minutes(args),
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        loss_weighting=args.loss_weighting,
        long_range_weight=args.long_range_weight,
        long_range_distance=args.long_range_distance,
        long_range_ngram=args.long_range_ngram,
        long_range_scope=args.long_range_scope,
        log_every=args.log_every,
        vocab_size=TrainConfig.vocab_size if args.vocab_size is None else args.vocab_size,
        tokenizer_sample_mb=args.tokenizer_sample_mb,
        dims=dims,
        max_checkpoint_mb=args.max_checkpoint_mb,
        storage=storage,
        max_shard_mb=args.max_shard_mb,
        compile=not args.no_compile,
        device=args.device,
        site_dirs=args.site_dir,
        stdlib_dirs=args.stdlib_dir,
        workers=args.workers,
        val_windows=args.val_windows,
        overwrite=args.overwrite,
        task_mix=args.task_mix,
        task_mix_tasks=tuple(args.task_mix_tasks),
        task_mix_contexts=tuple(args.task_mix_contexts) if args.task_mix_contexts else None,
        task_answer_weight=args.task_answer_weight,
        task_mix_workers=args.task_mix_workers,
    )


def max_minutes(args: argparse.Namespace) -> float:
    """The wall budget in minutes: ``--max-minutes``, ``--time-limit-s`` / 60, or the default.

    Raises:
        ValueError: a ``--time-limit-s`` that leaves no time to train (named as given).
    """
    seconds = args.time_limit_s
    if seconds is None:
        return TrainConfig.max_minutes if args.max_minutes is None else float(args.max_minutes)
    if not (math.isfinite(seconds) and seconds > RESERVE_S):
        raise ValueError(
            f"--time-limit-s must be more than {RESERVE_S:g} (the last {RESERVE_S:g} s are kept "
            f"for validation and the save), got {seconds:g}"
        )
    return seconds / 60.0


def explicit_shape_flags(args: argparse.Namespace) -> set[str]:
    """The model-shape fields (``vocab_size`` included) given on the command line, those of a
    ``--shape`` among them (a resumed run refuses a shape that differs from its own)."""
    given = {n for n in (*SHAPE_FLAGS, "vocab_size") if getattr(args, n, None) is not None}
    shape = getattr(args, "shape", None)
    if shape is not None:
        given |= set(PRESETS[shape]) or {"hidden_size"}
    return given


def cmd_train(args: argparse.Namespace) -> int:
    """Run :func:`herald.train.trainer.train` (which checks everything it can before any work);
    returns the exit code (0)."""
    from herald.train.trainer import train

    train(config_from_args(args), explicit=explicit_shape_flags(args))
    return 0
