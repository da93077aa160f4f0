"""The progress bars of ``herald eval`` and ``herald generate``: tqdm's own pacing on a
terminal, one line per tenth of the total elsewhere (a log file, a pipe, CI), set by the count
alone, never by a clock."""

from __future__ import annotations

import io
import math
import re

import pytest

from herald.progress import NON_TTY_STEPS, bar_options, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drawn(text: str, total: int) -> list[int]:
    """The counts each redraw of a bar of ``total`` showed, in order."""
    return [int(n) for n in re.findall(rf"(\d+)/{total}\b", text)]


@pytest.mark.parametrize(("total", "every"), [(100, 10), (25, 3), (5, 1), (None, 1), (0, 1)])
def test_the_rate_off_a_terminal_is_a_tenth_of_the_total(total, every) -> None:
    assert bar_options(total, terminal=False) == {
        "miniters": every, "mininterval": 0.0, "maxinterval": math.inf,
    }  # fmt: skip
    assert bar_options(total, terminal=True) == {}  # tqdm's defaults


@pytest.mark.parametrize("manual", [False, True])
def test_a_bar_in_a_log_draws_each_tenth_once(manual: bool) -> None:
    """Iterated or updated by hand, 1000 steps draw the start and each tenth, whatever the
    time each step takes."""
    log = io.StringIO()  # not a terminal
    if manual:
        with progress(total=1000, file=log, desc="ex") as bar:
            for _ in range(1000):
                bar.update(1)
    else:
        for _ in progress(range(1000), file=log, desc="ex"):
            pass
    drawn = _drawn(log.getvalue(), 1000)
    assert sorted(set(drawn)) == list(range(0, 1001, 1000 // NON_TTY_STEPS)), drawn
    assert len(drawn) <= NON_TTY_STEPS + 2, drawn  # + the first draw and close()'s last


def test_a_terminal_keeps_tqdms_own_pacing() -> None:
    bar = progress(range(10), file=_Terminal())
    assert bar.mininterval == 0.1 and bar.miniters == 0 and bar.dynamic_miniters
    bar.close()
