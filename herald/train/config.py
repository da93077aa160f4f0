"""Training configuration: the model's shape and the run's hyper-parameters.

:class:`ModelDims` is the default code model, an ``SDARForCausalLM`` (Qwen3-style, QK-norm,
SwiGLU, full RoPE) small enough to live in the repo: vocab 8192, hidden 384, 8 layers, 8 query
heads sharing 2 KV heads (4 per KV head, like SDAR-8B and LLaDA2.0-mini) of 64 dims, SwiGLU 832,
tied input/output embeddings (the Qwen3 ``tie_word_embeddings`` switch, which the small Qwen3
configs use; SDAR-8B unties them), RoPE theta 1e6 as SDAR, ``max_position_embeddings`` 32768.
That is 14.76 M parameters, 29.5 MB in bf16.

:class:`TrainConfig` holds everything else; its attribute docstrings are the ``herald train``
help texts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from herald.eval.ruler_formats import RULER_TASKS, RulerConfig
from herald.models.config import SDAR_ARCH, ModelConfig
from herald.models.quant import STORAGES, checkpoint_storage, stored_bytes
from herald.models.registry import count_params, weight_specs
from herald.train.corpus import DATA_ORDERS
from herald.train.objective import LossWeighting
from herald.train.tokenizer_train import EOS_ID, MASK_ID, MAX_VOCAB, MIN_VOCAB, PAD_ID

BLOCK_SIZE = 32
DEFAULT_MAX_CHECKPOINT_MB = 30.0
RESERVE_S = 20.0
"""Wall time the training loop keeps for validation and the save (seconds)."""

SHAPE_FLAGS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
)
"""The :class:`ModelDims` fields that ``herald train`` has flags for (``--hidden-size`` ...); they
have the same names in :class:`ModelConfig`."""


@dataclass(frozen=True)
class ModelDims:
    """Shape of a fresh model. On ``--resume`` the checkpoint's config is kept; a value given
    that differs from it is refused (:func:`herald.train.preflight.check_resume_shape`)."""

    hidden_size: int = 384
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 832
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02


EVAL_CONTEXTS = (4096, 8192, 16384, 32768)
"""The contexts ``herald eval`` runs the RULER-style tasks at (the task mix's default)."""

PRESETS: dict[str, dict[str, int]] = {
    "base": {},
    "large": {"hidden_size": 512, "num_layers": 9, "intermediate_size": 1344},
}
"""``herald train --shape``: model shapes (changes from :class:`ModelDims`). ``base`` is the
14.76 M-parameter default (29.5 MB in bf16); ``large`` has 28.68 M parameters, stored as int8
with per-row scales (28.9 MB): about twice the parameters in the same checkpoint budget."""
PRESET_STORAGE = {"base": "bf16", "large": "int8"}
"""The storage a shape implies when ``--storage`` is not given (and the run is fresh)."""


def model_config(dims: ModelDims, vocab_size: int, block_size: int = BLOCK_SIZE) -> ModelConfig:
    """The :class:`ModelConfig` (and its HF ``config.json`` dict) of an SDAR model of ``dims``
    with the trained tokenizer's special ids (EOS 0, pad 1, mask 2).

    Raises:
        ConfigError: inconsistent dims (e.g. heads not a multiple of KV heads).
    """
    hf: dict[str, Any] = {
        "architectures": [SDAR_ARCH],
        "model_type": "sdar",
        "hidden_size": dims.hidden_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "intermediate_size": dims.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": dims.max_position_embeddings,
        "rope_theta": dims.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": dims.tie_word_embeddings,
        "attention_bias": False,
        "initializer_range": dims.initializer_range,
        "bos_token_id": None,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "mask_token_id": MASK_ID,
        "eos_token_ids": [EOS_ID],
        "block_size": block_size,
        "torch_dtype": "bfloat16",
    }
    return ModelConfig.from_hf(hf)


def check_checkpoint_size(
    config: ModelConfig, max_mb: float, storage: str = "bf16", *, resumed: bool = False
) -> int:
    """Tensor bytes of the checkpoint of ``config`` stored as ``storage`` (``bf16``, or ``int8``:
    see :mod:`herald.models.quant`); the tokenizer files (~0.5 MB) come on top.

    Raises:
        ValueError: more than ``max_mb`` * 1e6 bytes, or an unknown ``storage``.
    """
    nbytes = stored_bytes([spec.shape for spec in weight_specs(config)], storage)
    if nbytes > max_mb * 1e6:
        if resumed:  # the shape is the checkpoint's
            hint = "keep the checkpoint's storage (drop --storage)" if storage == "bf16" else ""
            hint = hint or "raise --max-checkpoint-mb"
        else:
            hint = "shrink the dims"
            hint += "" if storage == "int8" else " or store it as int8 (--storage)"
        raise ValueError(
            f"model has {count_params(config) / 1e6:.2f} M parameters = {nbytes / 1e6:.1f} MB in "
            f"{storage}, over the {max_mb:g} MB checkpoint budget (--max-checkpoint-mb); {hint}"
        )
    return nbytes


def effective_storage(cfg: TrainConfig) -> str:
    """``cfg.storage``, else the resumed checkpoint's storage, else bf16."""
    if cfg.storage is not None:
        return cfg.storage
    if cfg.resume is not None and Path(cfg.resume).is_dir():
        return checkpoint_storage(cfg.resume)
    return "bf16"


@dataclass
class TrainConfig:
    """One ``herald train`` run."""

    out_dir: Path
    """Checkpoint directory to write (config.json, safetensors, tokenizer files)."""
    state_file: Path | None = None
    """Resume state to write (default: ``<out_dir>/../train_state.json``)."""
    log_file: Path | None = None
    """Final JSON log (default: ``<out_dir>/../train_log.json``)."""
    work_dir: Path = Path("/tmp/herald-train")
    """Cache directory for the tokenized corpus (uint16 memmaps)."""
    resume: Path | None = None
    """Checkpoint directory to continue from (its config and tokenizer are kept)."""
    resume_state: Path | None = None
    """State file of the run being continued (default: next to or inside ``resume``)."""
    optimizer_file: Path | None = None
    """Where to save AdamW's moments at the end and read them on resume (optional; ~4x the
    checkpoint, so not in the repo). Without it a resumed run restarts the moments."""
    seed: int = 0
    """Seed of everything: data order, tokenizer sample, init, noise."""
    data_order: str = "package"
    """Files inside a package: ``package`` (directories and files shuffled) or ``deps`` (each
    file after the package files it imports): :func:`herald.train.corpus.order_documents`."""
    seq_len: int = 8192
    """Tokens per training window (a multiple of the block size)."""
    batch_size: int = 4
    """Windows per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine floor, as a fraction of ``lr``."""
    warmup_steps: int = 100
    """Linear warm-up steps at the start of every run (fresh or resumed)."""
    total_steps: int | None = None
    """Cosine horizon of this run; default: calibrated after the first steps to fit
    ``max_minutes`` (the value used is logged and saved)."""
    max_steps: int | None = None
    """Stop this run after this many steps."""
    max_minutes: float = 8.0
    """Wall budget of the whole command (data, tokenizer, compile, training, save), minutes."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    noise_eps: float = 1e-3
    """Per-block mask ratio t ~ U(noise_eps, 1)."""
    loss_weighting: LossWeighting = "mean"
    """'mean': mean CE over masked tokens; 'elbo': sum(CE / t) / tokens."""
    long_range_weight: float = 1.0
    """Loss weight of long-range tokens (1 = off): name-like tokens whose n-gram last occurred
    at least ``long_range_distance`` tokens earlier in the window
    (:func:`herald.train.objective.long_range_tokens`), a signal to use far context."""
    long_range_distance: int = 512
    """Tokens back that make a repeat long-range (512: beyond the eval's no-context control)."""
    long_range_ngram: int = 3
    """N-gram length of the repeat (1-3 with an 8K vocabulary at 16K tokens: exact int64 keys)."""
    long_range_scope: str = "vocab"
    """Which tokens may be long-range: ``vocab`` (name-like vocabulary entries) or
    ``code`` (tokens of a name in code, not in strings or comments;
    :mod:`herald.train.code_names`)."""
    log_every: int = 20
    """Progress line every N steps."""
    vocab_size: int = 8192
    """BPE vocabulary, special tokens included (fresh runs)."""
    tokenizer_sample_mb: float = 48.0
    """MB of documents the BPE is trained on (seeded sample)."""
    dims: ModelDims = field(default_factory=ModelDims)
    max_checkpoint_mb: float = DEFAULT_MAX_CHECKPOINT_MB
    """Refuse model shapes whose checkpoint tensors, in the run's storage, are larger (MB)."""
    storage: str | None = None
    """Checkpoint tensors: ``bf16``, or ``int8`` (per-row scales, :mod:`herald.models.quant`: about
    half the bytes, so twice the parameters fit the budget); default: the resumed checkpoint's,
    else bf16."""
    max_shard_mb: float = 15.0
    """Largest weights file in MiB: a larger checkpoint is split into shards listed by
    model.safetensors.index.json."""
    compile: bool = True
    """torch.compile the model + flex_attention + loss on CUDA."""
    device: str | None = None
    """cuda or cpu (default: cuda when available)."""
    site_dirs: list[Path] | None = None
    """Third-party roots to read (default: this interpreter's site directories)."""
    stdlib_dirs: list[Path] | None = None
    """Standard-library roots, held out (default: this interpreter's)."""
    workers: int = 0
    """Processes for the corpus scan (0 = all cores)."""
    val_windows: int = 8
    """Held-out stdlib windows for the final validation loss (0 = skip)."""
    task_mix: float = 0.0
    """Share of the training sequences that are RULER-style task instances with haystacks of
    the training corpus (0 = off; :mod:`herald.train.task_mix`)."""
    task_mix_tasks: tuple[str, ...] = RULER_TASKS
    """The tasks of the mix (cycled in this order)."""
    task_mix_contexts: tuple[int, ...] | None = None
    """The mix's contexts C (the prompt holds at most C - 128 tokens, as in ``herald eval``);
    default: those of 4096, 8192, 16384, 32768 that fit ``seq_len`` (else ``seq_len``)."""
    task_answer_weight: float = 32.0
    """Loss weight of a task sequence's answer tokens (when masked): the answer is ~10 of a
    sequence's thousands of tokens and the only ones that need the far context."""
    task_mix_workers: int = 4
    """Processes that build the task sequences ahead of the training steps (0 = in the loop)."""
    overwrite: bool = False
    """Replace an existing checkpoint directory at ``out_dir`` (and an existing state file).
    Without it, a non-empty ``out_dir`` is refused unless it is the checkpoint being resumed;
    with it, a non-empty directory without ``config.json`` is still refused."""


def flag(name: str) -> str:
    """The ``herald train`` flag of a :class:`TrainConfig` / :class:`ModelDims` field name."""
    special = {"out_dir": "--out", "site_dirs": "--site-dir", "stdlib_dirs": "--stdlib-dir"}
    return special.get(name, "--" + name.replace("_", "-"))


LONG_RANGE_SCOPES = ("vocab", "code")


def long_range_key_fits(vocab_size: int, ngram: int, seq_len: int) -> bool:
    """Whether :func:`herald.train.objective.long_range_tokens` can pack every n-gram of a
    ``seq_len`` window into one exact int64 key."""
    return bool(vocab_size**ngram * seq_len < 2**62)


def check_values(cfg: TrainConfig) -> None:
    """Check every value of ``cfg`` on its own (no file system, no model): run before any work.

    Raises:
        ValueError: the first bad value, naming its flag.
    """

    def need(ok: bool, name: str, what: str) -> None:
        if not ok:
            value = getattr(cfg.dims, name) if name in _DIM_NAMES else getattr(cfg, name)
            raise ValueError(f"{flag(name)} must be {what}, got {value!r}")

    def finite(x: float) -> bool:
        return isinstance(x, int | float) and math.isfinite(x)

    need(cfg.seq_len >= 1, "seq_len", "positive")
    need(cfg.data_order in DATA_ORDERS, "data_order", f"one of {', '.join(DATA_ORDERS)}")
    need(cfg.batch_size >= 1, "batch_size", ">= 1")
    need(finite(cfg.lr) and cfg.lr > 0, "lr", "a positive number")
    need(finite(cfg.min_lr_ratio) and 0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]")
    need(cfg.warmup_steps >= 0, "warmup_steps", ">= 0")
    need(cfg.total_steps is None or cfg.total_steps >= 1, "total_steps", ">= 1")
    need(cfg.max_steps is None or cfg.max_steps >= 1, "max_steps", ">= 1")
    need(
        finite(cfg.max_minutes) and 60.0 * cfg.max_minutes > RESERVE_S,
        "max_minutes",
        f"more than {RESERVE_S / 60:.2f} (the last {RESERVE_S:g} s are kept for validation and "
        "the save)",
    )
    need(finite(cfg.weight_decay) and cfg.weight_decay >= 0, "weight_decay", ">= 0")
    need(finite(cfg.beta1) and 0 <= cfg.beta1 < 1, "beta1", "in [0, 1)")
    need(finite(cfg.beta2) and 0 <= cfg.beta2 < 1, "beta2", "in [0, 1)")
    need(cfg.grad_clip > 0, "grad_clip", "positive")
    need(finite(cfg.noise_eps) and 0 < cfg.noise_eps < 1, "noise_eps", "in (0, 1)")
    need(cfg.loss_weighting in ("mean", "elbo"), "loss_weighting", "'mean' or 'elbo'")
    need(
        finite(cfg.long_range_weight) and cfg.long_range_weight > 0, "long_range_weight", "positive"
    )
    need(cfg.long_range_distance >= 1, "long_range_distance", ">= 1")
    need(1 <= cfg.long_range_ngram <= 3, "long_range_ngram", "in [1, 3]")
    need(cfg.long_range_scope in LONG_RANGE_SCOPES, "long_range_scope", "'vocab' or 'code'")
    if cfg.long_range_weight != 1.0:
        need(
            cfg.long_range_distance < cfg.seq_len,
            "long_range_distance",
            f"below --seq-len {cfg.seq_len} (no repeat can be that far back)",
        )
        need(
            long_range_key_fits(cfg.vocab_size, cfg.long_range_ngram, cfg.seq_len),
            "long_range_ngram",
            f"small enough that vocab_size ** ngram x seq_len fits an int64 key (vocab "
            f"{cfg.vocab_size}, seq_len {cfg.seq_len})",
        )
    need(cfg.log_every >= 1, "log_every", ">= 1")
    need(cfg.storage is None or cfg.storage in STORAGES, "storage", f"one of {STORAGES}")
    need(MIN_VOCAB <= cfg.vocab_size <= MAX_VOCAB, "vocab_size", f"in [{MIN_VOCAB}, {MAX_VOCAB}]")
    need(
        finite(cfg.tokenizer_sample_mb) and cfg.tokenizer_sample_mb > 0,
        "tokenizer_sample_mb",
        "positive",
    )
    for name in SHAPE_FLAGS:
        need(getattr(cfg.dims, name) >= 1, name, ">= 1")
    need(cfg.dims.head_dim % 2 == 0, "head_dim", "even (RoPE rotates pairs of dims)")
    need(
        cfg.dims.num_heads % cfg.dims.num_kv_heads == 0,
        "num_heads",
        f"a multiple of --num-kv-heads {cfg.dims.num_kv_heads}",
    )
    need(
        finite(cfg.max_checkpoint_mb) and cfg.max_checkpoint_mb > 0, "max_checkpoint_mb", "positive"
    )
    need(finite(cfg.max_shard_mb) and cfg.max_shard_mb > 0, "max_shard_mb", "positive")
    check_task_mix(cfg)
    need(cfg.workers >= 0, "workers", ">= 0")
    need(cfg.val_windows >= 0, "val_windows", ">= 0")


_DIM_NAMES = frozenset(f.name for f in fields(ModelDims))


def task_mix_contexts(cfg: TrainConfig) -> tuple[int, ...]:
    """The contexts of the task mix (:attr:`TrainConfig.task_mix_contexts` or its default)."""
    if cfg.task_mix_contexts:
        return tuple(cfg.task_mix_contexts)
    return tuple(c for c in EVAL_CONTEXTS if c <= cfg.seq_len) or (cfg.seq_len,)


def check_task_mix(cfg: TrainConfig) -> None:
    """The task-mix values of ``cfg`` (any values while the mix is off but the fraction).

    Raises:
        ValueError: the first bad value, naming its flag.
    """
    f = cfg.task_mix
    if not (isinstance(f, int | float) and math.isfinite(f) and 0 <= f <= 1):
        raise ValueError(f"--task-mix must be in [0, 1], got {f!r}")
    if f == 0:
        return
    bad = [t for t in cfg.task_mix_tasks if t not in RULER_TASKS]
    if bad or not cfg.task_mix_tasks:
        raise ValueError(f"--task-mix-tasks: unknown {bad or 'none given'}; one of {RULER_TASKS}")
    room = RulerConfig().answer_tokens
    for c in task_mix_contexts(cfg):
        if not room < c <= cfg.seq_len:
            raise ValueError(
                f"--task-mix-contexts {c} must lie in ({room}, --seq-len {cfg.seq_len}]"
            )
    if cfg.task_mix_workers < 0:
        raise ValueError(f"--task-mix-workers must be >= 0, got {cfg.task_mix_workers}")
    w = cfg.task_answer_weight
    if not (isinstance(w, int | float) and math.isfinite(w) and w > 0):
        raise ValueError(f"--task-answer-weight must be positive, got {w!r}")
