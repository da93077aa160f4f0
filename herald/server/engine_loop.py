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

Metrics (when given a :class:`ServerMetrics`): after each step, the step's generated tokens and
the engine's new prompt tokens and prefill / decode seconds (deltas of ``engine.stats``; a stats
object replaced or reset counts again from zero), the trailing generated and prompt rates; per
request, at each push of its tokens, time to first token or time since its previous push, and at
a stop or length finish its end-to-end latency, all from its submit (host clock of this process).
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
from herald.engine.stats import BlockTiming, EngineStats
from herald.server.metrics import ServerMetrics
from herald.server.peak import is_out_of_memory
from herald.server.stats_log import StatsLine

log = logging.getLogger(__name__)

RATE_WINDOW_SECONDS = 10.0
"""Generated and prompt tokens/s on ``/metrics`` are measured over this trailing window."""


def window_rate(recent: deque[tuple[float, int]], now: float, start: float | None) -> float:
    """Tokens per second of ``recent`` ((step end time, tokens) in time order) over the trailing
    :data:`RATE_WINDOW_SECONDS`: the tokens of the steps that ended in the window over the
    window, or over the time since ``start`` (the first step began) when that is shorter; 0
    once no step ended in the window. Entries older than the window are dropped from
    ``recent``."""
    while recent and now - recent[0][0] > RATE_WINDOW_SECONDS:
        recent.popleft()
    if not recent or start is None:
        return 0.0
    span = max(min(RATE_WINDOW_SECONDS, now - start), 1e-6)
    return sum(n for _, n in recent) / span


def _added(new: float, old: float) -> float:
    """What a counter gained from ``old`` to ``new``: all of ``new`` when it went down (reset)."""
    return new - old if new >= old else new


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
    """One submitted request as the HTTP side sees it. ``submitted``: when it was submitted,
    ``pushed``: when its tokens were last pushed (None before the first), ``time.perf_counter``
    seconds."""

    request: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    sent: int = 0  # output tokens already pushed
    scores: bool = False  # also push each block's logprobs
    submitted: float = field(default_factory=time.perf_counter)
    pushed: float | None = None

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
        log_stats: log the periodic throughput line (:mod:`herald.server.stats_log`).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_step_failures: int = 3,
        metrics: ServerMetrics | None = None,
        log_stats: bool = False,
    ) -> None:
        self.engine = engine
        self._stats_line = StatsLine() if log_stats else None
        self.max_step_failures = max_step_failures
        self.metrics = metrics
        self._lock = threading.Lock()
        self._live: list[Handle] = []  # submitted, not yet finished (guarded by _lock)
        self._wake = threading.Event()
        self.num_aborted = 0  # requests that ended aborted (engine thread writes)
        self.dead: BaseException | None = None  # set once the engine is declared dead
        self._failures = 0
        self._stats = engine.stats  # the stats object the counts below were read from
        self._blocks_seen = self._stats.blocks_dropped + len(self._stats.blocks)
        self._seen = self._totals(self._stats)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="herald-engine", daemon=True)
        self._recent: deque[tuple[float, int]] = deque()  # (step end, generated tokens)
        self._rate_start: float | None = None  # when the first step began
        self._recent_prompt: deque[tuple[float, int]] = deque()  # (step end, prompt tokens)

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
                idle0 = time.perf_counter()
                self._publish(None)  # e.g. a waiting request aborted: say so
                self._observe_idle()
                self._wake.wait(0.05)
                self._wake.clear()
                if self.metrics is not None:
                    self.metrics.idle_seconds.inc(time.perf_counter() - idle0)
                continue
            t0 = time.perf_counter()
            try:
                self.engine.step()
                self._failures = 0
            except Exception as e:  # the step failed its own requests; count it
                log.exception("engine step failed")
                if is_out_of_memory(e):
                    log.error(
                        "out of GPU memory: the step's requests failed; a lower "
                        "--max-batch-size, --max-seq-len or --max-prefill-tokens leaves more "
                        "(the start-up memory check runs the serving peak unless --no-warmup)"
                    )
                self._failures += 1
                if self._failures >= self.max_step_failures:
                    log.error("engine failed %d steps in a row: declaring it dead", self._failures)
                    self.dead = e
            t1 = time.perf_counter()
            self._publish(t1 - t0)
            if self.metrics is not None:
                self.metrics.publish_seconds.inc(time.perf_counter() - t1)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            live, self._live = self._live, []
        for h in live:
            self.engine.abort(h.request)
            h._push(("error", exc))

    def _publish(self, step_seconds: float | None) -> None:
        """Push new blocks and finishes; update the metrics (the step's when ``step_seconds``
        is given, the per-request latencies at every push and finish)."""
        new_tokens = 0
        m = self.metrics
        now = time.perf_counter()
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
                if m is not None:
                    m.observe_push(now - h.submitted, None if h.pushed is None else now - h.pushed)
                h.pushed = now
            h.sent = end
            if status == RequestStatus.FINISHED_ERROR:
                h._push(("error", req.error))
            elif status == RequestStatus.FINISHED_ABORTED:
                self.num_aborted += 1
                h._push(("done", "abort"))
            elif status.finished:
                h._push(("done", req.finish_reason))
                if m is not None:
                    m.observe_finished(now - h.submitted)
            else:
                continue
            ended.append(h)
        if ended:
            with self._lock:
                self._live = [h for h in self._live if all(h is not e for e in ended)]
        if step_seconds is not None:
            self._observe(step_seconds, new_tokens)

    def generation_rate(self, now: float) -> float:
        """Generated tokens per second over the trailing window (engine thread):
        :func:`window_rate` of the steps' generated tokens."""
        return window_rate(self._recent, now, self._rate_start)

    def prompt_rate(self, now: float) -> float:
        """Prompt tokens of the requests that joined the batch, per second over the trailing
        window (engine thread): :func:`window_rate` of the steps' prompt tokens."""
        return window_rate(self._recent_prompt, now, self._rate_start)

    def _observe_idle(self) -> None:
        """No step ran: the rate gauges still decay over the window."""
        now = time.perf_counter()
        rate, prompt_rate = self.generation_rate(now), self.prompt_rate(now)
        self._log_stats(now, rate, prompt_rate)
        if self.metrics is not None:
            self.metrics.tokens_per_second.set(rate)
            self.metrics.prefill_tokens_per_second.set(prompt_rate)

    def _log_stats(self, now: float, rate: float, prompt_rate: float) -> None:
        if self._stats_line is not None:
            eng = self.engine
            self._stats_line.maybe_log(now, rate, prompt_rate, eng.num_running, eng.num_waiting)

    @staticmethod
    def _totals(st: EngineStats) -> tuple[float, ...]:
        """(prompt tokens, prefill s, decode s, batch rows, forwards) of ``st``."""
        return (
            st.num_prompt_tokens, st.prefill_seconds, st.decode_seconds, st.num_batch_rows,
            st.num_forwards,
        )  # fmt: skip

    def _stats_deltas(self) -> tuple[list[BlockTiming], tuple[float, ...]]:
        """The blocks recorded and the :meth:`_totals` added to ``engine.stats`` since the last
        call. A stats object other than the last one seen (the
        engine's counters started again) counts from zero, and so does a count that went down."""
        st = self.engine.stats
        if st is not self._stats:
            self._stats, self._blocks_seen = st, 0
            self._seen = (0,) * len(self._seen)
        total_blocks = st.blocks_dropped + len(st.blocks)
        if total_blocks < self._blocks_seen:
            self._blocks_seen = 0
        new_blocks = st.blocks[max(0, self._blocks_seen - st.blocks_dropped) :]
        self._blocks_seen = total_blocks
        totals = self._totals(st)
        added = tuple(_added(new, old) for new, old in zip(totals, self._seen, strict=True))
        self._seen = totals
        return new_blocks, added

    def _observe(self, step_seconds: float, new_tokens: int) -> None:
        now = time.perf_counter()
        new_blocks, (prompt, prefill_s, decode_s, rows, forwards) = self._stats_deltas()
        prompt_tokens = int(prompt)
        if self._rate_start is None:
            self._rate_start = now - step_seconds
        self._recent.append((now, new_tokens))
        self._recent_prompt.append((now, prompt_tokens))
        rate = self.generation_rate(now)
        prompt_rate = self.prompt_rate(now)
        self._log_stats(now, rate, prompt_rate)
        if self.metrics is None:
            return
        eng = self.engine
        self.metrics.observe_step(
            step_seconds, new_tokens, rate, eng.num_running, eng.num_waiting, eng.num_running,
            prompt_tokens=prompt_tokens, prompt_rate=prompt_rate, prefill_seconds=prefill_s,
            decode_seconds=decode_s, batch_rows=int(rows), forwards=int(forwards),
        )  # fmt: skip
        for b in new_blocks:
            self.metrics.observe_block(b.main, b.retrieval, b.stall)
