"""EngineLoop: the one background thread that steps the engine while serving.

HTTP handlers never step the engine. They :meth:`EngineLoop.submit` a prompt, which queues it
in the engine's scheduler at once (thread-safe; the scheduler alone decides admission, see
:mod:`herald.engine.scheduler`), and read a :class:`Handle`'s asyncio queue, which the engine
thread feeds through ``loop.call_soon_threadsafe``: one ``("tokens", ids)`` item per completed
block (preceded, for a handle submitted with ``scores=True``, by ``("logprobs", (logprobs,
top_logprobs))`` for the same tokens: :func:`_scores`), then ``("done", finish_reason)`` or
``("error", exception)``. :meth:`EngineLoop.cancel`
aborts a request; the engine frees its slot and KV at its next block boundary.

Refusals are synchronous: :meth:`submit` raises :class:`~herald.kv.manager.RequestTooLarge`
(HTTP 400: the request could never run here), :class:`~herald.engine.scheduler.QueueFullError`
(503: the bounded waiting queue is full) or :class:`EngineDeadError` (503).

Failures: a step that raises has already failed the requests it ran or was prefilling
(``FINISHED_ERROR``, their KV freed); the loop reports the error to them and goes on.
``max_step_failures`` failed steps in a row mark the engine dead: every request fails, new ones
get :class:`EngineDeadError`, ``/health`` says 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from herald.config import SamplingParams
from herald.engine.base import Engine
from herald.engine.request import Request, RequestStatus
from herald.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 10.0
"""Generated tokens/s on ``/metrics`` is measured over this trailing window."""


def _scores(
    req: Request, start: int, end: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The log-probabilities of ``req``'s output tokens ``[start, end)`` and, when it asked for
    alternatives, the top ``(token id, logprob)`` pairs at each (else empty lists)."""
    tops = req.output_top_logprobs[start:end] if req.params.top_logprobs > 0 else []
    return req.output_logprobs[start:end], [list(t) for t in tops]


class EngineDeadError(RuntimeError):
    """The engine failed ``max_step_failures`` steps in a row; nothing runs any more (HTTP 503)."""


@dataclass(eq=False)  # identity: handles are found in lists by ``is``
class Handle:
    """One submitted request as the HTTP side sees it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens already pushed
    scores: bool = False  # also push each block's logprobs

    def _push(self, item: tuple[str, Any]) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Steps ``engine`` in a daemon thread and routes tokens to per-request queues.

    Args:
        engine: the engine this thread steps from :meth:`start` on (closed by :meth:`stop`).
        max_step_failures: failed steps in a row after which the engine is declared dead.
        metrics: optional Prometheus metrics to update after each step.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_step_failures: int = 3,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.max_step_failures = max_step_failures
        self.metrics = metrics
        self._lock = threading.Lock()
        self._live: list[Handle] = []  # submitted, not yet finished (guarded by _lock)
        self._wake = threading.Event()
        self.num_aborted = 0  # requests that ended aborted (engine thread writes)
        self.dead: BaseException | None = None  # set once the engine is declared dead
        self._failures = 0
        self._blocks_seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="herald-engine", daemon=True)
        self._recent: deque[tuple[float, int]] = deque()

    # -- any thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread, then close the engine (its threads, KV and pinned memory)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        *,
        scores: bool = False,
    ) -> Handle:
        """Queue a prompt in the engine; with ``scores`` its handle also gets the logprobs of
        each block. Raises RequestTooLarge / ValueError (never runnable here), QueueFullError
        (queue full) or :class:`EngineDeadError`."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed and stopped: {self.dead}")
        with self._lock:
            request = self.engine.add_request(prompt_ids, params)
            handle = Handle(request, loop, scores=scores)
            self._live.append(handle)
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Abort ``handle``'s request (a disconnected client); no-op once it has finished."""
        self.engine.abort(handle.request)
        self._wake.set()

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self.dead is not None:
                self._fail_all(self.dead)
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if not self.engine.has_unfinished():
                self._publish(None)  # e.g. a waiting request aborted: say so
                self._observe_idle()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
                self._failures = 0
            except Exception as e:  # the step failed its own requests; count it
                log.exception("engine step failed")
                self._failures += 1
                if self._failures >= self.max_step_failures:
                    log.error("engine failed %d steps in a row: declaring it dead", self._failures)
                    self.dead = e
            self._publish(time.perf_counter() - t0)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            live, self._live = self._live, []
        for h in live:
            self.engine.abort(h.request)
            h._push(("error", exc))

    def _publish(self, step_seconds: float | None) -> None:
        """Push new blocks and finishes; update the metrics."""
        new_tokens = 0
        with self._lock:
            live = list(self._live)
        ended: list[Handle] = []
        for h in live:
            req = h.request
            status = req.status
            end = len(req.output_ids)
            if end > h.sent and status not in (
                RequestStatus.FINISHED_ABORTED,
                RequestStatus.FINISHED_ERROR,
            ):
                if h.scores:
                    h._push(("logprobs", _scores(req, h.sent, end)))
                h._push(("tokens", req.output_ids[h.sent : end]))
                new_tokens += end - h.sent
            h.sent = end
            if status == RequestStatus.FINISHED_ERROR:
                h._push(("error", req.error))
            elif status == RequestStatus.FINISHED_ABORTED:
                self.num_aborted += 1
                h._push(("done", "abort"))
            elif status.finished:
                h._push(("done", req.finish_reason))
            else:
                continue
            ended.append(h)
        if ended:
            with self._lock:
                self._live = [h for h in self._live if all(h is not e for e in ended)]
        if step_seconds is not None:
            self._observe(step_seconds, new_tokens)

    def generation_rate(self, now: float, min_span: float = 1e-6) -> float:
        """Generated tokens per second over the trailing :data:`RATE_WINDOW_SECONDS` (engine
        thread): the tokens of the steps that ended in the window over the time since the first
        of them ended, at least ``min_span`` seconds; 0 once no step ended in the window."""
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_SECONDS:
            self._recent.popleft()
        if not self._recent:
            return 0.0
        span = max(now - self._recent[0][0], min_span, 1e-6)
        return sum(n for _, n in self._recent) / span

    def _observe_idle(self) -> None:
        """No step ran: the rate gauge still decays over the window."""
        if self.metrics is not None:
            self.metrics.tokens_per_second.set(self.generation_rate(time.perf_counter()))

    def _observe(self, step_seconds: float, new_tokens: int) -> None:
        now = time.perf_counter()
        self._recent.append((now, new_tokens))
        rate = self.generation_rate(now, min_span=step_seconds)
        st = self.engine.stats
        new_blocks = st.blocks[max(0, self._blocks_seen - st.blocks_dropped) :]
        self._blocks_seen = st.blocks_dropped + len(st.blocks)
        if self.metrics is None:
            return
        eng = self.engine
        self.metrics.observe_step(
            step_seconds, new_tokens, rate, eng.num_running, eng.num_waiting, eng.num_running
        )
        for b in new_blocks:
            self.metrics.observe_block(b.main, b.retrieval, b.stall)
