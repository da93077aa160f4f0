"""EngineLoop: the one background thread that owns the engine while serving.

HTTP handlers never touch the engine. They :meth:`EngineLoop.submit` a prompt (thread-safe; it
refuses with :class:`QueueFullError` when the bounded waiting queue is full, or
:class:`EngineDeadError` once the engine has failed for good) and read a :class:`Handle`'s asyncio
queue, which the engine thread feeds through ``loop.call_soon_threadsafe``: one
``("tokens", ids)`` item per completed block, then ``("done", finish_reason)``,
``("rejected", error)`` (the engine refused it: HTTP 400) or ``("error", exception)``.
:meth:`EngineLoop.cancel` aborts a request; the engine frees its slot and KV at the next block
boundary (dense: the next step; offloading modes: the batch's next commit).

Admission (continuous batching at block granularity): submitted requests wait here, FIFO, and are
handed to the engine, which admits (prefills) them at its next block boundary, only while

* slots: the running requests that stay past that boundary plus those handed over and not yet
  admitted are fewer than ``max_batch_size`` (the GPU pool: one slot per request);
* CPU pool (offloading modes): the head request's pages fit in the pages free at that boundary,
  less those promised to requests handed over and not yet admitted;
* prefill: the prompt tokens handed over and not yet admitted stay within ``max_prefill_tokens``
  (one longer prompt goes alone); the engine, built with the same ``max_prefill_tokens``,
  prefills at most that many prompt tokens per block boundary, so a long prompt is prefilled in
  chunks over several boundaries between the running requests' blocks.

The head of the queue blocks the rest (no overtaking, no starvation). Finished requests leave at
the boundary. An exception while handing a request over fails that request only. An exception
inside a batched step cannot be attributed to one request, so it fails the requests of that step
(they are aborted) and the loop goes on; ``max_step_failures`` failed steps in a row mark the
engine dead: every request fails, new ones get :class:`EngineDeadError`, ``/health`` says 503.
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
from herald.engine.offload import OffloadEngine, OffloadStats
from herald.engine.request import Request, RequestStatus
from herald.server.metrics import ServerMetrics
from herald.server.served_engine import Engine, cpu_pages_free, cpu_pages_needed

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine failed ``max_step_failures`` steps in a row; nothing runs any more (HTTP 503)."""


@dataclass(eq=False)  # identity: handles are found in queues and lists by ``is``
class Handle:
    """One submitted request as the HTTP side sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    request: Request | None = None  # set once handed to the engine
    sent: int = 0  # output tokens already pushed
    cancelled: bool = False
    pages: int = 0  # CPU pool pages it will hold (offloading modes)

    def _push(self, item: tuple[str, Any]) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Runs ``engine.step()`` in a daemon thread and routes tokens to per-request queues.

    Args:
        engine: the engine this thread owns from :meth:`start` on (closed by :meth:`stop`).
        max_waiting: requests submitted but not yet running, at most.
        max_prefill_tokens: prompt tokens handed to the engine per block boundary, at most.
        max_step_failures: failed steps in a row after which the engine is declared dead.
        metrics: optional Prometheus metrics to update after each step.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 64,
        max_prefill_tokens: int = 4096,
        max_step_failures: int = 3,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.max_step_failures = max_step_failures
        self.metrics = metrics
        self._inbox: queue.Queue[tuple[str, Handle]] = queue.Queue()
        self._lock = threading.Lock()
        self._num_waiting = 0  # submitted, not yet running nor finished (guarded by _lock)
        self._num_running = 0
        self.num_aborted = 0  # requests aborted while waiting or running (engine thread writes)
        self.dead: BaseException | None = None  # set once the engine is declared dead
        self._pending: collections.deque[Handle] = collections.deque()  # engine thread only
        self._live: list[Handle] = []  # handed to the engine, not finished (engine thread only)
        self._failures = 0
        self._blocks_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="herald-engine", daemon=True)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    # -- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, then close the engine (offloading modes: the retrieval thread)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if isinstance(self.engine, OffloadEngine) and not self._thread.is_alive():
            self.engine.close()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

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
        """Queue a prompt; raises :class:`QueueFullError` when ``max_waiting`` are waiting and
        :class:`EngineDeadError` when the engine is dead."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed and stopped: {self.dead}")
        handle = Handle(list(prompt_ids), params, loop)
        with self._lock:
            # Submitted requests that free slots will take at once are not "waiting": a burst
            # fills the free slots, then up to max_waiting queue behind them.
            free = max(0, self.engine.max_batch_size - self._num_running)
            if self._num_waiting - free >= self.max_waiting:
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
            idle = not self._pending and not self.engine.has_unfinished()
            self._drain(block=idle or self.dead is not None)
            if self.dead is not None:
                self._fail_all(self.dead)
                continue
            self._feed()
            if not self.engine.has_unfinished():
                if self._live or self._pending:  # e.g. a request refused or aborted: publish
                    self._publish(None)
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
                self._failures = 0
            except Exception as e:  # fail the requests of this step only
                log.exception("engine step failed")
                self._fail_step(e)
            self._publish(time.perf_counter() - t0)

    def _drain(self, *, block: bool) -> None:
        try:
            cmd, h = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                if h.cancelled:
                    self.num_aborted += 1
                else:
                    self._pending.append(h)
            elif h in self._pending:
                self._pending.remove(h)
                self.num_aborted += 1
                h._push(("done", "abort"))
            elif h.request is not None and not h.request.status.finished:
                self.engine.abort(h.request)
            try:
                cmd, h = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _feed(self) -> None:
        """Hand waiting requests to the engine, FIFO, within slots, CPU pages and prefill budget
        (see the module docstring); the engine admits them at its next block boundary."""
        eng = self.engine
        handed = [h for h in self._live if _status(h) == RequestStatus.WAITING]
        staying = sum(1 for r in eng.batch.requests if not r.status.finished)
        slots = eng.max_batch_size - staying - len(handed)
        tokens = sum(len(h.prompt_ids) for h in handed)
        pages = 0
        if isinstance(eng, OffloadEngine):
            pages = cpu_pages_free(eng) - sum(h.pages for h in handed)
        while self._pending and slots > 0:
            h = self._pending[0]
            if tokens and tokens + len(h.prompt_ids) > self.max_prefill_tokens:
                return
            if isinstance(eng, OffloadEngine):
                h.pages = cpu_pages_needed(eng, len(h.prompt_ids), h.params.max_new_tokens)
                if h.pages > eng.cpu_pool.num_pages:  # never (checked up front too): no blocking
                    self._pending.popleft()
                    h._push(
                        ("rejected", ValueError(f"needs {h.pages} CPU KV pages, pool has fewer"))
                    )
                    continue
                if h.pages > pages:  # not now: the head waits for pages to come back
                    return
                pages -= h.pages
            self._pending.popleft()
            try:
                h.request = eng.add_request(h.prompt_ids, h.params)
            except ValueError as e:  # it can never run here (checked up front too)
                h._push(("rejected", e))
                continue
            except Exception as e:
                log.exception("adding a request failed")
                h._push(("error", e))
                continue
            self._live.append(h)
            slots -= 1
            tokens += len(h.prompt_ids)

    def _fail_step(self, exc: Exception) -> None:
        """A step raised: fail (and abort) the requests it ran or was admitting."""
        self._failures += 1
        engine_waiting = set(map(id, self.engine.waiting))
        failed = []
        for h in self._live:
            req = h.request
            assert req is not None
            lost = req.status == RequestStatus.WAITING and id(req) not in engine_waiting
            if req.status == RequestStatus.RUNNING or lost:
                # ``lost``: popped for admission when the step raised (its prefill failed).
                self.engine.abort(req)
                if isinstance(self.engine, OffloadEngine):
                    pool = self.engine.cpu_pool
                    in_batch = any(r is req for r in self.engine.batch.requests)
                    if not in_batch and req.request_id in pool:
                        pool.free(req.request_id)  # allocated before a prefill that failed
                h._push(("error", exc))
                failed.append(h)
        self._live = [h for h in self._live if h not in failed]
        if self._failures >= self.max_step_failures:
            log.error("engine failed %d steps in a row: declaring it dead", self._failures)
            self.dead = exc

    def _fail_all(self, exc: BaseException) -> None:
        for h in [*self._pending, *self._live]:
            h._push(("error", exc))
        self._pending.clear()
        self._live.clear()
        with self._lock:
            self._num_waiting = self._num_running = 0

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
            if req.status == RequestStatus.FINISHED_ABORTED:
                self.num_aborted += 1
                h._push(("done", "abort"))
            elif req.status.finished:
                h._push(("done", req.finish_reason))
            else:
                still.append(h)
                if req.status == RequestStatus.WAITING:
                    waiting += 1
                else:
                    running += 1
        self._live = still
        with self._lock:
            self._num_waiting = waiting + len(self._pending) + self._inbox.qsize()
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
            self.metrics.observe_step(
                step_seconds, new_tokens, rate, running, waiting, len(self.engine.batch)
            )
        self._observe_blocks()

    def _observe_blocks(self) -> None:
        """Per-block stream timings (offloading modes) to the metrics; bound the engine's
        per-step and per-block stats lists, which grow without bound in a long-lived server."""
        st = self.engine.stats
        if isinstance(st, OffloadStats):
            for b in st.blocks[self._blocks_seen :]:
                if self.metrics is not None:
                    self.metrics.observe_block(b.main, b.retrieval, b.stall)
            self._blocks_seen = len(st.blocks)
            if len(st.blocks) > 10_000:
                del st.blocks[:]
                self._blocks_seen = 0
        if len(st.step_seconds) > 10_000:
            del st.step_seconds[:-1000], st.step_batch_sizes[:-1000]


def _status(h: Handle) -> RequestStatus | None:
    return h.request.status if h.request is not None else None
