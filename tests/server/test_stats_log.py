"""The serving log's periodic throughput line: when it is logged (an injected clock, no
waiting) and what it says (``herald serve --disable-log-stats``: tests/server/test_serve_cli.py)."""

from __future__ import annotations

import logging

import pytest

from herald.server.stats_log import LOG_INTERVAL_SECONDS, StatsLine


def test_one_line_per_interval_while_busy_and_one_when_idle_again() -> None:
    s = StatsLine()
    assert s.line(0.0, 0.0, 0.0, 0, 0) is None  # idle from the start: nothing
    first = s.line(1.0, 120.5, 3000.0, 4, 2)
    assert first == (
        "engine: 120.5 generated tok/s, 3,000.0 prompt tok/s (trailing window); 4 running, "
        "2 waiting"
    )
    assert s.line(1.0 + LOG_INTERVAL_SECONDS / 2, 99.0, 0.0, 4, 0) is None  # within the interval
    assert s.line(1.0 + LOG_INTERVAL_SECONDS, 99.0, 0.0, 4, 0) is not None
    last = s.line(1.0 + 2 * LOG_INTERVAL_SECONDS, 0.0, 0.0, 0, 0)  # gone idle: one more line
    assert last is not None and "0 running, 0 waiting" in last
    assert s.line(1.0 + 3 * LOG_INTERVAL_SECONDS, 0.0, 0.0, 0, 0) is None  # then silent
    assert s.line(1.0 + 3 * LOG_INTERVAL_SECONDS, 0.0, 0.0, 0, 1) is not None  # work again


def test_maybe_log_logs_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="herald.server.stats"):
        StatsLine().maybe_log(5.0, 10.0, 0.0, 1, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "engine: 10.0 generated tok/s, 0.0 prompt tok/s (trailing window); 1 running, 0 waiting"
    ]
