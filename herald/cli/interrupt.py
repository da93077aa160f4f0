"""Ctrl-C on the ``herald`` command, also while torch imports and where a library drops it.

Python's SIGINT handler raises KeyboardInterrupt at the next bytecode, wherever that is, and
torch's import is not safe against that: its extension imports numpy from C++ and drops whatever
that import raised (the command ran on as if never interrupted, or failed later on the
half-imported numpy), and an exception raised while ``torch._C._c10d_init`` runs Python aborts
the process (``terminate called after throwing ... error_already_set``). Later, some C code
still drops an interrupt it ran into (numpy turns an interrupted import of ``datetime`` into an
ImportError; an exception in a weakref callback, which the import system uses, is only printed).

So the command runs inside :func:`recorded`, where SIGINT raises KeyboardInterrupt as before and
is also remembered: the command stops at its next :func:`check`, and reports an error that
follows an interrupt as the interrupt (:func:`seen`). And it imports its modules inside
:func:`deferred`, where a first SIGINT is only remembered and raised once they are imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_seen = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt


def _defer(signum: int, frame: FrameType | None) -> None:
    global _seen
    if _seen:  # a second Ctrl-C: at once
        raise KeyboardInterrupt
    _seen = True


@contextmanager
def recorded() -> Iterator[None]:
    """Record every SIGINT while inside. Only where Python's own handler is in place, in the
    main thread: a process that ignores SIGINT (a background job of a script) still does."""
    global _seen
    _seen = False
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def deferred() -> Iterator[None]:
    """Inside :func:`recorded`: a first SIGINT is only recorded, and raises KeyboardInterrupt
    when the block ends; a second raises at once. For code that an exception at an arbitrary
    bytecode breaks (an import of torch). Elsewhere: nothing changes."""
    if signal.getsignal(signal.SIGINT) is not _on_sigint:
        yield
        return
    signal.signal(signal.SIGINT, _defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, _on_sigint)
    check()


def quiet_exit_on_next() -> None:
    """After a Ctrl-C ended the command: another SIGINT while the interpreter shuts down (its
    atexit handlers and threads take ~0.7 s once torch is loaded) ends the process at once with
    status 130, instead of raising KeyboardInterrupt wherever it lands (a traceback from an
    atexit handler). Only where Python's own handler is in place, in the main thread."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        signal.signal(signal.SIGINT, _exit_now)


def _exit_now(signum: int, frame: FrameType | None) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(130)


def seen() -> bool:
    """Whether a SIGINT came since :func:`recorded` last began (also after it ended)."""
    return _seen


def check() -> None:
    """Raise KeyboardInterrupt if a SIGINT came (whether or not something swallowed it)."""
    if _seen:
        raise KeyboardInterrupt
