"""`herald generate` / `herald init-random`: user errors are one line and exit code 2."""

from __future__ import annotations

import pytest

from herald.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt", "x", "--device", "tpu"], "unknown --device"),
        (["generate", "--prompt", "x", "--block-size", "0"], "--block-size"),
        (["generate", "--prompt", "x", "--temperature", "nan"], "finite"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "--prompt", "x", "--threshold", "0"], "threshold"),
        (["generate", "--prompt", "x", "--max-prompt-tokens", "0"], "--max-prompt-tokens"),
        (["generate", "--prompt-file", "/definitely/not/here.py"], "No such file"),
        (["generate", "--prompt", "x", "--model", "no-such-model"], "neither"),
        (["generate", "--prompt", "x", "--mode", "herald", "--dtype", "fp32"], "bf16"),
        (["init-random", "--preset", "nosuch", "--out", "/tmp/x"], "nosuch"),
        (
            ["generate", "--mode", "herald", "--cpu-kv-tokens", "64", "--prompt", "a" * 300],
            "CPU pool holds",
        ),
        (
            [
                "generate",
                "--mode",
                "herald",
                "--cpu-kv-tokens",
                "64",
                "--cpu-kv-gb",
                "1",
                "--prompt",
                "a",
            ],
            "not both",
        ),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    if argv[0] == "generate" and "--model" not in argv:
        argv = [*argv, "--model", "tiny-sdar"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and message in err[-1]
    assert not any("Traceback" in line for line in err)


def test_prompt_file_is_a_directory(tmp_path, capsys):
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_context_overflow_is_refused_up_front(tmp_path, capsys):
    big = tmp_path / "big.txt"
    big.write_text("x" * 140_000)  # byte-level: 140K tokens > the tiny preset's 131072
    argv = ["generate", "--model", "tiny-sdar", "--prompt-file", str(big), "--quiet"]
    assert main(argv) == 2
    assert "--max-prompt-tokens" in capsys.readouterr().err


def test_init_random_refuses_existing_weights_and_generate_runs(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["init-random", "--preset", "tiny-llada2", "--out", str(out)]) == 0
    assert main(["init-random", "--preset", "tiny-llada2", "--out", str(out)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--model",
                str(out),
                "--prompt",
                "def f(x):",
                "--max-new-tokens",
                "8",
                "--quiet",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "RANDOM weights" in captured.err and "generated tokens 8" in captured.err


def test_offload_mode_prints_block_timing(capsys):
    argv = [
        "generate",
        "--model",
        "tiny-sdar",
        "--mode",
        "herald",
        "--kv-budget",
        "0.5",
        "--prompt",
        "a" * 80,
        "--max-new-tokens",
        "40",
        "--quiet",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "CPU KV pool" in err and "retrieval stream" in err and "boundary stall" in err


def test_default_model_is_the_bundled_trained_checkpoint(capsys):
    """No --model: the trained code model from checkpoints/code-sdar (issue 6), not a random
    preset; it loads with its BPE tokenizer and decodes on the CPU."""
    from herald.cli import DEFAULT_MODEL
    from herald.models.loader import BUNDLED_CHECKPOINTS

    assert DEFAULT_MODEL == "code-sdar"
    assert (BUNDLED_CHECKPOINTS[DEFAULT_MODEL] / "config.json").is_file()
    argv = ["generate", "--device", "cpu", "--prompt", "import os\n\n\ndef main(", "--quiet"]
    assert main([*argv, "--max-new-tokens", "32"]) == 0
    captured = capsys.readouterr()
    assert "RANDOM" not in captured.err and "generated tokens 32" in captured.err
    assert "SDARForCausalLM" in captured.err and captured.out.strip()


def test_missing_bundled_checkpoint_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from herald.models import loader

    monkeypatch.setitem(loader.BUNDLED_CHECKPOINTS, "code-sdar", tmp_path / "absent")
    assert main(["generate", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "bundled checkpoint 'code-sdar' is not at" in err and "pip install -e ." in err
