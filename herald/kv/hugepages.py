"""Transparent huge pages under the CPU KV pool (Linux).

The selection kernel streams the whole pool once per block; on 4 KiB pages a 100 GiB pool spans
26 million pages, each a TLB entry to walk for. :func:`advise_huge_pages` asks the kernel, before
the memory is first touched, to back it with 2 MiB pages (``madvise(MADV_HUGEPAGE)``); it takes
effect where transparent huge pages are ``always`` or ``madvise``
(``/sys/kernel/mm/transparent_hugepage/enabled``) and is a no-op elsewhere.
:func:`anon_huge_bytes` reads how much of the process's memory the kernel did give huge pages
(``AnonHugePages`` of ``/proc/self/smaps_rollup``).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

HUGE_PAGE = 2 * 1024**2
"""Bytes of one x86-64 transparent huge page."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice number for transparent huge pages."""


def advise_huge_pages(addr: int, nbytes: int) -> bool:
    """Advise 2 MiB pages for the whole huge pages inside ``[addr, addr + nbytes)``. True when
    the advice was taken (Linux with transparent huge pages), False otherwise; never raises."""
    start = -(-addr // HUGE_PAGE) * HUGE_PAGE
    end = (addr + nbytes) // HUGE_PAGE * HUGE_PAGE
    if not sys.platform.startswith("linux") or end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return bool(madvise(start, end - start, MADV_HUGEPAGE) == 0)


def anon_huge_bytes(smaps_rollup: Path = Path("/proc/self/smaps_rollup")) -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (None where the
    kernel does not say)."""
    try:
        text = smaps_rollup.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024  # in kB
    return None
