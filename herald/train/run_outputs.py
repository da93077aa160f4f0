"""What a training run (:mod:`herald.train.trainer`) writes when it ends: the checkpoint with its
training provenance in ``config.json``, the optimizer file (float32 weights and AdamW moments),
the resume state (global step, tokens seen, data position and the history of runs) and the JSON
log (configs, manifests, timings, loss history).
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from herald.models.loader import hf_config_dict
from herald.train.checkpoint import save_checkpoint, write_json
from herald.train.config import count_params
from herald.train.preflight import log_path, state_path

if TYPE_CHECKING:
    from herald.train.trainer import Run


def save_run(
    run: Run, run_summary: dict[str, Any], val_loss: float | None, val_stored: float | None = None
) -> dict[str, Any]:
    """Write the outputs of ``run`` (module docstring) and return its JSON log. ``val_loss``:
    the held-out loss of the training weights; ``val_stored``: of the weights as stored."""
    cfg = run.cfg
    out = cfg.out_dir
    state_file, log_file = state_path(cfg), log_path(cfg)
    stored = {} if val_stored is None else {f"val_loss_stdlib_{run.storage}": val_stored}
    provenance = {
        "herald_training": {
            "global_step": run.global_step,
            "tokens_seen": run.tokens_seen,
            "data_manifest_sha256": run.data.manifest["contents_sha256"],
            "seq_len": cfg.seq_len,
            "loss_weighting": cfg.loss_weighting,
            **run.long_range_summary(),
            **run.task_mix_summary(),
            "val_loss_stdlib": val_loss,
            **stored,
            "recipe": "herald.train: site-packages .py, stdlib held out",
        }
    }
    t = time.perf_counter()
    nbytes = save_checkpoint(
        run.model,
        run.config,
        run.tokenizer,
        out,
        extra_config=provenance,
        max_shard_bytes=int(cfg.max_shard_mb * 2**20),
        storage=run.storage,
    )
    if cfg.optimizer_file is not None:
        cfg.optimizer_file.parent.mkdir(parents=True, exist_ok=True)
        full = {
            "global_step": run.global_step,
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
        }
        torch.save(full, cfg.optimizer_file)
    run.timings["save_s"] = time.perf_counter() - t
    runs = previous_runs(run.state)
    resumed_from = None if cfg.resume is None else str(cfg.resume)
    runs.append(
        {**run_summary, "val_loss_stdlib": val_loss, **stored, "resumed_from": resumed_from}
    )
    state = {
        "global_step": run.global_step,
        "tokens_seen": run.tokens_seen,
        "data_position": run.sampler.position,
        "epoch": run.sampler.epoch,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "data_order": cfg.data_order,
        "data_manifest_sha256": run.data.manifest["contents_sha256"],
        "stream_key": run.data.stream_key,
        "runs": runs,
    }
    write_json(state_file, state)
    tok_sha = hashlib.sha256(run.data.backend.to_str().encode()).hexdigest()
    manifest = dict(run.data.manifest)
    log = {
        "checkpoint": str(out),
        "checkpoint_bytes": nbytes,
        "num_params": count_params(run.config),
        "model_config": hf_config_dict(run.config, torch.bfloat16),
        "train_config": dataclasses.asdict(cfg),
        "device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "data_manifest": manifest,
        "data_manifest_sha256": manifest["contents_sha256"],
        "stdlib_holdout_manifest": {
            k: v for k, v in run.data.stdlib_manifest.items() if k != "packages"
        },
        "tokenizer_sha256": tok_sha,
        "stream_tokens": int(run.data.stream.size),
        "run": {**run_summary, "val_loss_stdlib": val_loss, **stored},
        "global_step": run.global_step,
        "tokens_seen": run.tokens_seen,
        "epoch": run.sampler.epoch,
        "timings_s": {k: round(v, 2) for k, v in {**run.data.timings, **run.timings}.items()},
        "history": run.history,
    }
    write_json(log_file, log)
    as_saved = "" if val_stored is None else f" ({val_stored:.4f} as saved, {run.storage})"
    run.log(
        f"saved {out} ({nbytes / 1e6:.1f} MB), state {state_file}, log {log_file}; "
        f"global step {run.global_step}, {run.tokens_seen / 1e6:.1f} M tokens, "
        f"final loss {run_summary['final_loss']:.4f}, stdlib val loss "
        + (f"{val_loss:.4f}" if val_loss is not None else "n/a")
        + as_saved
    )
    return log


def previous_runs(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The run history of a resume state. Files written before ``resumed_from`` became JSON null
    for a fresh run spell it ``"None"``; it is read back as None."""
    runs = [dict(r) for r in state.get("runs", [])]
    for r in runs:
        if r.get("resumed_from") == "None":
            r["resumed_from"] = None
    return runs
