"""`herald train` refuses bad runs before any work, and never deletes data it did not write.

Most tests stub the corpus scan (``prepare_data``) with a recorder: a refused run must not have
reached it. The runs that do train use the tiny model of test_trainer.py (a second or two).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import user_error
from train_fixtures import make_tree

import herald.train.trainer as trainer_mod
from herald.cli import main
from herald.models.loader import load_model
from herald.train.checkpoint import save_checkpoint
from herald.train.config import ModelDims, TrainConfig, check_values
from herald.train.run_outputs import previous_runs
from herald.train.trainer import train

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "1"]
TINY += ["--head-dim", "16", "--intermediate-size", "128", "--vocab-size", "320"]


class Trained:
    """A finished 1-step run: ``run/ckpt``, ``run/train_state.json``, ``run/train_log.json``."""

    def __init__(self, root: Path) -> None:
        self.site = make_tree(root / "site", {"alpha": 4, "beta": 4, "gamma": 3})
        self.std = make_tree(root / "std", {"json": 3, "email": 3}, seed=1)
        self.work = root / "work"
        self.run = root / "run"

    def argv(self, out: Path, *extra: str, tiny: bool = True) -> list[str]:
        argv = ["train", "--out", str(out), "--work-dir", str(self.work)]
        argv += ["--site-dir", str(self.site), "--stdlib-dir", str(self.std), "--seq-len", "64"]
        argv += ["--batch-size", "2", "--max-steps", "1", "--warmup-steps", "1", "--workers", "1"]
        argv += ["--device", "cpu", "--val-windows", "2", "--log-every", "1"]
        return argv + (TINY if tiny else []) + list(extra)

    def copy_run(self, dest: Path) -> Path:
        shutil.copytree(self.run, dest)
        return dest


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    t = Trained(tmp_path_factory.mktemp("trained"))
    assert main(t.argv(t.run / "ckpt")) == 0
    return t


@pytest.fixture
def scans(monkeypatch) -> list[object]:
    """Replaces the corpus scan: records that it was reached, then stops the run."""
    calls: list[object] = []

    def fake_prepare_data(**kw: object) -> None:
        calls.append(kw)
        raise RuntimeError("corpus scan reached")

    monkeypatch.setattr(trainer_mod, "prepare_data", fake_prepare_data)
    return calls


def one_error_line(capsys) -> str:
    """The message of the one user error on stderr (an option's value: in argparse's form)."""
    return user_error(capsys.readouterr().err)


def tree_snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ---- --out ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_holding_user_data_is_refused_and_left_alone(
    trained, tmp_path, scans, capsys, overwrite
) -> None:
    out = tmp_path / "x"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes\n")
    (out / "sub" / "data.txt").write_text("my data\n")
    before = tree_snapshot(out)
    extra = ["--overwrite"] if overwrite else []
    assert main(trained.argv(out, *extra)) == 2
    err = one_error_line(capsys)
    assert "--out" in err and "config.json" in err
    assert scans == []
    assert tree_snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_out_that_is_a_file_is_refused_before_training(trained, tmp_path, scans, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    assert main(trained.argv(afile)) == 2
    err = one_error_line(capsys)
    assert "--out" in err and "not a directory" in err
    assert scans == []
    assert afile.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # A file on the way to --out is refused too.
    assert main(trained.argv(afile / "ckpt")) == 2
    assert "--out" in one_error_line(capsys) and scans == []


def test_fresh_run_into_an_existing_checkpoint_needs_overwrite(
    trained, tmp_path, scans, capsys
) -> None:
    run = trained.copy_run(tmp_path / "run")
    before = tree_snapshot(run)
    assert main(trained.argv(run / "ckpt")) == 2
    err = one_error_line(capsys)
    assert "--out" in err and "--overwrite" in err
    assert scans == []
    assert tree_snapshot(run) == before
    # A new checkpoint beside it would replace its run history (train_state.json): refused too.
    assert main(trained.argv(run / "ckpt2")) == 2
    err = one_error_line(capsys)
    assert "--state-file" in err and "--overwrite" in err
    assert scans == [] and tree_snapshot(run) == before
    # Resuming it into its own directory, or --overwrite, gets past the checks.
    assert main(trained.argv(run / "ckpt", "--resume", str(run / "ckpt"))) == 2
    assert "corpus scan reached" in one_error_line(capsys) and len(scans) == 1
    assert main(trained.argv(run / "ckpt", "--overwrite")) == 2
    assert "corpus scan reached" in one_error_line(capsys) and len(scans) == 2
    assert tree_snapshot(run) == before


def test_resume_in_place_and_overwrite(trained, tmp_path) -> None:
    run = trained.copy_run(tmp_path / "run")
    ckpt = run / "ckpt"
    state = json.loads((run / "train_state.json").read_text())
    assert state["global_step"] == 1
    assert state["runs"][0]["resumed_from"] is None  # JSON null, not "None"
    # A state file of an older version spells a fresh run's origin "None": still read.
    state["runs"][0]["resumed_from"] = "None"
    (run / "train_state.json").write_text(json.dumps(state))

    assert main(trained.argv(ckpt, "--resume", str(ckpt))) == 0
    state = json.loads((run / "train_state.json").read_text())
    assert state["global_step"] == 2 and len(state["runs"]) == 2
    assert [r["resumed_from"] for r in state["runs"]] == [None, str(ckpt)]
    assert sorted(p.name for p in run.iterdir()) == ["ckpt", "train_log.json", "train_state.json"]
    load_model(ckpt, device="cpu", dtype=torch.float32)

    assert main(trained.argv(ckpt, "--overwrite")) == 0
    state = json.loads((run / "train_state.json").read_text())
    assert state["global_step"] == 1 and len(state["runs"]) == 1
    assert state["runs"][0]["resumed_from"] is None
    assert '"resumed_from": null' in (run / "train_state.json").read_text()
    assert sorted(p.name for p in run.iterdir()) == ["ckpt", "train_log.json", "train_state.json"]


def test_checkpoint_files_get_ordinary_permissions(trained) -> None:
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (trained.run / "ckpt").iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_save_checkpoint_deletes_nothing_it_did_not_write(trained, tmp_path) -> None:
    model, config, tok = load_model(trained.run / "ckpt", device="cpu", dtype=torch.float32)
    user = tmp_path / "data"
    user.mkdir()
    (user / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="config.json"):
        save_checkpoint(model, config, tok, user)
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    with pytest.raises(FileExistsError):
        save_checkpoint(model, config, tok, afile)
    # Folders of these fixed names beside the checkpoint are not the save's to use or delete.
    for name in ("ckpt.tmp", "ckpt.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(name)
    save_checkpoint(model, config, tok, tmp_path / "ckpt")
    save_checkpoint(model, config, tok, tmp_path / "ckpt")  # replaces its own checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "afile",
        "ckpt",
        "ckpt.old",
        "ckpt.tmp",
        "data",
    ]
    assert (tmp_path / "ckpt.tmp" / "keep.txt").read_text() == "ckpt.tmp"
    assert (tmp_path / "ckpt.old" / "keep.txt").read_text() == "ckpt.old"
    assert (user / "notes.txt").read_text() == "mine\n" and afile.read_text() == "mine\n"
    load_model(tmp_path / "ckpt", device="cpu", dtype=torch.float32)


# ---- values, device, --resume --------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--seq-len", "100"], "--seq-len 100 is not a multiple of the block size 32"),
        (["--seq-len", "0"], "--seq-len"),
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "0"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--max-steps", "0"], "--max-steps"),
        (["--max-minutes", "0"], "--max-minutes"),
        (["--max-minutes", "-1"], "--max-minutes"),
        (["--max-minutes", "0.2"], "--max-minutes"),
        (["--total-steps", "0"], "--total-steps"),
        (["--warmup-steps", "-1"], "--warmup-steps"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio"),
        (["--weight-decay", "-0.1"], "--weight-decay"),
        (["--grad-clip", "0"], "--grad-clip"),
        (["--log-every", "0"], "--log-every"),
        (["--vocab-size", "100"], "--vocab-size"),
        (["--tokenizer-sample-mb", "0"], "--tokenizer-sample-mb"),
        (["--hidden-size", "0"], "--hidden-size"),
        (["--num-kv-heads", "3"], "--num-heads"),
        (["--head-dim", "15"], "--head-dim"),
        (["--intermediate-size", "100000"], "--max-checkpoint-mb"),
        (["--max-checkpoint-mb", "0"], "--max-checkpoint-mb"),
        (["--max-shard-mb", "0"], "--max-shard-mb"),
        (["--workers", "-1"], "--workers"),
        (["--val-windows", "-1"], "--val-windows"),
        (["--device", "tpu"], "--device"),
        (["--resume-state", "/nonexistent/state.json"], "--resume-state"),
    ],
)
def test_bad_values_are_refused_before_any_work(
    trained, tmp_path, scans, capsys, flags, expected
) -> None:
    out = tmp_path / "o" / "ckpt"
    assert main(trained.argv(out, *flags)) == 2
    assert expected in one_error_line(capsys)
    assert scans == [] and not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_any_work(trained, tmp_path, scans, capsys) -> None:
    assert main(trained.argv(tmp_path / "ckpt", "--device", "cuda")) == 2
    err = one_error_line(capsys)
    assert "--device cuda" in err and "no CUDA GPU" in err
    assert scans == []


def test_work_dir_that_is_a_file_is_refused(trained, tmp_path, scans, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = trained.argv(tmp_path / "ckpt")
    argv[argv.index("--work-dir") + 1] = str(afile)
    assert main(argv) == 2
    assert "--work-dir" in one_error_line(capsys) and scans == []


@pytest.mark.parametrize(
    ("flags", "flag", "have"),
    [
        (["--hidden-size", "128"], "--hidden-size 128", "hidden_size 64"),
        (["--hidden-size", "384"], "--hidden-size 384", "hidden_size 64"),  # = the default
        (["--num-layers", "3"], "--num-layers 3", "num_layers 2"),
        (["--num-kv-heads", "2"], "--num-kv-heads 2", "num_kv_heads 1"),
        (["--head-dim", "32"], "--head-dim 32", "head_dim 16"),
        (["--intermediate-size", "256"], "--intermediate-size 256", "intermediate_size 128"),
        (["--vocab-size", "999"], "--vocab-size 999", "vocab_size 320"),
    ],
)
def test_resume_refuses_a_different_model_shape(
    trained, tmp_path, scans, capsys, flags, flag, have
) -> None:
    ckpt = trained.run / "ckpt"
    argv = trained.argv(tmp_path / "ckpt", "--resume", str(ckpt), *flags, tiny=False)
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert flag in err and have in err and str(ckpt) in err
    assert scans == []


def test_resume_accepts_the_checkpoint_shape_and_unset_flags(
    trained, tmp_path, scans, capsys
) -> None:
    ckpt = str(trained.run / "ckpt")
    # The same values as the checkpoint, given explicitly: fine.
    assert main(trained.argv(tmp_path / "a", "--resume", ckpt)) == 2
    assert "corpus scan reached" in one_error_line(capsys)
    # Not given: the checkpoint's shape is used, whatever the defaults are.
    assert main(trained.argv(tmp_path / "b", "--resume", ckpt, tiny=False)) == 2
    assert "corpus scan reached" in one_error_line(capsys)
    assert len(scans) == 2


def test_train_api_refuses_a_different_shape_on_resume(trained, tmp_path, scans) -> None:
    dims = ModelDims(
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=128,
    )
    cfg = TrainConfig(
        out_dir=tmp_path / "ckpt",
        work_dir=trained.work,
        resume=trained.run / "ckpt",
        seq_len=64,
        dims=dims,
        device="cpu",
    )
    with pytest.raises(ValueError, match="--hidden-size 128"):
        train(cfg, log=lambda s: None)
    with pytest.raises(RuntimeError, match="corpus scan reached"):
        train(replace(cfg, dims=replace(dims, hidden_size=64)), log=lambda s: None)
    assert len(scans) == 1


def test_check_values_names_the_flag() -> None:
    check_values(TrainConfig(out_dir=Path("x")))
    with pytest.raises(ValueError, match="--max-steps must be >= 1, got 0"):
        check_values(TrainConfig(out_dir=Path("x"), max_steps=0))
    with pytest.raises(ValueError, match="--loss-weighting"):
        check_values(TrainConfig(out_dir=Path("x"), loss_weighting="sum"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--data-order must be one of package, deps"):
        check_values(TrainConfig(out_dir=Path("x"), data_order="random"))


# ---- runs without a step, the run history -------------------------------------------------------


def test_a_run_without_any_step_saves_nothing(trained, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(trainer_mod, "RESERVE_S", 1e9)  # the budget is spent before step 1
    assert main(trained.argv(tmp_path / "run" / "ckpt")) == 2
    err = one_error_line(capsys)
    assert "no training step" in err and "--max-minutes" in err
    assert not (tmp_path / "run").exists()


def test_previous_runs_reads_old_none_strings() -> None:
    state = {"runs": [{"resumed_from": "None"}, {"resumed_from": "ckpt"}, {}]}
    assert previous_runs(state) == [{"resumed_from": None}, {"resumed_from": "ckpt"}, {}]
    assert state["runs"][0]["resumed_from"] == "None"  # not modified in place
    assert previous_runs({}) == []


def test_int8_storage_is_kept_on_resume(trained, tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(trained.argv(ckpt, "--storage", "int8")) == 0
    hf = json.loads((ckpt / "config.json").read_text())
    qc = hf.get("quantization_config")
    assert qc and qc["quant_method"] == "herald_int8_rowwise"
    # the held-out loss is measured for the weights as saved too, close to the float one
    prov = hf["herald_training"]
    assert abs(prov["val_loss_stdlib_int8"] - prov["val_loss_stdlib"]) < 0.05
    state = json.loads((tmp_path / "train_state.json").read_text())
    assert state["runs"][-1]["val_loss_stdlib_int8"] == prov["val_loss_stdlib_int8"]
    assert main(trained.argv(ckpt, "--resume", str(ckpt))) == 0  # no --storage: stays int8
    assert "quantization_config" in json.loads((ckpt / "config.json").read_text())
    assert main(trained.argv(ckpt, "--resume", str(ckpt), "--storage", "bf16")) == 0
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    load_model(ckpt, device="cpu", dtype=torch.float32)


def test_resume_refuses_an_unsupported_quantization_up_front(
    trained, tmp_path, scans, capsys
) -> None:
    run = trained.copy_run(tmp_path / "run")
    cfg = json.loads((run / "ckpt" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (run / "ckpt" / "config.json").write_text(json.dumps(cfg))
    argv = trained.argv(tmp_path / "out", "--resume", str(run / "ckpt"), "--storage", "bf16")
    assert main(argv) == 2
    err = one_error_line(capsys)
    assert "--resume:" in err, err
    assert "'gptq' is not supported" in err
    assert scans == []  # refused before the corpus scan


def test_resume_refuses_a_truncated_weights_file_up_front(trained, tmp_path, scans, capsys) -> None:
    run = trained.copy_run(tmp_path / "run")
    weights = run / "ckpt" / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert main(trained.argv(tmp_path / "out", "--resume", str(run / "ckpt"))) == 2
    err = one_error_line(capsys)
    assert f"--resume: {weights} is not a readable safetensors file" in err
    assert scans == []  # refused before the corpus scan


def test_resume_refuses_a_checkpoint_not_written_by_train(trained, tmp_path, scans, capsys) -> None:
    from herald.models.loader import write_random_checkpoint

    ckpt = write_random_checkpoint("tiny-sdar", tmp_path / "random")
    assert main(trained.argv(tmp_path / "out", "--resume", str(ckpt), tiny=False)) == 2
    err = one_error_line(capsys)
    assert f"{ckpt / 'tokenizer.json'}: tokenizer maps '<|endoftext|>' to 256" in err
    assert "--resume continues a checkpoint written by herald train" in err
    assert scans == []


def test_resumed_budget_hint_names_the_storage() -> None:
    from herald.train.config import check_checkpoint_size, model_config

    config = model_config(ModelDims(hidden_size=512, num_layers=9, intermediate_size=1344), 8192)
    with pytest.raises(ValueError, match="drop --storage"):
        check_checkpoint_size(config, 30.0, "bf16", resumed=True)
    with pytest.raises(ValueError, match="shrink the dims or store it as int8"):
        check_checkpoint_size(config, 30.0, "bf16")


# ---- command-line parsing ---------------------------------------------------------------------


def parse_train(*argv: str):
    import argparse

    from herald.train.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["train", "--out", "ckpt", *argv])


def test_token_counts_take_k_suffixes(capsys) -> None:
    from herald.train.cli import config_from_args

    cfg = config_from_args(
        parse_train(
            "--seq-len", "4K", "--task-mix-contexts", "2k,4K", "--long-range-distance", "1K"
        )
    )
    assert (cfg.seq_len, cfg.task_mix_contexts, cfg.long_range_distance) == (
        4096,
        (2048, 4096),
        1024,
    )
    with pytest.raises(SystemExit):
        parse_train("--seq-len", "4M")
    assert "expected a token count like 4096 or 32K, got '4M'" in capsys.readouterr().err


def test_shape_and_its_old_name_preset(capsys) -> None:
    from herald.train.cli import config_from_args, explicit_shape_flags

    args = parse_train("--shape", "large")
    assert config_from_args(args).dims.hidden_size == 512
    assert "hidden_size" in explicit_shape_flags(args)
    assert capsys.readouterr().err == ""
    old = parse_train("--preset", "large")  # kept for scripts, with a warning
    assert config_from_args(old) == config_from_args(args)
    assert "--preset is deprecated and will be removed; use --shape" in capsys.readouterr().err


def test_time_limit_s_is_max_minutes_in_seconds(capsys) -> None:
    from herald.train.cli import config_from_args

    assert config_from_args(parse_train()).max_minutes == TrainConfig.max_minutes
    assert config_from_args(parse_train("--max-minutes", "3")).max_minutes == 3.0
    assert config_from_args(parse_train("--time-limit-s", "90")).max_minutes == 1.5
    with pytest.raises(SystemExit):
        parse_train("--time-limit-s", "90", "--max-minutes", "3")
    assert "--max-minutes: not allowed with argument --time-limit-s" in capsys.readouterr().err
    for bad in ("10", "nan"):
        with pytest.raises(ValueError, match=f"--time-limit-s must be more than 20 .*, got {bad}"):
            config_from_args(parse_train("--time-limit-s", bad))


def test_help_describes_every_option_in_one_style() -> None:
    import argparse

    from herald.cliargs import HelpFormatter
    from herald.train.cli import help_line, register

    subparsers = argparse.ArgumentParser().add_subparsers()
    register(subparsers)
    train = subparsers.choices["train"]
    helps = {
        a.option_strings[-1]: HelpFormatter("herald")._get_help_string(a)
        for a in train._actions
        if a.option_strings and a.help != argparse.SUPPRESS
    }
    for flag, text in helps.items():
        assert not text.endswith("."), flag
        first = text.split()[0]
        assert not (first[0].isupper() and first[1:].islower()), flag  # AdamW, MB, JSON: fine
        assert "device" not in text.lower() or flag in ("--device", "--no-compile"), flag
    for flag in ("--state-file", "--log-file"):
        assert not helps[flag].startswith("default") and "written at the end" in helps[flag]
    assert "MiB" in helps["--max-shard-mb"] and "16" not in helps["--max-shard-mb"]
    assert help_line("Seed of everything.") == "seed of everything"
    assert help_line("MB of documents.") == "MB of documents"
