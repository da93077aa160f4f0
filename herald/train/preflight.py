"""Checks of a ``herald train`` run that happen before any work (corpus scan, tokenizer training).

:func:`preflight` runs them all: every value on its own (:func:`herald.train.config.check_values`),
the device, the checkpoint being resumed (its config, tokenizer, weights files and state file;
model-shape values that differ from it), the sequence length against the model's block size and
positions, the checkpoint size budget, and the paths written at the end: ``--out`` must not hold
anything the save would destroy (:func:`check_out`), nor may the state file of another run be
replaced (:func:`check_state_file`). Each failure is one exception whose message names the flag.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import tokenizers

from herald.config import resolve_device
from herald.models.config import ConfigError, ModelConfig
from herald.models.loader import CheckpointError, check_tensors, checkpoint_tensors
from herald.models.quant import checkpoint_storage
from herald.models.registry import weight_specs
from herald.train.checkpoint import find_resume_state, read_json
from herald.train.config import (
    SHAPE_FLAGS,
    TrainConfig,
    check_checkpoint_size,
    check_values,
    effective_storage,
    flag,
    model_config,
)
from herald.train.tokenizer_train import check_special_ids


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def resumed_config(cfg: TrainConfig) -> ModelConfig | None:
    """The config of the ``--resume`` checkpoint (None for a fresh run), after checking that the
    checkpoint has a tokenizer written by ``herald train`` and readable weights that fit its
    config (:func:`check_resume_files`), and that the state file (if any) is readable.

    Raises:
        FileNotFoundError: the directory, its config.json / tokenizer.json / weights or
            ``--resume-state`` missing.
        ValueError: a bad config.json, tokenizer, weights file or state file.
    """
    if cfg.resume is None:
        if cfg.resume_state is not None:
            raise ValueError("--resume-state needs --resume")
        return None
    resume = cfg.resume
    if not resume.is_dir():
        raise FileNotFoundError(f"--resume {resume} is not a directory")
    if not (resume / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--resume {resume} has no tokenizer.json")
    try:
        config = ModelConfig.from_file(resume)
        checkpoint_storage(resume)  # an unsupported quantization is refused here, not at load
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"--resume: {e}") from None
    check_resume_files(resume, config)
    try:
        state_file = find_resume_state(resume, cfg.resume_state)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume-state: {e}") from None
    if state_file is not None:
        try:
            read_json(state_file)
        except ValueError as e:  # JSON syntax, or not a JSON object
            raise ValueError(f"the resume state {state_file} is unreadable: {e}") from None
    return config


def check_resume_files(resume: Path, config: ModelConfig) -> None:
    """The ``--resume`` checkpoint's tokenizer is one ``herald train`` writes (its special tokens
    at the ids the trainer uses) and its weights files are readable safetensors holding the
    tensors of ``config`` (headers only: no tensor data is read).

    Raises:
        FileNotFoundError: no weights file, or a shard of the index missing.
        ValueError: an unreadable or foreign tokenizer, a truncated or corrupted weights file,
            tensors missing or of the wrong shape; each names the file.
    """
    hint = (
        "--resume continues a checkpoint written by herald train (not, e.g., one of herald "
        "init-random or another model); leave out --resume to train a fresh model"
    )
    tok_file = resume / "tokenizer.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception on a parse error
        raise ValueError(f"--resume: {tok_file} is not a readable tokenizer ({e})") from None
    try:
        check_special_ids(backend)
    except ValueError as e:
        raise ValueError(f"--resume: {tok_file}: {e}; {hint}") from None
    try:
        found = checkpoint_tensors(resume)
        check_tensors(weight_specs(config), found, resume, checkpoint_storage(resume))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume: {e}") from None
    except CheckpointError as e:
        raise ValueError(f"--resume: {e}") from None


def check_resume_shape(
    cfg: TrainConfig, resumed: ModelConfig, explicit: Collection[str] | None = None
) -> None:
    """Refuse model-shape values that differ from the checkpoint being resumed (which keeps its
    own shape and tokenizer).

    Args:
        explicit: field names the user gave (``herald train`` passes its flags given on the
            command line, ``vocab_size`` included); None: the :data:`SHAPE_FLAGS` fields of
            ``cfg.dims`` that differ from the :class:`ModelDims` defaults.

    Raises:
        ValueError: the first such value, naming its flag and the checkpoint's value.
    """
    defaults = type(cfg.dims)()
    if explicit is None:
        explicit = [n for n in SHAPE_FLAGS if getattr(cfg.dims, n) != getattr(defaults, n)]
    for name in (*SHAPE_FLAGS, "vocab_size"):
        if name not in explicit:
            continue
        given = cfg.vocab_size if name == "vocab_size" else getattr(cfg.dims, name)
        have = getattr(resumed, name)
        if given != have:
            raise ValueError(
                f"{flag(name)} {given} differs from the resumed checkpoint {cfg.resume} "
                f"({name} {have}); a resumed run keeps the checkpoint's shape: drop "
                f"{flag(name)} or start a fresh run"
            )


def check_seq_len(cfg: TrainConfig, config: ModelConfig) -> None:
    """``--seq-len`` must be a multiple of the block size, within the model's positions."""
    block = config.block_size
    if cfg.seq_len % block:
        lo, hi = cfg.seq_len // block * block, (cfg.seq_len // block + 1) * block
        hint = f"e.g. {lo} or {hi}" if lo else f"e.g. {hi}"
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not a multiple of the block size {block} ({hint})"
        )
    if cfg.seq_len > config.max_position_embeddings:
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not (p.exists() or p.is_symlink()) and p != p.parent:
        p = p.parent
    return p


def check_out(cfg: TrainConfig) -> None:
    """``--out`` may be a new path, an empty directory, the checkpoint being resumed (continued
    in place), or with ``--overwrite`` an existing herald checkpoint (a directory with
    ``config.json``); never a file nor a directory of other data, which the save would destroy.

    Raises:
        FileExistsError: ``--out`` holds something it may not replace.
        NotADirectoryError: a parent of ``--out`` is a file.
        PermissionError: the directory that would hold ``--out`` is not writable.
    """
    out = cfg.out_dir
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise FileExistsError(
                f"--out {out} exists and is not a directory; give the path of a checkpoint "
                "directory to create"
            )
        entries = sorted(p.name for p in out.iterdir())
        if entries and not (cfg.resume is not None and _same(cfg.resume, out)):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            if not (out / "config.json").is_file():
                raise FileExistsError(
                    f"--out {out} is a non-empty directory ({shown}) that is not a herald "
                    "checkpoint (no config.json); refusing to replace it, even with "
                    "--overwrite: choose a new or empty directory"
                )
            if not cfg.overwrite:
                raise FileExistsError(
                    f"--out {out} already holds a checkpoint; pass --overwrite to replace it, "
                    "--resume it to continue it in place, or choose a new directory"
                )
    else:
        anc = _existing_ancestor(out.parent)
        if not anc.is_dir():
            raise NotADirectoryError(f"--out {out}: {anc} is not a directory")
    holder = _existing_ancestor(out.parent)
    if holder.is_dir() and not os.access(holder, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out}: cannot write in {holder}")


def state_path(cfg: TrainConfig) -> Path:
    """Where the run writes its resume state (``--state-file``, default beside ``--out``)."""
    return cfg.state_file or cfg.out_dir.parent / "train_state.json"


def log_path(cfg: TrainConfig) -> Path:
    """Where the run writes its JSON log (``--log-file``, default beside ``--out``)."""
    return cfg.log_file or cfg.out_dir.parent / "train_log.json"


def check_state_file(cfg: TrainConfig) -> None:
    """The state file written at the end holds the history of runs: it may replace only the
    state of the run being resumed, unless ``--overwrite``.

    Raises:
        FileExistsError: it holds another run's state.
        IsADirectoryError: it, ``--log-file`` or ``--optimizer-file`` is a directory.
    """
    for name, path in (
        ("--state-file", state_path(cfg)),
        ("--log-file", log_path(cfg)),
        ("--optimizer-file", cfg.optimizer_file),
    ):
        if path is not None and path.is_dir():
            raise IsADirectoryError(f"{name} {path} is a directory")
    target = state_path(cfg)
    if not target.exists() or cfg.overwrite:
        return
    if cfg.resume is not None:
        source = find_resume_state(cfg.resume, cfg.resume_state)
        if source is not None and _same(source, target):
            return
    raise FileExistsError(
        f"--state-file {target} (default: beside --out) already holds the state of another run; "
        "pass --overwrite to replace it, or choose another --out or --state-file"
    )


def preflight(cfg: TrainConfig, explicit: Collection[str] | None = None) -> ModelConfig:
    """All the checks of the module docstring, cheapest first; returns the model config the run
    will have (the resumed checkpoint's, or the fresh one at the requested vocabulary size).

    Args:
        explicit: see :func:`check_resume_shape`.
    """
    check_values(cfg)
    resolve_device(cfg.device)
    resumed = resumed_config(cfg)
    if resumed is not None:
        check_resume_shape(cfg, resumed, explicit)
        config = resumed
    else:
        config = model_config(cfg.dims, cfg.vocab_size)
    check_seq_len(cfg, config)
    check_checkpoint_size(
        config, cfg.max_checkpoint_mb, effective_storage(cfg), resumed=resumed is not None
    )
    if cfg.work_dir.exists() and not cfg.work_dir.is_dir():
        raise NotADirectoryError(f"--work-dir {cfg.work_dir} is not a directory")
    check_out(cfg)
    check_state_file(cfg)
    return config
