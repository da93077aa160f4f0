"""``herald bench throughput|forward|serve --help``: plain text for a user (no reST, no internal
module names, nothing about where the project measures), and every on/off flag's default."""

from __future__ import annotations

import argparse
import re

import pytest

from herald.cli import build_parser

BENCHES = ("throughput", "forward", "serve")


def _bench_parser(name: str) -> argparse.ArgumentParser:
    root = build_parser()
    (sub,) = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)]
    (bench,) = [a for a in sub.choices["bench"]._actions
                if isinstance(a, argparse._SubParsersAction)]  # fmt: skip
    parser: argparse.ArgumentParser = bench.choices[name]
    return parser


@pytest.mark.parametrize("name", BENCHES)
def test_the_help_is_plain_text_for_a_user(name: str) -> None:
    text = _bench_parser(name).format_help()
    assert "::" not in text and ":mod:" not in text and "``" not in text
    # the module named to run it (python -m herald.bench.NAME) is a command, not a reference
    assert re.findall(r"(?<!-m )herald\.[a-z_]+\.", text) == []
    assert "scripts/" not in text and "GPU machine" not in text


@pytest.mark.parametrize("name", BENCHES)
def test_every_on_off_flag_states_its_default(name: str) -> None:
    """--x / --no-x flags take no value, so the help formatter adds no default: their help says
    it."""
    for action in _bench_parser(name)._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            assert "default" in (action.help or ""), action.option_strings


def _help_of(name: str, flag: str) -> str:
    parser = _bench_parser(name)
    action = parser._option_string_actions[flag]
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_throughput_and_forward_agree_on_selection_threads_and_say_why_reserves_differ() -> None:
    # both leave the thread count to the engines (herald.env.selection_threads)
    threads = {_help_of(name, "--selection-threads") for name in ("throughput", "forward")}
    assert threads == {
        "CPU selection kernel threads (default: $HERALD_SELECTION_THREADS, else every usable core)"
    }
    # the DRAM reserves differ for a reason each help gives, beside its own default
    throughput = _help_of("throughput", "--dram-reserve-gb")
    assert "(default: 16.0; bench forward keeps 4" in throughput and "staging" in throughput
    forward = _help_of("forward", "--dram-reserve-gb")
    assert "(default: 4.0; bench throughput keeps 16" in forward and "staging" in forward
