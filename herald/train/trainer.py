"""The training loop: data, model, AdamW, schedule, wall budget, checkpoint and logs.

One call of :func:`train` is one *run*: it prepares the data (:mod:`herald.train.data`), builds a
fresh model or loads ``--resume``, trains until ``max_steps`` or the wall budget, evaluates the
held-out stdlib windows, and writes the checkpoint (:mod:`herald.train.checkpoint`), the resume
state and a JSON log (:mod:`herald.train.run_outputs`). Runs continue one another through the
resume state: global step, tokens seen and the data position carry over; the learning-rate
schedule (:mod:`herald.train.schedule`) is per run (linear warm-up, then cosine to
``min_lr_ratio * lr`` over the run's horizon), so a resumed run re-warms its fresh (or reloaded)
AdamW moments.

Precision: float32 master weights, bf16 autocast on CUDA (q/k/v cast to bf16 for flex_attention),
float32 logits and loss. On CUDA the model, flex_attention and the loss are compiled as one
module; on CPU (tests) everything runs eagerly with the dense mask.

Reproducibility: python/numpy/torch seeded from ``seed``; the noise of global step ``s`` comes from
a generator seeded with ``(seed, s)``; the data order from ``(seed, epoch)``. With the optimizer
file (float32 weights and AdamW moments) and a constant learning rate, a run of 2N steps and a run
of N steps resumed for N more give the same weights on CPU (tests/train/test_trainer.py). Without
it, a resumed run starts from the checkpoint's bf16 weights with fresh moments.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import tokenizers
import torch

from herald.config import resolve_device
from herald.models.common import DecoderLM
from herald.models.config import ModelConfig
from herald.models.loader import load_model
from herald.models.registry import build_model
from herald.train.checkpoint import find_resume_state, read_json, stored_weights
from herald.train.config import (
    RESERVE_S,
    TrainConfig,
    check_checkpoint_size,
    count_params,
    effective_storage,
    long_range_key_fits,
    model_config,
)
from herald.train.data import PreparedData, WindowSampler, prepare_data
from herald.train.objective import (
    BlockDiffusionLoss,
    DenseDiffusionAttention,
    FlexDiffusionAttention,
    check_flex_matches_dense,
    dense_block_diffusion_mask,
    flex_block_mask,
    long_range_tokens,
    loss_weights,
    name_token_mask,
    sample_noise,
)
from herald.train.preflight import check_seq_len, preflight
from herald.train.run_outputs import save_run
from herald.train.schedule import build_optimizer, lr_at, noise_generator, seed_everything
from herald.train.task_mix import TaskMixer, mixer_for
from herald.train.tokenizer_train import as_herald_tokenizer

CALIBRATION_STEPS = 8  # steps (after the compiling ones) timed to fit the horizon to the budget
VAL_SEED = 1234


class Run:
    """State of one run (see the module docstring); :func:`train` drives it."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.log = log
        self.t0 = time.monotonic()
        self.deadline = self.t0 + 60.0 * cfg.max_minutes
        self.state: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}

    # ---- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        seed_everything(cfg.seed)
        resume_backend: tokenizers.Tokenizer | None = None
        if cfg.resume is not None:
            tok_file = cfg.resume / "tokenizer.json"
            if not tok_file.is_file():
                raise FileNotFoundError(f"--resume {cfg.resume} has no tokenizer.json")
            resume_backend = tokenizers.Tokenizer.from_file(str(tok_file))
            state_file = find_resume_state(cfg.resume, cfg.resume_state)
            self.state = read_json(state_file) if state_file else {}
            if state_file is None:
                self.log(f"WARNING: no train_state.json for {cfg.resume}: data position 0")
        workers = cfg.workers or os.cpu_count() or 1
        # NOTE: the scan forks worker processes: it must run before CUDA is initialised.
        self.data: PreparedData = prepare_data(
            seed=cfg.seed,
            seq_len=cfg.seq_len,
            work_dir=cfg.work_dir,
            backend=resume_backend,
            vocab_size=cfg.vocab_size,
            tokenizer_sample_bytes=int(cfg.tokenizer_sample_mb * 1e6),
            val_windows=cfg.val_windows,
            site_dirs=cfg.site_dirs,
            stdlib_dirs=cfg.stdlib_dirs,
            workers=workers,
            order=cfg.data_order,
            code_names=cfg.long_range_weight != 1.0 and cfg.long_range_scope == "code",
            keep_corpus=cfg.task_mix > 0,
            log=self.log,
        )
        self.tokenizer = as_herald_tokenizer(self.data.backend)
        self.task_mix = mixer_for(cfg, self.data, self.tokenizer)
        self.data.corpus = self.data.stdlib = None  # the mix holds what it needs
        if self.task_mix is not None:
            ahead = 4 * cfg.batch_size + math.ceil(2 * cfg.task_mix_workers / cfg.task_mix)
            self.task_mix.start_workers(cfg.task_mix_workers, ahead)  # forks: before CUDA
            src = self.task_mix.source
            self.log(
                f"task mix: {cfg.task_mix:.0%} of the sequences are "
                f"{', '.join(cfg.task_mix_tasks)} at contexts {list(self.task_mix.contexts)}; "
                f"haystacks from {len(src)} training files ({src.dropped} equal to a stdlib "
                f"file left out); answer weight {cfg.task_answer_weight:g}"
            )
        self.device = resolve_device(cfg.device)
        old = self.state.get("data_manifest_sha256")
        if old is not None and old != self.data.manifest["contents_sha256"]:
            self.log("WARNING: the corpus differs from the resumed run's; data order differs")
        old_order = self.state.get("data_order", "package")
        if self.state and old_order != cfg.data_order:
            self.log(
                f"NOTE: data order {cfg.data_order} (the resumed run used {old_order}): the data "
                "position carries over into the new order's stream"
            )
        position = int(self.state.get("data_position", 0))
        old_len = int(self.state.get("seq_len", cfg.seq_len))
        position = position * old_len // cfg.seq_len
        self.sampler = WindowSampler(
            self.data.stream, cfg.seq_len, cfg.seed, position, aux=self.data.code_names
        )
        self.run_start = self.sampler.position
        self.global_step = int(self.state.get("global_step", 0))
        self.tokens_seen = int(self.state.get("tokens_seen", 0))
        self._build_model()

    def _build_model(self) -> None:
        cfg, dev = self.cfg, self.device
        resumed: DecoderLM | None = None
        if cfg.resume is not None:
            resumed, config, _ = load_model(cfg.resume, device=dev, dtype=torch.float32)
        else:
            config = model_config(cfg.dims, self.data.backend.get_vocab_size())
        self.storage = effective_storage(cfg)
        self.checkpoint_bytes = check_checkpoint_size(config, cfg.max_checkpoint_mb, self.storage)
        model = resumed or build_model(config, dev, torch.float32, seed=cfg.seed)
        check_seq_len(cfg, config)  # preflight checked it; the trained vocabulary changes no size
        self.config: ModelConfig = config
        self.model: DecoderLM = model
        # long-range emphasis: which vocabulary entries are name-like (off: None)
        self.name_tokens: torch.Tensor | None = None
        self.long_range_fraction: list[torch.Tensor] = []  # flagged share, per step (no sync)
        if cfg.long_range_weight != 1.0:
            if not long_range_key_fits(config.vocab_size, cfg.long_range_ngram, cfg.seq_len):
                raise ValueError(
                    f"--long-range-ngram {cfg.long_range_ngram}: the model's vocabulary "
                    f"({config.vocab_size}) ** ngram x --seq-len {cfg.seq_len} overflows the "
                    "int64 n-gram key; use a smaller --long-range-ngram"
                )
            tok = self.tokenizer
            self.name_tokens = name_token_mask(
                lambda ids: tok.decode(ids, skip_special_tokens=True), config.vocab_size
            ).to(dev)
        model.requires_grad_(True)
        model.train()
        self.optimizer = build_optimizer(model, cfg, dev)
        opt_file = cfg.optimizer_file
        if opt_file is not None and cfg.resume is not None and opt_file.is_file():
            saved = torch.load(opt_file, map_location=dev, weights_only=True)
            if int(saved.get("global_step", -1)) == self.global_step:
                model.load_state_dict(saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
                self.log(f"float32 weights and AdamW moments restored from {opt_file}")
            else:
                self.log(f"WARNING: {opt_file} is from another step; fresh moments")
        self.log(
            f"model: SDARForCausalLM {count_params(config) / 1e6:.2f} M params "
            f"({self.checkpoint_bytes / 1e6:.1f} MB {self.storage}), hidden {config.hidden_size}, "
            f"{config.num_layers} layers, {config.num_heads}q/{config.num_kv_heads}kv heads x "
            f"{config.head_dim}, vocab {config.vocab_size}, block {config.block_size}; "
            f"{'resumed from ' + str(cfg.resume) if cfg.resume else 'fresh init'}; "
            f"global step {self.global_step}, {self.tokens_seen / 1e6:.1f} M tokens seen"
        )
        self._build_loss()

    def _build_loss(self) -> None:
        cfg, dev, config = self.cfg, self.device, self.config
        if dev.type == "cuda":
            from torch.nn.attention.flex_attention import flex_attention

            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            t = time.perf_counter()
            err = check_flex_matches_dense(dev, block_size=config.block_size)
            self.log(f"flex_attention vs dense mask (bf16, L=1024): max |diff| {err:.4f}")
            if not err < 0.05:
                raise RuntimeError(f"flex_attention disagrees with the dense mask ({err})")
            self.timings["flex_check_s"] = time.perf_counter() - t
            kernel = torch.compile(flex_attention)
            attn: Any = FlexDiffusionAttention(
                flex_block_mask(cfg.seq_len, config.block_size, dev), torch.bfloat16, kernel
            )
        else:
            attn = DenseDiffusionAttention(
                dense_block_diffusion_mask(cfg.seq_len, config.block_size)
            )
        self.loss_module = BlockDiffusionLoss(self.model, attn)
        self.loss_fn: Callable[..., torch.Tensor] = self.loss_module
        if cfg.compile and dev.type == "cuda":
            self.loss_fn = torch.compile(self.loss_module)

    # ---- steps ------------------------------------------------------------------------------

    def _to_device(self, batch: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(batch)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _loss(
        self,
        clean: torch.Tensor,
        step: int,
        weighting: str,
        seed: int,
        emphasis: bool = True,
        code_names: torch.Tensor | None = None,
        answer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's loss; ``emphasis`` applies ``long_range_weight`` (training; validation
        reports the plain loss); ``code_names`` ([bs, L] bool, the ``code`` scope) narrows the
        tokens that may be long-range from the vocabulary's name-like ones to those of them that
        are part of a name in code; ``answer`` ([bs, L] bool, the task mix's answer tokens) gets
        ``task_answer_weight``."""
        cfg = self.cfg
        gen = noise_generator(self.device, seed, step)
        noisy, masked, t = sample_noise(
            clean,
            self.config.block_size,
            self.config.mask_token_id,
            eps=cfg.noise_eps,
            generator=gen,
        )
        flagged = None
        if emphasis and self.name_tokens is not None:
            scope = self.name_tokens[clean]  # name-like entries (no self, cls, keywords)
            if code_names is not None:
                scope = scope & code_names  # ...that are part of a name in code
            flagged = scope & long_range_tokens(
                clean,
                self.config.vocab_size,
                ngram=cfg.long_range_ngram,
                min_distance=cfg.long_range_distance,
            )
            self.long_range_fraction.append(flagged.float().mean())
        extra: dict[str, Any] = {}
        if answer is not None and emphasis:
            extra = {"answer": answer, "answer_weight": cfg.task_answer_weight}
        weights, norm = loss_weights(
            masked,
            t,
            weighting,  # type: ignore[arg-type]
            emphasis=flagged,
            emphasis_weight=cfg.long_range_weight,
            **extra,
        )
        with torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda"):
            total = self.loss_fn(noisy, clean, weights)
        return total / norm

    def train_step(self, run_step: int, total: int | None) -> torch.Tensor:
        """One optimizer step; returns the loss (0-dim, on the device, not synchronised). A
        compiler failure on the first step falls back to the eager module and redoes the step."""
        position = self.sampler.position
        try:
            return self._train_step(run_step, total)
        except Exception as e:
            if self.loss_fn is self.loss_module or run_step > 0:
                raise
            self.log(f"WARNING: compiled step failed ({type(e).__name__}: {e}); running eager")
            self.loss_fn = self.loss_module
            self.optimizer.zero_grad(set_to_none=True)
            self.sampler.position = position
            return self._train_step(run_step, total)

    def _train_step(self, run_step: int, total: int | None) -> torch.Tensor:
        cfg = self.cfg
        first = self.sampler.position
        batch = self.sampler.next_batch(cfg.batch_size)
        aux = self.sampler.aux_batch() if self.sampler.aux is not None else None
        answer = None
        if self.task_mix is not None:
            batch, aux, answer_np = self.task_mix.apply(batch, first, aux)
            answer = self._to_device(answer_np)
        clean = self._to_device(batch)
        names = None if aux is None else self._to_device(aux)
        lr = lr_at(run_step, cfg, total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self._loss(
            clean, self.global_step, cfg.loss_weighting, cfg.seed, code_names=names, answer=answer
        )
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.tokens_seen += clean.numel()
        self._last_lr = lr
        self._last_grad_norm = grad_norm
        return loss.detach()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def loop(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.total_steps or cfg.max_steps
        step_times: list[float] = []  # the first steps, one by one (synchronised)
        per_step = 0.0  # current estimate of one step's wall time (compiling steps excluded)
        losses: list[torch.Tensor] = []
        run_step = 0
        t_train = time.monotonic()
        t_mark, mark_step, mark_tokens = t_train, 0, self.tokens_seen
        final_loss = float("nan")
        while True:
            if cfg.max_steps is not None and run_step >= cfg.max_steps:
                break
            if time.monotonic() + 1.5 * per_step + RESERVE_S > self.deadline:
                break  # (train() refuses to save a run without any step)
            t_step = time.monotonic()
            losses.append(self.train_step(run_step, total))
            run_step += 1
            if run_step <= CALIBRATION_STEPS + 2:
                self._sync()  # time the first steps one by one (the first ones compile)
                step_times.append(time.monotonic() - t_step)
                if run_step == 1:
                    self.timings["first_step_s"] = step_times[0]
                per_step = float(np.mean(step_times[2:] or step_times[-1:]))
                if run_step == CALIBRATION_STEPS + 2 and cfg.total_steps is None:
                    left = self.deadline - time.monotonic() - RESERVE_S
                    fit = run_step + max(1, int(left / per_step))
                    total = min(fit, cfg.max_steps) if cfg.max_steps else fit
                    self.log(f"schedule: {per_step * 1e3:.0f} ms/step -> {total} steps this run")
            if run_step % cfg.log_every == 0 or run_step == cfg.max_steps:
                mean = float(torch.stack(losses).mean())
                losses.clear()
                if not math.isfinite(mean):
                    raise RuntimeError(f"loss is {mean} at global step {self.global_step}")
                now = time.monotonic()
                n = run_step - mark_step
                if n > 0 and run_step > CALIBRATION_STEPS + 2:
                    per_step = (now - t_mark) / n
                rate = (self.tokens_seen - mark_tokens) / max(now - t_mark, 1e-9)
                t_mark, mark_step, mark_tokens = now, run_step, self.tokens_seen
                final_loss = mean
                entry = {
                    "step": self.global_step,
                    "loss": round(mean, 4),
                    "lr": self._last_lr,
                    "grad_norm": round(float(self._last_grad_norm), 3),
                    "tokens_per_s": round(rate),
                    "tokens_seen": self.tokens_seen,
                    "epoch": round(self.sampler.epoch, 4),
                    "elapsed_s": round(now - self.t0, 1),
                }
                self.history.append(entry)
                self.log(
                    f"step {self.global_step:6d} | loss {mean:.4f} | lr {self._last_lr:.2e} | "
                    f"gnorm {entry['grad_norm']:.2f} | {rate:,.0f} tok/s | "
                    f"{self.tokens_seen / 1e6:.1f} M tokens | epoch {self.sampler.epoch:.3f} | "
                    f"{now - self.t0:.0f} s"
                )
        if losses:
            final_loss = float(torch.stack(losses).mean())
        self._sync()
        train_s = time.monotonic() - t_train
        self.timings["train_s"] = train_s
        return {
            "steps": run_step,
            "planned_steps": total,
            "tokens": run_step * cfg.batch_size * cfg.seq_len,
            "seconds": round(train_s, 1),
            "tokens_per_s": round(run_step * cfg.batch_size * cfg.seq_len / max(train_s, 1e-9)),
            "final_loss": final_loss,
            **self.long_range_summary(),
            **self.task_mix_summary(),
        }

    def task_mix_summary(self) -> dict[str, Any]:
        """The task mix's settings and counts (empty when off)."""
        if self.task_mix is None:
            return {}
        end = self.sampler.position
        return {"task_mix": self.task_mix.summary(self.run_start, end, self.cfg.task_answer_weight)}

    def long_range_summary(self) -> dict[str, Any]:
        """The run's long-range emphasis settings and the mean share of tokens it flagged
        (empty when off)."""
        cfg = self.cfg
        if self.name_tokens is None:
            return {}
        frac = self.long_range_fraction
        return {
            "long_range": {
                "weight": cfg.long_range_weight,
                "distance": cfg.long_range_distance,
                "ngram": cfg.long_range_ngram,
                "scope": cfg.long_range_scope,
                "flagged_fraction": round(float(torch.stack(frac).mean()), 4) if frac else None,
            }
        }

    def validate(self) -> float | None:
        """Mean masked CE on the held-out stdlib windows (fixed noise), or None without any."""
        windows = self.data.val_windows
        if windows.shape[0] == 0:
            return None
        bs = self.cfg.batch_size
        total, n = 0.0, 0
        # NOTE: grad mode stays on so the compiled training graph is reused (no recompile); the
        # graph is dropped unused.
        for i in range(0, windows.shape[0], bs):
            # Same shape as training (a short last batch wraps around to the first windows).
            chunk = windows[np.arange(i, i + bs) % windows.shape[0]]
            clean = self._to_device(np.ascontiguousarray(chunk))
            total += float(self._loss(clean, i, "mean", VAL_SEED, emphasis=False).detach())
            n += 1
        return total / n

    def validate_stored(self) -> float | None:
        """:meth:`validate` with the weights as the checkpoint stores them
        (:func:`herald.train.checkpoint.stored_weights`), then the training weights back: the
        loss users of the saved checkpoint get. None without held-out windows."""
        if self.data.val_windows.shape[0] == 0:
            return None
        with stored_weights(self.model, self.storage):
            return self.validate()


def train(
    cfg: TrainConfig,
    log: Callable[[str], None] | None = None,
    *,
    explicit: Collection[str] | None = None,
) -> dict[str, Any]:
    """Run one training run end to end (module docstring); returns the final JSON log.

    Everything that can be checked without data is checked first
    (:func:`herald.train.preflight.preflight`, ``explicit`` as there), before the corpus scan.

    Raises:
        FileNotFoundError: ``--resume`` directory or its files missing.
        FileExistsError: ``--out`` (or the state file) holds data the save must not replace.
        ValueError: bad configuration (a value, the device, sequence length, a model-shape value
            that differs from the resumed checkpoint, model over the size budget, no corpus).
        RuntimeError: non-finite loss, flex_attention disagreeing with the dense mask, or no step
            fitting the wall budget (then nothing is saved).
    """
    preflight(cfg, explicit)
    out_log = log or (lambda s: print(s, flush=True))
    run = Run(cfg, out_log)
    try:
        run.setup()
        summary = run.loop()
    finally:
        mix: TaskMixer | None = getattr(run, "task_mix", None)
        if mix is not None:
            mix.close()  # its worker processes
    if summary["steps"] == 0:
        raise RuntimeError(
            f"no training step fitted in the wall budget of {cfg.max_minutes:g} minutes "
            f"(--max-minutes, or --time-limit-s / 60) after {time.monotonic() - run.t0:.0f} s of "
            f"setup; nothing saved ({cfg.out_dir} left as it was): raise the budget"
        )
    t = time.perf_counter()
    val = run.validate()
    val_stored = run.validate_stored()
    run.timings["val_s"] = time.perf_counter() - t
    return save_run(run, summary, val, val_stored)
