"""Every ``herald`` option has plain-text help with its default; one name per concept across the
subcommands (old names still accepted, with a warning); lists take spaces or commas."""

from __future__ import annotations

import argparse
import re

import pytest

from herald import __version__
from herald.cli import build_parser, main
from herald.cliargs import HelpFormatter, plain

MARKUP = re.compile(r"``|:[a-z]+:`|\bissue\b|#\d+", re.IGNORECASE)


def _parsers(parser: argparse.ArgumentParser, name: str = "herald"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


PARSERS = dict(_parsers(build_parser()))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_option_has_plain_help_and_shows_its_default(name: str) -> None:
    parser = PARSERS[name]
    text = parser.format_help()
    assert not MARKUP.search(text), MARKUP.search(text)
    formatter = HelpFormatter(name)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:  # a deprecated alias, hidden
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        shown = formatter._get_help_string(action) % {"default": action.default}
        default = action.default
        if (
            default not in (None, [], argparse.SUPPRESS)
            and default is not False
            and action.nargs != 0
        ):
            assert "default" in shown.lower(), f"{name} {action.option_strings[0]}: {shown}"


def test_plain_reduces_rest_markup() -> None:
    assert plain("see :func:`~herald.server.launch.serve` in :mod:`herald.server`") == (
        "see serve in herald.server"
    )
    assert plain("``--out`` and ``x``") == "--out and x"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"herald {__version__}"


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "old", "new", "dest", "value"),
    [
        (["eval", "--out", "x", "--budgets", "0.1", "0.2"], "--budgets", "--kv-budget",
         "budgets", [0.1, 0.2]),
        (["eval", "--out", "x", "--time-limit", "60"], "--time-limit", "--time-limit-s",
         "time_limit", 60.0),
        (["bench", "throughput", "--budget", "0.5"], "--budget", "--kv-budget", "budget", 0.5),
    ],
)  # fmt: skip
def test_deprecated_names_still_work_and_warn(
    argv: list[str], old: str, new: str, dest: str, value: object,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    assert getattr(_parse(argv), dest) == value
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {old} is deprecated and will be removed; use {new}"]
    command = "herald " + " ".join(a for a in argv[:2] if not a.startswith("-"))
    words = PARSERS[command].format_help().replace(",", " ").split()
    assert new in words and old not in words  # hidden from the help


def test_one_name_per_concept_across_subcommands() -> None:
    assert _parse(["eval", "--out", "x", "--kv-budget", "0.05"]).budgets == [0.05]
    assert _parse(["bench", "throughput", "--kv-budget", "0.05"]).budget == 0.05
    assert _parse(["generate", "--prompt", "x", "--kv-budget", "0.05"]).kv_budget == 0.05
    assert _parse(["eval", "--out", "x", "--time-limit-s", "9"]).time_limit == 9.0
    assert _parse(["bench", "throughput", "--time-limit-s", "9"]).time_limit_s == 9.0


def test_lists_take_spaces_or_commas() -> None:
    for argv in (["4096", "8192"], ["4096,8192"], ["4096,", "8192"]):
        assert _parse(["eval", "--out", "x", "--contexts", *argv]).contexts == [4096, 8192]
        bench = _parse(["bench", "throughput", "--batches", *argv])
        assert bench.batches == [4096, 8192]
    assert _parse(["eval", "--out", "x", "--task", "line,recall"]).task == ["line", "recall"]
    args = _parse(["bench", "throughput", "--caps", "80,none", "--mode", "dense", "herald"])
    assert args.caps == [80.0, None] and args.mode == ["dense", "herald"]


def test_list_choices_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["eval", "--out", "x", "--task", "line,nope"])
    assert "invalid choice 'nope'" in capsys.readouterr().err


def test_vllm_names_for_the_same_serve_settings() -> None:
    args = _parse(["serve", "--max-model-len", "1024", "--max-num-seqs", "3"])
    assert args.max_seq_len == 1024 and args.max_batch_size == 3
    args = _parse(["serve", "--max-seq-len", "512", "--max-batch-size", "2"])
    assert args.max_seq_len == 512 and args.max_batch_size == 2
