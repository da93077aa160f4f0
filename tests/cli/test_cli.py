"""`herald generate` / `herald init-random`: user errors are one line and exit code 2 (an
option's value out of range: argparse's usage and error lines, as for a value it cannot parse)."""

from __future__ import annotations

import pytest
from helpers import user_error

from herald.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt", "x", "--device", "tpu"], "unknown --device"),
        (["generate", "--prompt", "x", "--block-size", "0"], "--block-size"),
        (["generate", "--prompt", "x", "--temperature", "nan"], "finite"),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be"),
        (["generate", "--prompt", "x", "--steps", "0"], "--steps must be"),
        (
            ["generate", "--prompt", "x", "--mode", "herald", "--selection-device", "gpu"],
            "--selection-device applies to --mode mage only",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "infinigen", "--kernel-output", "selected"],
            "--kernel-output applies where the CPU kernel selects",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "mage", "--first-pass", "int8-gpu"],
            "--first-pass applies to --mode herald only, not --mode mage",
        ),
        (
            [
                "generate",
                "--prompt",
                "x",
                "--mode",
                "herald",
                "--first-pass",
                "int8-gpu",
                "--kernel-output",
                "full",
            ],
            "--first-pass 'int8-gpu' needs --kernel-output selected",
        ),
        (
            ["generate", "--prompt", "x", "--first-pass", "int8"],
            "--first-pass applies to --mode herald only, not --mode dense",
        ),
        (
            ["serve", "--device", "cpu", "--mode", "infinigen", "--first-pass", "int8-gpu"],
            "--first-pass applies to --mode herald only",
        ),
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
        # --kv-pad is bounded (a huge one was OOM-killed / a C++ stack dump)
        (["generate", "--prompt", "x", "--kv-pad", "10000000"], "--kv-pad must be an integer in"),
        (["generate", "--prompt", "x", "--kv-pad", "99999999999999999999"], "[0, 65536]"),
        (["generate", "--prompt", "x", "--kv-pad", "-1"], "--kv-pad"),
        # a negative count with a suffix is a value (refused), not an option
        (["generate", "--prompt", "x", "--max-new-tokens", "-1K"], "must be > 0, got -1024"),
        (["serve", "--device", "cpu", "--max-seq-len", "-4K"], "must be >= 1, got -4096"),
        # --mode dense refuses the offloading flags, naming those given
        (
            ["generate", "--prompt", "x", "--kv-budget", "7", "--cpu-kv-gb", "-3"],
            "--kv-budget and --cpu-kv-gb need an offloading --mode",
        ),
        (["generate", "--prompt", "x", "--lookahead", "off"], "--lookahead needs an offloading"),
        (
            [
                "generate",
                "--prompt",
                "x",
                "--mode",
                "dense",
                "--cpu-kv-tokens",
                "64",
                "--selection-device",
                "gpu",
                "--kernel-output",
                "full",
            ],
            "--cpu-kv-tokens, --selection-device and --kernel-output need an offloading --mode",
        ),
        # pool sizes: finite positive, named by their flag
        (
            ["generate", "--prompt", "x", "--mode", "herald", "--cpu-kv-gb", "inf"],
            "finite positive",
        ),
        (["generate", "--prompt", "x", "--mode", "herald", "--cpu-kv-gb", "nan"], "--cpu-kv-gb"),
        (
            ["generate", "--prompt", "x", "--mode", "herald", "--cpu-kv-gb", "-1"],
            "--cpu-kv-gb must be a finite positive number",
        ),
        (
            ["generate", "--prompt", "x", "--mode", "mage", "--cpu-kv-tokens", "0"],
            "--cpu-kv-tokens",
        ),
        (["generate", "--prompt", "x", "--mode", "herald", "--cpu-kv-gb", "1e-9"], "--cpu-kv-gb"),
        # OffloadConfig's errors in CLI flag syntax
        (
            ["generate", "--prompt", "x", "--mode", "mage", "--lookahead", "draft"],
            "(use --lookahead off)",
        ),
        (["generate", "--prompt", "x", "--mode", "herald", "--kv-budget", "7"], "--kv-budget must"),
        (["generate", "--prompt", "x", "--mode", "mage", "--dtype", "fp16"], "--dtype"),
        (["generate", "--prompt", "x", "--mask-token-id", "-1"], "--mask-token-id"),
        (["generate", "--prompt", "x", "--mask-token-id", "99999"], "--mask-token-id 99999"),
        (["serve", "--device", "cpu", "--kv-pad", "10000000"], "--kv-pad must be an integer in"),
        (["serve", "--device", "cpu", "--kv-pad", "-1"], "[0, 65536]"),
        (
            ["serve", "--device", "cpu", "--mode", "herald", "--cpu-kv-gb", "nan"],
            "--cpu-kv-gb must be a finite positive number",
        ),
        # an empty key (an unset "$KEY") must not open the server; no room for one block
        (["serve", "--device", "cpu", "--api-key", ""], "--api-key is empty"),
        (["serve", "--device", "cpu", "--api-key", "  "], "--api-key is empty"),
        (["serve", "--device", "cpu", "--max-seq-len", "10"], "give at least 33"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    if argv[0] == "generate" and "--model" not in argv:
        argv = [*argv, "--model", "tiny-sdar"]
    assert main(argv) == 2
    assert message in user_error(capsys.readouterr().err, alone=False)


@pytest.mark.parametrize(
    "flags",
    [
        ["--kv-pad", "65537"],
        ["--kv-budget", "0.5"],
        ["--mode", "herald", "--kv-budget", "0"],
        ["--mode", "herald", "--cpu-kv-gb", "0"],
        ["--mode", "herald", "--cpu-kv-tokens", "8", "--cpu-kv-gb", "1"],
        ["--mode", "infinigen", "--lookahead", "draft"],
        ["--mode", "herald", "--dtype", "fp32"],
        ["--mask-token-id", "-1"],
    ],
)
def test_settings_are_checked_before_the_model_loads(flags, monkeypatch, capsys):
    from herald.models import loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    argv = ["generate", "--model", "tiny-sdar", "--prompt", "x", *flags]
    assert main(argv) == 2
    msg = user_error(capsys.readouterr().err)
    assert "--" in msg and "ValueError" not in msg  # a user error: its message, not its class


@pytest.mark.parametrize("mode", ["dense", "herald"])
@pytest.mark.parametrize(
    ("switch", "allowed"),
    [
        ("HERALD_PREFILL_ATTENTION", "expected one of auto, triton, sdpa"),
        ("HERALD_COMPILE", "expected 1/true/yes/on or 0/false/no/off"),
        ("HERALD_CPU_MATMUL", "expected one of auto, native, fp32"),
    ],
)
def test_a_bad_herald_switch_is_refused_in_every_mode(switch, allowed, mode, monkeypatch, capsys):
    """A HERALD_* environment switch with a bad value is named before anything loads, with the
    values it takes, also in a mode that never reads that switch (a typo must not wait for the
    mode that does)."""
    from herald.env import settings
    from herald.models import loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the switches were checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    monkeypatch._inner.setenv(switch, "bogus")  # unparsed until main's check
    settings.cache_clear()
    assert main(["generate", "--model", "tiny-sdar", "--prompt", "x", "--mode", mode]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{switch}='bogus'; {allowed}" in err[0], err


@pytest.mark.parametrize(
    ("value", "compiled"),
    [("", True), ("1", True), ("on", True), ("Yes", True), ("0", False), ("false", False),
     ("OFF", False)],
)  # fmt: skip
def test_herald_compile_values(value, compiled):
    from herald.env import parse

    assert parse({"HERALD_COMPILE": value}).compile is compiled


def test_mask_token_id_beyond_the_vocabulary(capsys):
    """A checkpoint with a real tokenizer (the bundled one) checks no special ids: the CLI checks
    the id against the vocabulary once the model has loaded (it was an IndexError)."""
    argv = ["generate", "--device", "cpu", "--prompt", "x", "--mask-token-id", "99999"]
    assert main(argv) == 2
    msg = user_error(capsys.readouterr().err, alone=False)  # after the "loading" line
    assert "--mask-token-id 99999 is out of range" in msg and "vocabulary has" in msg


def test_help_states_defaults_and_which_modes_use_a_flag(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "herald 0.05, mage 0.025, infinigen 0.2" in help_text
    assert "bf16 with an offloading --mode" in help_text
    assert "--mode mage only" in help_text and "Refused with --mode herald" in help_text


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
    last = err.strip().splitlines()[-1]
    assert last.startswith("CPU KV pool: 0 of ") and last.endswith(" pages in use after the run")


def test_default_model_is_the_bundled_trained_checkpoint(capsys):
    """No --model: the trained code model from checkpoints/code-sdar, not a random
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


def test_every_option_states_its_default():
    """Every option of every subcommand has help that ends with its default (added by the help
    formatter) or says in words what it is when unset; plain flags and required options
    excepted (an --x/--no-x pair with a default is not a plain flag)."""
    import argparse

    from herald.cli import build_parser
    from herald.cliargs import HelpFormatter

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
            elif action.option_strings and not isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)
            ):
                yield " ".join(path), action

    missing = []
    for path, action in walk(build_parser(), []):
        on_off = isinstance(action, argparse.BooleanOptionalAction) and action.default is not None
        if (
            action.required
            or (action.nargs == 0 and not on_off)
            or action.help == argparse.SUPPRESS
        ):
            continue  # a plain flag is off unless given; an --x/--no-x pair must say which
        text = HelpFormatter("herald")._get_help_string(action)
        if not action.help or "default" not in text.lower():
            missing.append(f"{path} {action.option_strings[-1]}")
    assert not missing, missing


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["serve", "--bogus"], "herald serve: error: unrecognized arguments: --bogus"),
        (["generate", "--prompt", "x", "--nope", "1"], "herald generate: error: unrecognized"),
        (["bench", "throughput", "--bogus"], "herald bench throughput: error: unrecognized"),
    ],
)
def test_unknown_option_is_reported_with_the_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert usage in err
    assert "usage: herald [-h] [--version] COMMAND" not in err


def test_generate_says_what_it_loads_unless_quiet(capsys):
    argv = ["generate", "--model", "tiny-sdar", "--device", "cpu", "--prompt", "ab"]
    assert main([*argv, "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "loading tiny-sdar (SDARForCausalLM, " in err
    assert " MiB of float32 weights) on cpu" in err
    assert main([*argv, "--max-new-tokens", "4", "--quiet"]) == 0
    assert "loading" not in capsys.readouterr().err


def test_token_counts_take_a_k_suffix():
    from herald.cli import build_parser

    p = build_parser()
    a = p.parse_args(["serve", "--max-model-len", "4K", "--max-prefill-tokens", "8k"])
    assert (a.max_seq_len, a.max_prefill_tokens) == (4096, 8192)
    a = p.parse_args(
        ["generate", "--prompt", "x", "--max-new-tokens", "1K", "--max-prompt-tokens", "2k"]
    )
    assert (a.max_new_tokens, a.max_prompt_tokens) == (1024, 2048)
    assert p.parse_args(["serve", "--cpu-kv-tokens", "32K"]).cpu_kv_tokens == 32768


def test_a_vllm_alias_is_named_in_its_error(capsys):
    assert main(["serve", "--device", "cpu", "--max-num-seqs", "0"]) == 2
    assert "--max-batch-size (--max-num-seqs) must be >= 1, got 0" in capsys.readouterr().err


def test_a_missing_file_is_named_without_errno_noise(tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    assert main(["generate", "--prompt-file", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {missing}: No such file or directory"]


def test_an_old_name_with_its_new_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--budget", "0.1", "--kv-budget=0.2", "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "herald bench throughput: error: --budget is the old name of --kv-budget" in err
    for argv in (["--budget", "0.1", "--kv-bud", "0.2"], ["--budg=0.1", "--kv-budget", "0.2"]):
        with pytest.raises(SystemExit):  # argparse's prefixes of either name count too
            main(["bench", "forward", *argv, "--dry-run"])
        assert "--budget is the old name of --kv-budget" in capsys.readouterr().err


def test_generate_paces_its_bars_for_a_log(capsys, monkeypatch):
    """stderr captured (not a terminal): the prefill and decoding bars take the log pacing of
    :mod:`herald.progress` (a line per tenth of their totals), not tqdm's timer."""
    import herald.progress

    asked: list[tuple[int | None, bool]] = []
    real = herald.progress.bar_options

    def recording(total: int | None, terminal: bool) -> dict:
        asked.append((total, terminal))
        return real(total, terminal)

    monkeypatch.setattr(herald.progress, "bar_options", recording)
    prompt = "def f(x):\n    return x\n" * 8  # over one block: a prefill bar too
    argv = ["generate", "--model", "tiny-sdar", "--device", "cpu", "--prompt", prompt]
    assert main([*argv, "--max-new-tokens", "40"]) == 0
    assert len(asked) == 2 and all(not terminal for _, terminal in asked)
    assert asked[1][0] == 40  # the decoding bar's total
    err = capsys.readouterr().err
    assert "prefill" in err and "decoding" in err


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"], ["eval"]])
@pytest.mark.parametrize(
    "flags", [["--steps", "4", "--threshold", "0.9"], ["--threshold", "0.95", "--steps", "4"]]
)
def test_steps_and_threshold_are_refused_together(command, flags, capsys):
    """Two denoising modes, and fixed steps use no threshold: given both, the threshold was
    dropped without a word. Refused as argparse refuses any two exclusive options."""
    with pytest.raises(SystemExit) as e:
        main([*command, *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"usage: herald {command[0]} "), err
    assert (
        err[-1].startswith(f"herald {command[0]}: error: argument --")
        and "not allowed with" in err[-1]
    )


@pytest.mark.parametrize(
    ("command", "flag", "bad", "says"),
    [
        (["generate", "--model", "tiny-sdar", "--prompt", "x"], "--steps", "0", "must be in [1, "),
        (["serve", "--device", "cpu"], "--threshold", "2", "must be in (0, 1], got 2"),
        (["eval", "--model", "tiny-sdar", "--device", "cpu", "--out", "OUT"], "--steps", "0",
         "must be >= 1"),
        (["bench", "throughput", "--model", "tiny-sdar", "--context", "256", "--batches", "1",
          "--out", "OUT"], "--steps", "0", "must be >= 1"),
        (["bench", "forward", "--out", "OUT"], "--steps", "0", "must be >= 1"),
        (["train", "--out", "OUT"], "--lr", "-1", "must be a positive number"),
    ],
)  # fmt: skip
def test_a_value_out_of_range_is_reported_as_one_of_the_wrong_type(
    command, flag, bad, says, tmp_path, capsys
):
    """``--steps 0`` was a bare ``error:`` line where ``--steps x`` is argparse's usage and
    ``PROG: error: ...``: both are argparse's now, the message kept."""
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    with pytest.raises(SystemExit) as e:
        main([*argv, flag, "x"])
    typed = capsys.readouterr().err.strip().splitlines()
    assert main([*argv, flag, bad]) == 2 == e.value.code
    ranged = capsys.readouterr().err.strip().splitlines()
    prog = "herald " + " ".join(command[: 2 if command[0] == "bench" else 1])
    assert typed[-1].startswith(f"{prog}: error: argument {flag}: invalid "), typed
    assert ranged[:-1] == typed[:-1] and ranged[0].startswith(f"usage: {prog} "), ranged
    assert ranged[-1].startswith(f"{prog}: error: {flag} {says}"), ranged
    assert not (tmp_path / "out").exists()
