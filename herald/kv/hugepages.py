"""Transparent huge pages under the CPU KV pool (Linux): asked for, or refused.

The selection kernel streams the pool once per block. 2 MiB pages save TLB walks, but measured on
the GPU host (LLaDA2.0-mini 32K, HERALD bs 80, 90 GiB pool; ``results/offload/huge_pages/``) the
kernel read 48 GB/s on them against 67 GB/s on 4 KiB pages (97% of that run's DRAM probe), and
the whole benchmark fell from 2,642 to 1,927 tok/s. A likely cause: the kernel's threads stream
different requests' pages in step, so on huge pages their physical addresses share bits 0-20 and
meet the same DRAM banks at once, where 4 KiB pages scatter them. So the pool asks for 4 KiB
pages by default (``HERALD_HUGE_PAGES``).

:func:`advise_pages` tells the kernel, before the memory is first touched, to back it with 2 MiB
pages (``madvise(MADV_HUGEPAGE)``, effective where transparent huge pages are ``always`` or
``madvise`` in ``/sys/kernel/mm/transparent_hugepage/enabled``) or never to
(``MADV_NOHUGEPAGE``, which matters where they are ``always``). :func:`anon_huge_bytes` reads how
much of the process's memory the kernel did put on huge pages (``AnonHugePages`` of
``/proc/self/smaps_rollup``).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

HUGE_PAGE = 2 * 1024**2
"""Bytes of one x86-64 transparent huge page."""
MADV_HUGEPAGE = 14
"""Linux's ``madvise`` advice number for transparent huge pages."""
MADV_NOHUGEPAGE = 15
"""Linux's ``madvise`` advice number for no transparent huge pages."""


def advise_pages(addr: int, nbytes: int, *, huge: bool) -> bool:
    """Advise 2 MiB pages (``huge``) or none for the whole huge pages inside
    ``[addr, addr + nbytes)``. True when the advice was taken (Linux with transparent huge
    pages), False otherwise; never raises."""
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
    advice = MADV_HUGEPAGE if huge else MADV_NOHUGEPAGE
    return bool(madvise(start, end - start, advice) == 0)


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
