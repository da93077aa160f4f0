"""`herald train` end to end on a synthetic corpus: checkpoint, generate, resume, budgets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import user_error

from herald.cli import main
from herald.models.loader import load_model
from herald.train.config import ModelDims, TrainConfig, check_checkpoint_size, model_config
from herald.train.schedule import lr_at
from herald.train.trainer import train

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "1"]
TINY += ["--head-dim", "16", "--intermediate-size", "128", "--vocab-size", "320"]


def tiny_config(trees: tuple[Path, Path], out: Path, **kw) -> TrainConfig:
    site, std = trees
    base = TrainConfig(
        out_dir=out / "ckpt",
        work_dir=out / "work",
        site_dirs=[site],
        stdlib_dirs=[std],
        seq_len=64,
        batch_size=2,
        vocab_size=320,
        dims=ModelDims(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=1,
            head_dim=16,
            intermediate_size=128,
        ),
        workers=1,
        device="cpu",
        val_windows=2,
        log_every=1,
    )
    return replace(base, **kw)


def test_train_cli_writes_a_checkpoint_that_herald_generates_with(trees, tmp_path, capsys) -> None:
    site, std = trees
    out = tmp_path / "run"
    argv = ["train", "--out", str(out / "ckpt"), "--work-dir", str(tmp_path / "work")]
    argv += ["--site-dir", str(site), "--stdlib-dir", str(std), "--seq-len", "64"]
    argv += ["--batch-size", "2", "--max-steps", "3", "--warmup-steps", "1", "--workers", "1"]
    argv += ["--device", "cpu", "--val-windows", "2", "--log-every", "1", *TINY]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "step      3 | loss" in printed and "saved" in printed
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    model, config, tok = load_model(out / "ckpt", device="cpu", dtype=torch.float32)
    assert config.architecture == "SDARForCausalLM" and config.block_size == 32
    assert (config.mask_token_id, config.eos_token_ids, config.pad_token_id) == (2, (0,), 1)
    assert tok.mask_token_id == 2 and tok.backend.token_to_id("<|MASK|>") == 2
    assert config.tie_word_embeddings and config.num_heads == 4 * config.num_kv_heads
    log = json.loads((out / "train_log.json").read_text())
    assert log["global_step"] == 3 and log["tokens_seen"] == 3 * 2 * 64
    assert log["data_manifest"]["file_count"] == 11 and len(log["data_manifest_sha256"]) == 64
    assert log["run"]["val_loss_stdlib"] > 0 and len(log["history"]) == 3
    # the loss of the weights as saved (bf16) is recorded beside the training weights' loss
    assert abs(log["run"]["val_loss_stdlib_bf16"] - log["run"]["val_loss_stdlib"]) < 0.05
    state = json.loads((out / "train_state.json").read_text())
    assert state["data_position"] == 6 and state["global_step"] == 3
    assert (
        main(
            [
                "generate",
                "--model",
                str(out / "ckpt"),
                "--prompt",
                "def alpha_load",
                "--max-new-tokens",
                "8",
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    # Resuming continues the count from the state file beside the checkpoint; here on the
    # dependency-ordered stream (a new cache key).
    argv2 = [a if a != str(out / "ckpt") else str(out / "ckpt2") for a in argv]
    capsys.readouterr()
    assert main([*argv2, "--resume", str(out / "ckpt"), "--data-order", "deps"]) == 0
    printed = capsys.readouterr().out
    assert "token stream (deps order)" in printed and "data order deps (the resumed" in printed
    state = json.loads((out / "train_state.json").read_text())
    assert state["global_step"] == 6 and state["data_position"] == 12
    assert len(state["runs"]) == 2 and state["data_order"] == "deps"
    assert len(list((tmp_path / "work").glob("stream-*.u16"))) == 2  # one cached stream per order


def test_resumed_run_matches_an_uninterrupted_one(trees, tmp_path) -> None:
    """Constant LR (the schedule is per run), fp32 weights and moments in the optimizer file."""
    const = dict(warmup_steps=0, min_lr_ratio=1.0, val_windows=0)
    a = tiny_config(trees, tmp_path / "a", max_steps=4, optimizer_file=tmp_path / "a.pt", **const)
    train(a, log=lambda s: None)
    b1 = tiny_config(trees, tmp_path / "b", max_steps=2, optimizer_file=tmp_path / "b.pt", **const)
    train(b1, log=lambda s: None)
    b2 = replace(b1, out_dir=tmp_path / "b" / "ckpt2", resume=b1.out_dir)
    train(b2, log=lambda s: None)
    wa = torch.load(tmp_path / "a.pt", weights_only=True)
    wb = torch.load(tmp_path / "b.pt", weights_only=True)
    assert wa["global_step"] == wb["global_step"] == 4
    for name, tensor in wa["model"].items():
        assert torch.equal(tensor, wb["model"][name]), name
    sa = json.loads((tmp_path / "a" / "train_state.json").read_text())
    sb = json.loads((tmp_path / "b" / "train_state.json").read_text())
    assert sa["data_position"] == sb["data_position"] == 8


def test_long_range_emphasis_is_logged_and_leaves_validation_plain(trees, tmp_path) -> None:
    """The emphasis changes the training loss only: the same weights validate the same."""
    base = dict(max_steps=1, warmup_steps=0, val_windows=2, lr=1e-12)  # weights ~unchanged
    plain = train(tiny_config(trees, tmp_path / "a", **base), log=lambda s: None)
    cfg = tiny_config(trees, tmp_path / "b", long_range_weight=4.0, long_range_distance=8, **base)
    lines: list[str] = []
    weighted = train(cfg, log=lines.append)
    lr = weighted["run"]["long_range"]
    assert (lr["weight"], lr["distance"], lr["ngram"]) == (4.0, 8, 3)
    assert 0.0 < lr["flagged_fraction"] < 0.5  # the fixture's files repeat names
    assert "long_range" not in plain["run"]
    assert weighted["run"]["final_loss"] != plain["run"]["final_loss"]
    assert weighted["run"]["val_loss_stdlib"] == pytest.approx(plain["run"]["val_loss_stdlib"])
    state = json.loads((tmp_path / "b" / "train_state.json").read_text())
    assert state["runs"][-1]["long_range"]["weight"] == 4.0
    cfg_json = json.loads((cfg.out_dir / "config.json").read_text())
    assert cfg_json["herald_training"]["long_range"]["distance"] == 8
    with pytest.raises(ValueError, match="--long-range-weight"):
        train(replace(cfg, long_range_weight=0.0), log=lambda s: None)


@pytest.mark.parametrize("scope", ["vocab", "code"])
def test_long_range_emphasis_flags_what_the_flags_say(
    trees, tmp_path, monkeypatch, capsys, scope
) -> None:
    """The weights the loss gets mark exactly the name-like tokens (``vocab``: by vocabulary
    entry; ``code``: tokens of a Python name in code) whose n-gram (of the given length) last
    occurred at least the given distance back, from the command line down."""
    from herald.train import trainer as trainer_mod
    from herald.train.objective import long_range_tokens, name_token_mask

    seen: list[tuple[torch.Tensor, torch.Tensor | None, float]] = []
    real = trainer_mod.loss_weights

    def spy(masked, t, weighting, emphasis=None, emphasis_weight=1.0):
        seen.append((masked, emphasis, emphasis_weight))
        return real(masked, t, weighting, emphasis=emphasis, emphasis_weight=emphasis_weight)

    clean_batches: list[torch.Tensor] = []
    real_lrt = trainer_mod.long_range_tokens

    def spy_lrt(clean, vocab_size, **kw):
        clean_batches.append(clean.clone())
        return real_lrt(clean, vocab_size, **kw)

    from herald.train.data import WindowSampler

    aux_batches: list[np.ndarray] = []
    real_aux = WindowSampler.aux_batch

    def spy_aux(self):
        aux_batches.append(real_aux(self))
        return aux_batches[-1]

    monkeypatch.setattr(WindowSampler, "aux_batch", spy_aux)
    monkeypatch.setattr(trainer_mod, "loss_weights", spy)
    monkeypatch.setattr(trainer_mod, "long_range_tokens", spy_lrt)
    site, std = trees
    out = tmp_path / "run"
    argv = ["train", "--out", str(out / "ckpt"), "--work-dir", str(tmp_path / "work")]
    argv += ["--site-dir", str(site), "--stdlib-dir", str(std), "--seq-len", "64"]
    argv += ["--batch-size", "2", "--max-steps", "2", "--warmup-steps", "0", "--workers", "1"]
    argv += ["--device", "cpu", "--val-windows", "2", *TINY]
    lr = ["--long-range-weight", "4", "--long-range-distance", "24", "--long-range-ngram", "2"]
    lr += ["--long-range-scope", scope]
    assert main([*argv, *lr]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["run"]["long_range"]["weight"] == 4.0
    assert (log["run"]["long_range"]["distance"], log["run"]["long_range"]["ngram"]) == (24, 2)
    assert log["run"]["long_range"]["scope"] == scope
    _, _, tok = load_model(out / "ckpt", device="cpu", dtype=torch.float32)
    names = name_token_mask(lambda ids: tok.decode(ids, skip_special_tokens=True), 320)
    train_calls = [x for x in seen if x[1] is not None]
    assert len(train_calls) == 2 == len(clean_batches)  # validation passes no emphasis
    # the code scope's masks are the sampler's aux windows (their content: test_tokenizer_data)
    assert len(aux_batches) == (2 if scope == "code" else 0)
    for k, ((_, emphasis, weight), clean) in enumerate(
        zip(train_calls, clean_batches, strict=True)
    ):
        allowed = names[clean]  # the code scope: name-like entries inside code names
        if scope == "code":
            allowed = allowed & torch.from_numpy(aux_batches[k])
        want = allowed & long_range_tokens(clean, 320, ngram=2, min_distance=24)
        assert weight == 4.0 and torch.equal(emphasis, want) and want.any()
    for bad, says in (
        (["--long-range-ngram", "5"], "--long-range-ngram"),
        (["--long-range-distance", "0"], "--long-range-distance"),
        (["--long-range-distance", "64"], "below --seq-len"),
    ):
        capsys.readouterr()
        assert main([*argv, "--long-range-weight", "4", *bad, "--overwrite"]) == 2, bad
        assert says in capsys.readouterr().err, bad


def test_default_model_fits_the_checkpoint_budget() -> None:
    cfg = model_config(ModelDims(), 8192)
    assert cfg.num_heads // cfg.num_kv_heads == 4 and cfg.max_position_embeddings >= 16384
    assert check_checkpoint_size(cfg, 30.0) <= 30e6
    with pytest.raises(ValueError, match="budget"):
        check_checkpoint_size(model_config(ModelDims(hidden_size=512), 8192), 30.0)


def test_lr_schedule() -> None:
    cfg = TrainConfig(out_dir=Path("."), lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1) and lr_at(9, cfg, 100) == 1.0
    assert lr_at(10, cfg, 100) == 1.0 and lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(500, cfg, 100) == pytest.approx(0.1) and lr_at(50, cfg, None) == 1.0


def test_user_errors_are_one_line(tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    assert main(["train", "--out", str(tmp_path / "o"), "--resume", str(missing)]) == 2
    assert user_error(capsys.readouterr().err).startswith("--resume ")  # argparse's form
