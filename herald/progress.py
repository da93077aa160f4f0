"""The progress bars of ``herald eval`` and ``herald generate`` on stderr: tqdm's, paced for
where stderr goes.

On a terminal tqdm redraws its bar in place, at most every 0.1 s. In a log file, a pipe or a
CI log every redraw stays as a line of its own, and an eval runs for hours (a long prompt's
prefill for minutes): there a bar draws
once per tenth of its total (:data:`NON_TTY_STEPS`), through tqdm's own ``miniters``, with its
time-based pacing off so that the count alone sets the rate (:func:`bar_options`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sized
from typing import IO, Any

from tqdm import tqdm

NON_TTY_STEPS = 10
"""Redraws of a bar over its whole total when stderr is not a terminal (plus its first)."""


def is_terminal(file: IO[str]) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def bar_options(total: int | None, terminal: bool) -> dict[str, Any]:
    """tqdm keyword arguments for a bar of ``total`` steps: tqdm's defaults on a ``terminal``;
    elsewhere a redraw every ``total / NON_TTY_STEPS`` steps (``miniters``; every step when
    ``total`` is unknown), never on a timer: ``mininterval`` 0 lets each of those redraws
    through, and ``maxinterval`` infinite keeps tqdm's monitor thread from forcing a redraw
    after 10 s without one (it also sets ``miniters`` back to 1, a line per step again)."""
    if terminal:
        return {}
    every = max(1, math.ceil(total / NON_TTY_STEPS)) if total else 1
    return {"miniters": every, "mininterval": 0.0, "maxinterval": math.inf}


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    total: int | None = None,
    file: IO[str] | None = None,
    **kwargs: Any,
) -> tqdm:
    """A tqdm bar on ``file`` (default stderr) paced by :func:`bar_options`; ``total`` defaults
    to ``len(iterable)``."""
    out = sys.stderr if file is None else file
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    opts = bar_options(total, is_terminal(out))
    return tqdm(iterable, total=total, file=out, **opts, **kwargs)
