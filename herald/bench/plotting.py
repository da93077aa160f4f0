"""Optional matplotlib for the research reports (throughput, kernel and accuracy evaluation).

matplotlib is the ``plot`` extra, not a core dependency: the reports import it only through
:func:`pyplot`, and where it is missing they still write their tables and say once, with
:func:`skipped`, that their plots were skipped and how to get them.
"""

from __future__ import annotations

import sys
from typing import Any

INSTALL_HINT = "pip install 'herald[plot]' (from a checkout: pip install -e '.[plot]')"
"""How to install matplotlib for the plots."""


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None where matplotlib is not
    installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def skipped(what: str) -> str:
    """Print, on stderr, the one line saying that ``what`` (e.g. "throughput report") was
    written without its plots and how to get them; returns that line."""
    line = f"{what}: plots skipped (matplotlib is not installed); for plots: {INSTALL_HINT}"
    print(line, file=sys.stderr, flush=True)
    return line
