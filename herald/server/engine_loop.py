"""EngineLoop: the one background thread that owns a :class:`DenseEngine` while serving.

HTTP handlers never touch the engine. They :meth:`EngineLoop.submit` a prompt (thread-safe; it
refuses with :class:`QueueFullError` when the bounded waiting queue is full) and read a
:class:`Handle`'s asyncio queue, which the engine thread feeds through
``loop.call_soon_threadsafe``: one ``("tokens", ids)`` item per completed block, then
``("done", finish_reason)`` or ``("error", exception)``. :meth:`EngineLoop.cancel` aborts a
request; the engine frees its row and KV slot at the next step boundary.

Continuous batching: every engine step admits waiting requests (up to ``max_batch_size``
running) and finished ones leave. An exception while adding a request fails that request only; an
exception inside a batched step cannot be attributed to one request, so it fails the requests
that were running in that step (they are aborted, their slots freed) and the loop keeps going.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from herald.config import SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.request import Request, RequestStatus
from herald.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (HTTP 503)."""


@dataclass
class Handle:
    """One submitted request as the HTTP side sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    request: Request | None = None
    sent: int = 0  # output tokens already pushed
    cancelled: bool = False

    def _push(self, item: tuple[str, Any]) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Runs ``engine.step()`` in a daemon thread and routes tokens to per-request queues.

    Args:
        engine: the engine this thread owns from :meth:`start` on.
        max_waiting: requests submitted but not yet running, at most.
        metrics: optional Prometheus metrics to update after each step.
    """

    def __init__(
        self, engine: DenseEngine, *, max_waiting: int = 64, metrics: ServerMetrics | None = None
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._inbox: queue.Queue[tuple[str, Handle]] = queue.Queue()
        self._lock = threading.Lock()
        self._num_waiting = 0  # submitted, not yet running nor finished (guarded by _lock)
        self._num_running = 0
        self.num_aborted = 0  # requests aborted while waiting or running (engine thread writes)
        self._live: list[Handle] = []  # engine thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="herald-engine", daemon=True)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # -- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._num_waiting

    @property
    def num_running(self) -> int:
        with self._lock:
            return self._num_running

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> Handle:
        """Queue a prompt; raises :class:`QueueFullError` when ``max_waiting`` are waiting."""
        handle = Handle(list(prompt_ids), params, loop)
        with self._lock:
            if self._num_waiting >= self.max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({self.max_waiting} requests); retry later"
                )
            self._num_waiting += 1
            self._inbox.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Abort ``handle``'s request (a disconnected client); no-op once it has finished."""
        if not handle.cancelled:
            handle.cancelled = True
            self._inbox.put(("abort", handle))

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            self._drain(block=idle)
            if not self.engine.has_unfinished():
                if self._live:  # e.g. a waiting request aborted: tell its handler
                    self._publish(None)
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
            except Exception as e:  # fail the requests of this step only
                log.exception("engine step failed")
                self._fail_running(e)
            dt = time.perf_counter() - t0
            self._publish(dt)
            st = self.engine.stats  # per-step lists grow without bound in a long-lived server
            if len(st.step_seconds) > 10_000:
                del st.step_seconds[:-1000], st.step_batch_sizes[:-1000]

    def _drain(self, *, block: bool) -> None:
        try:
            cmd, h = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                self._add(h)
            elif h.request is not None and not h.request.status.finished:
                self.engine.abort(h.request)
            try:
                cmd, h = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, h: Handle) -> None:
        if h.cancelled:
            with self._lock:
                self._num_waiting -= 1
            return
        try:
            h.request = self.engine.add_request(h.prompt_ids, h.params)
        except Exception as e:
            with self._lock:
                self._num_waiting -= 1
            h._push(("error", e))
            return
        self._live.append(h)

    def _fail_running(self, exc: Exception) -> None:
        for h in self._live:
            req = h.request
            if req is not None and req.status == RequestStatus.RUNNING:
                self.engine.abort(req)
                h._push(("error", exc))

    def _publish(self, step_seconds: float | None) -> None:
        """Push new blocks and finishes; update the counts and metrics."""
        new_tokens = 0
        still: list[Handle] = []
        waiting = running = 0
        for h in self._live:
            req = h.request
            assert req is not None
            grown = req.output_ids[h.sent :]
            if grown and req.status != RequestStatus.FINISHED_ABORTED:
                h._push(("tokens", list(grown)))
                new_tokens += len(grown)
            h.sent = len(req.output_ids)
            if req.status.finished:
                if req.status == RequestStatus.FINISHED_ABORTED:
                    self.num_aborted += 1
                    h._push(("done", "abort"))
                else:
                    h._push(("done", req.finish_reason))
            else:
                still.append(h)
                if req.status == RequestStatus.WAITING:
                    waiting += 1
                else:
                    running += 1
        self._live = still
        with self._lock:
            self._num_waiting = waiting + self._inbox.qsize()
            self._num_running = running
        if step_seconds is None:
            return
        now = time.perf_counter()
        self._recent.append((now, new_tokens))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        if self.metrics is not None:
            span = max(now - self._recent[0][0], step_seconds, 1e-6)
            rate = sum(n for _, n in self._recent) / span
            self.metrics.observe_step(step_seconds, new_tokens, rate, running, waiting)
