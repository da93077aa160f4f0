"""The serving log's periodic throughput line, as vLLM's "Avg prompt throughput" line: every
:data:`LOG_INTERVAL_SECONDS` while the engine has work (and once more when it has gone idle),
the generated and prompt tokens per second over the trailing rate window, and the running and
waiting requests. The same figures are gauges on ``/metrics``; the line is for whoever watches
the server's output. ``herald serve --disable-log-stats`` turns it off."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("herald.server.stats")

LOG_INTERVAL_SECONDS = 10.0
"""Seconds between two lines, at least."""


@dataclass
class StatsLine:
    """Decides when to log (engine thread; times from one monotonic clock)."""

    interval: float = LOG_INTERVAL_SECONDS
    _last: float | None = None
    _busy: bool = False  # the last line logged showed work

    def line(
        self, now: float, generated: float, prompt: float, running: int, waiting: int
    ) -> str | None:
        """The line to log at ``now``, or None: one per interval while there is work (requests
        running or waiting, or a rate above 0), one more when there is none any longer."""
        busy = bool(running or waiting or generated > 0 or prompt > 0)
        if not busy and not self._busy:
            return None
        if self._last is not None and now - self._last < self.interval:
            return None
        self._last, self._busy = now, busy
        return (
            f"engine: {generated:,.1f} generated tok/s, {prompt:,.1f} prompt tok/s (trailing "
            f"window); {running} running, {waiting} waiting"
        )

    def maybe_log(
        self, now: float, generated: float, prompt: float, running: int, waiting: int
    ) -> None:
        text = self.line(now, generated, prompt, running, waiting)
        if text is not None:
            log.info("%s", text)
