"""The task mix of ``herald train``: RULER-style task sequences among the code windows, with
haystacks of the training corpus only (never the standard library); deterministic for a seed;
the fraction held; the answer in each sequence; a tiny training run with the mix, resumed."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from train_fixtures import make_tree

from herald.cli import main
from herald.eval.ruler_formats import RULER_TASKS
from herald.models.loader import bundled_checkpoint, load_config, load_model, load_tokenizer
from herald.train.corpus import SourceFile, scan_stdlib, scan_third_party
from herald.train.objective import loss_weights
from herald.train.task_mix import (
    CorpusTaskSource,
    TaskMixer,
    as_fraction,
    is_task_position,
    task_ordinal,
)
from herald.train.tokenizer_train import EOS_ID

SEQ = 2048


@pytest.fixture(scope="module")
def codec():
    path = bundled_checkpoint("code-sdar")
    return load_tokenizer(path, load_config(path))


@pytest.fixture
def corpora(tmp_path):
    """(site dir, stdlib dir, training corpus, stdlib corpus); the site dir has enough text for
    2K-token haystacks; the stdlib's files name their packages (``json_``, ``email_``)."""
    site = make_tree(tmp_path / "site", {"alpha": 6, "beta": 6, "gamma": 5})
    std = make_tree(tmp_path / "std", {"json": 3, "email": 3}, seed=1)
    stdlib = scan_stdlib([std])
    return site, std, scan_third_party([site], stdlib, stdlib_roots=[std]), stdlib


def mixer(corpora, codec, *, seed=0, fraction=0.5, tasks=RULER_TASKS, contexts=(1024, SEQ)):
    site, std, corpus, stdlib = corpora
    source = CorpusTaskSource(corpus.files, [site], [std], [f.text for f in stdlib.files])
    return TaskMixer(source, codec, fraction=fraction, tasks=tasks, contexts=contexts,
                     seq_len=SEQ, seed=seed, eos_id=EOS_ID)  # fmt: skip


def windows(n: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 8000, size=(n, SEQ), dtype=np.int64)


def test_fraction_is_exact_on_every_prefix() -> None:
    for f in (0.1, 0.25, 1 / 3, 0.5, 1.0):
        frac = as_fraction(f)
        flags = [is_task_position(p, frac) for p in range(1000)]
        for n in (1, 7, 100, 1000):
            assert sum(flags[:n]) == task_ordinal(n, frac)
            assert abs(sum(flags[:n]) - f * n) < 1
    assert not any(is_task_position(p, as_fraction(0.0)) for p in range(50))


def test_mixed_stream_is_deterministic_and_holds_the_fraction(corpora, codec) -> None:
    batch = windows(12)
    a, _, ans_a = mixer(corpora, codec).apply(batch, 0)
    b, _, ans_b = mixer(corpora, codec).apply(batch, 0)
    assert np.array_equal(a, b) and np.array_equal(ans_a, ans_b)
    task_rows = [i for i in range(12) if not np.array_equal(a[i], batch[i])]
    assert task_rows == [i for i in range(12) if is_task_position(i, as_fraction(0.5))]
    assert len(task_rows) == 6 and ans_a.any(axis=1).tolist() == [i in task_rows for i in range(12)]
    # the same positions in two calls of 6 (a resumed run) give the same rows
    m = mixer(corpora, codec)
    c = np.concatenate([m.apply(batch[:6], 0)[0], m.apply(batch[6:], 6)[0]])
    assert np.array_equal(a, c)
    assert m.counts(0, 12) == {t: 1 for t in RULER_TASKS}  # six tasks cycled, one each
    # built ahead in worker processes: the same rows
    m.start_workers(2, ahead=4)
    try:
        d = np.concatenate([m.apply(batch[i : i + 3], i)[0] for i in range(0, 12, 3)])
    finally:
        m.close()
    assert np.array_equal(a, d)
    other, _, _ = mixer(corpora, codec, seed=1).apply(batch, 0)
    assert not np.array_equal(a, other)  # another seed, other instances


def test_task_sequences_fit_and_hold_their_answer(corpora, codec) -> None:
    m = mixer(corpora, codec, fraction=1.0)
    batch = windows(12)
    rows, _, answer = m.apply(batch, 0)
    for p in range(12):
        seq = m.sequence(p)
        assert seq is not None and seq.context == (1024, SEQ)[(p // 6) % 2]
        n = seq.ids.size
        assert n <= seq.context - 128 + 64 and seq.ids[-1] == EOS_ID
        assert codec.decode(seq.ids[seq.answer].tolist()) == f" {seq.target}\n"
        prompt = codec.decode(seq.ids[: seq.answer.start].tolist())
        assert prompt.endswith("# Answer:") and seq.target
        assert np.array_equal(rows[p, :n], seq.ids)  # the task first, then the code window
        assert np.array_equal(rows[p, n:], batch[p, : SEQ - n])
        assert np.flatnonzero(answer[p]).tolist() == list(range(SEQ))[seq.answer]


def test_the_mix_never_reads_nor_uses_the_stdlib(corpora, codec, monkeypatch) -> None:
    site, std, corpus, stdlib = corpora
    m = mixer(corpora, codec, fraction=1.0)

    def no_reads(*args, **kwargs):
        raise AssertionError(f"the mix read a file: {args[:1]}")

    for owner, name in ((builtins, "open"), (Path, "open"), (Path, "read_text")):
        monkeypatch.setattr(owner, name, no_reads)
    monkeypatch.setattr(Path, "read_bytes", no_reads)
    rows, _, _ = m.apply(windows(6), 0)
    monkeypatch.undo()
    text = "".join(codec.decode(r.tolist()) for r in rows[:, :1900])
    assert "alpha_" in text and "json_" not in text and "email_" not in text
    assert "std/" not in text and "# file: json" not in text
    # stdlib files are refused by their path: as a training root, or under one (deepest wins)
    with pytest.raises(ValueError, match="standard library"):
        CorpusTaskSource(stdlib.files, [std], [std])
    with pytest.raises(ValueError, match="standard library"):
        CorpusTaskSource(stdlib.files, [std.parent], [std])
    with pytest.raises(ValueError, match="no origin"):
        CorpusTaskSource([SourceFile("x.py", "x = 1\n")], [site], [std])
    # a training file whose text equals a stdlib file's is left out of the haystacks
    src = CorpusTaskSource(corpus.files, [site.parent], [std], [corpus.files[0].text])
    assert src.dropped == 1 and len(src) == len(corpus.files) - 1


def test_answer_tokens_get_their_weight() -> None:
    masked = torch.tensor([[True, True, False, True]])
    t = torch.full((1, 4), 0.5)
    answer = torch.tensor([[False, True, True, False]])
    w, norm = loss_weights(masked, t, "mean", answer=answer, answer_weight=8.0)
    assert w.tolist() == [[1.0, 8.0, 0.0, 1.0]] and float(norm) == 10.0
    assert torch.equal(loss_weights(masked, t, "mean")[0], masked.float())


TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "1"]
TINY += ["--head-dim", "16", "--intermediate-size", "128", "--vocab-size", "512"]


def test_tiny_run_with_the_mix_saves_a_checkpoint_and_resumes(tmp_path, capsys) -> None:
    site = make_tree(tmp_path / "site", {"alpha": 4, "beta": 4, "gamma": 3})
    std = make_tree(tmp_path / "std", {"json": 3, "email": 3}, seed=1)
    out = tmp_path / "run"
    argv = ["train", "--work-dir", str(tmp_path / "work"), "--site-dir", str(site)]
    argv += ["--stdlib-dir", str(std), "--seq-len", "256", "--batch-size", "2", "--max-steps"]
    argv += ["2", "--warmup-steps", "1", "--workers", "1", "--device", "cpu", "--val-windows"]
    argv += ["1", "--log-every", "1", "--task-mix", "0.5", "--task-mix-tasks", "niah_single"]
    argv += ["--task-mix-workers", "0"]
    assert main([*argv, *TINY, "--out", str(out / "ckpt")]) == 0
    printed = capsys.readouterr().out
    assert "task mix: 50% of the sequences are niah_single at contexts [256]" in printed
    log = json.loads((out / "train_log.json").read_text())
    mix = log["run"]["task_mix"]
    assert mix["sequences"] == {"niah_single": 2} and mix["answer_weight"] == 32.0
    config = json.loads((out / "ckpt" / "config.json").read_text())
    assert config["herald_training"]["task_mix"]["fraction"] == 0.5
    model, cfg, _ = load_model(out / "ckpt", device="cpu", dtype=torch.float32)
    assert cfg.max_position_embeddings >= 32768 and sum(p.numel() for p in model.parameters())
    # resume: the step count, the data position and the mix continue
    resume = ["--out", str(out / "ckpt2"), "--resume", str(out / "ckpt"), "--task-mix-workers"]
    assert main([*argv, *resume, "1"]) == 0  # (the last flag wins: one worker process)
    state = json.loads((out / "train_state.json").read_text())
    assert (state["global_step"], state["data_position"], len(state["runs"])) == (4, 8, 2)
    assert state["runs"][-1]["task_mix"]["sequences"] == {"niah_single": 2}
    assert "resumed from" in capsys.readouterr().out
    # a task the contexts cannot hold fails before any step (probed at the smallest context)
    many = [a if a != "niah_single" else "niah_single,niah_multikey" for a in argv]
    assert main([*many, *TINY, "--out", str(tmp_path / "other" / "ckpt")]) == 2
    err = capsys.readouterr()
    assert "niah_multikey at context 256" in err.err and "step " not in err.out


def test_task_mix_values_and_the_large_preset(tmp_path, capsys) -> None:
    from herald.train.cli import config_from_args, register
    from herald.train.config import check_checkpoint_size, count_params, model_config

    out = ["train", "--out", str(tmp_path / "o")]
    for bad, says in (
        (["--task-mix", "1.5"], "--task-mix must be in [0, 1]"),
        (["--task-mix", "0.2", "--task-mix-contexts", "16384"], "--task-mix-contexts 16384"),
        (["--task-mix", "0.2", "--task-answer-weight", "0"], "--task-answer-weight"),
    ):
        assert main([*out, "--seq-len", "8192", *bad]) == 2, bad
        assert says in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        main([*out, "--task-mix-tasks", "line"])
    assert "invalid choice 'line'" in capsys.readouterr().err
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args([*out, "--shape", "large"]))
    assert (cfg.dims.hidden_size, cfg.dims.num_layers, cfg.storage) == (512, 9, "int8")
    assert cfg.task_mix == 0.0 and cfg.task_mix_tasks == RULER_TASKS
    config = model_config(cfg.dims, 8192)
    assert 2 * 14.7e6 > count_params(config) > 1.9 * 14.7e6
    assert config.num_heads == 4 * config.num_kv_heads
    assert check_checkpoint_size(config, 30.0, "int8") < 29.5e6
    small = config_from_args(parser.parse_args([*out, "--shape", "large", "--num-layers", "4"]))
    assert small.dims.num_layers == 4 and small.dims.hidden_size == 512
