"""A gate in front of a live server's engine steps, so that HTTP tests order events by what the
engine has done rather than by how long things take.

``hold_after(cond)`` closes the gate from the engine thread itself, right after a step at whose
end ``cond()`` holds: the engine then waits before its next step until the test calls
``open()``. No sleep races the server, however slow the machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from herald.engine.base import Engine

HOLD_LIMIT_S = 120.0
"""Seconds the engine waits at a closed gate at most: a failing test must not hang the server."""


class EngineGate:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._open = threading.Event()
        self._open.set()
        self.held = threading.Event()  # the engine thread is waiting at the gate
        self._cond: Callable[[], bool] | None = None

    def step(self, real_step: Callable[[], Any]) -> Any:
        if not self._open.is_set():
            self.held.set()
            self._open.wait(HOLD_LIMIT_S)
            self.held.clear()
        out = real_step()
        if self._cond is not None and self._cond():
            self._cond = None
            self._open.clear()
        return out

    def hold_after(self, cond: Callable[[], bool]) -> None:
        """Close the gate after the first step at whose end ``cond()`` is true."""
        self._cond = cond

    def open(self) -> None:
        self._cond = None
        self._open.set()


@contextmanager
def engine_gate(engine: Engine) -> Iterator[EngineGate]:
    """Put an :class:`EngineGate` in front of ``engine.step`` (open; removed and opened on exit)."""
    gate = EngineGate(engine)
    patched = vars(engine).get("step")  # an instance attribute already (another wrapper)
    real_step = engine.step
    engine.step = lambda: gate.step(real_step)  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.open()
        if patched is None:
            del engine.step
        else:
            engine.step = patched  # type: ignore[method-assign]


def running(engine: Engine, max_new_tokens: int, min_tokens: int = 1) -> bool:
    """Whether a running request of ``max_new_tokens`` has at least ``min_tokens`` output."""
    return any(
        r.params.max_new_tokens == max_new_tokens and len(r.output_ids) >= min_tokens
        for r in engine.batch.requests
    )
