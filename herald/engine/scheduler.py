"""Scheduler: the one place that decides admission, for every engine and for the server.

Requests wait here, FIFO, from :meth:`Scheduler.add` until the engine's next block boundary (the
dense engine: every step; the offloading engine: when its lockstep block has committed), where
:meth:`Scheduler.schedule` decides which prompt tokens to prefill:

* **slots**: a waiting request starts only while the running requests, plus the ones that join
  at this boundary, are fewer than ``max_batch_size``;
* **KV memory**: its CPU pages (offloading engines) and, where the engine prefills into the slot
  itself, a GPU slot must be free now (:meth:`KVManager.can_admit`); they are allocated when it
  starts, all at once;
* **prefill budget**: at most ``max_prefill_tokens`` prompt tokens per decode forward of the
  running batch; a longer prompt is prefilled in chunks over several boundaries (one request at
  a time), while the running requests keep decoding. The dense engine has a boundary before
  every forward (budget x 1); the offloading engine has one per block, after all of the block's
  forwards (budget x the forwards of its last block), so both spend the same share of the GPU
  on prefill and a lockstep batch fills as fast as a dense one. None: every admitted prompt is
  prefilled whole.
* **fixed pieces**: a chunk that stops before its prompt's end stops on a multiple of
  ``piece_tokens`` (the engine's prefill forward length), so a prompt is always prefilled in the
  same forwards, ``[0, P), [P, 2P), ...``, whatever other prompts took of a boundary's budget;
  a remainder of the budget shorter than a piece is left unused. A prompt's KV (and so its
  tokens) must not depend on its neighbours in the queue: the attention kernels' rounding
  depends on a forward's query and key lengths.

The head of the queue blocks the rest: no overtaking, no starvation. A request that could never
run is refused by :meth:`add` at once (:class:`~herald.kv.manager.RequestTooLarge`), and with a
``max_waiting`` bound a full queue is refused too (:class:`QueueFullError`).

Threads: :meth:`add`, :meth:`abort` and the counters are safe from any thread (the server's HTTP
handlers call them); :meth:`schedule` and the prefill bookkeeping run on the engine's thread. An
abort of a request that is already prefilling or running takes effect on the engine's thread at
its next step (:meth:`take_aborts`), never under a running forward.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from herald.engine.request import Request, RequestStatus
from herald.kv.manager import KVManager


class QueueFullError(RuntimeError):
    """The waiting queue is full (``max_waiting`` beyond the free slots): HTTP 503."""


@dataclass
class PrefillChunk:
    """Prompt tokens ``[start, end)`` of ``request`` to prefill at this boundary (where:
    the request's slot at the time the chunk runs, :meth:`KVManager.slot`, or the engine's
    temporary store)."""

    request: Request
    start: int
    end: int

    @property
    def last(self) -> bool:
        """This chunk completes the prompt: the request joins the batch after it."""
        return self.end >= self.request.layout.num_prefill_tokens


@dataclass
class _Prefilling:
    request: Request
    pos: int  # prompt tokens scheduled so far


class Scheduler:
    """FIFO admission within slots, KV memory and a prefill budget per boundary.

    Args:
        kv: the engine's KV manager (it allocates; the scheduler decides).
        block_size: B; prefill budgets are whole blocks.
        max_batch_size: running requests at most.
        max_prefill_tokens: prompt tokens per boundary (rounded down to whole blocks, at least
            one block), or None.
        max_waiting: requests waiting beyond the free slots at most, or None (unbounded).
        piece_tokens: the engine's prefill forward length (whole blocks, at most
            ``max_prefill_tokens``): where an unfinished chunk may stop (see "fixed pieces").
    """

    def __init__(
        self,
        kv: KVManager,
        *,
        block_size: int,
        max_batch_size: int,
        max_prefill_tokens: int | None,
        max_waiting: int | None,
        piece_tokens: int | None = None,
    ) -> None:
        self.kv = kv
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        b = block_size
        self.max_prefill_tokens = (
            None if max_prefill_tokens is None else max(b, (max_prefill_tokens // b) * b)
        )
        self.piece = b if piece_tokens is None else piece_tokens
        if (
            self.piece < b
            or self.piece % b
            or (self.max_prefill_tokens is not None and self.piece > self.max_prefill_tokens)
        ):
            raise ValueError(
                f"piece_tokens must be whole blocks of {b}, at most max_prefill_tokens "
                f"({self.max_prefill_tokens}), got {self.piece}"
            )
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._aborts: list[Request] = []
        self._num_running = 0
        self.prefilling: _Prefilling | None = None

    # -- any thread -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request``. Raises RequestTooLarge when it can never run here (its CPU pages
        exceed the whole pool) and :class:`QueueFullError` past ``max_waiting``."""
        self.kv.check_fits(request.prompt_len, request.params.max_new_tokens)
        with self._lock:
            if self.max_waiting is not None:
                # Requests that free slots take at once are not "waiting": a burst fills the
                # free slots, then up to max_waiting queue behind them.
                free = max(0, self.max_batch_size - self._num_running)
                queued = len(self._waiting) + (self.prefilling is not None)
                if queued - free >= self.max_waiting:
                    raise QueueFullError(
                        f"the waiting queue is full ({self.max_waiting} "
                        f"request{'' if self.max_waiting == 1 else 's'}); retry later"
                    )
            self._waiting.append(request)

    def abort(self, request: Request) -> None:
        """Cancel ``request``. A waiting one leaves the queue now (``FINISHED_ABORTED``); one
        being prefilled or running is aborted at the engine's next step; a finished one is left
        as it is."""
        with self._lock:
            if request.status.finished:
                return
            at = next((i for i, r in enumerate(self._waiting) if r is request), None)
            if at is not None:
                del self._waiting[at]
                request.status = RequestStatus.FINISHED_ABORTED
            elif all(r is not request for r in self._aborts):
                self._aborts.append(request)

    @property
    def num_waiting(self) -> int:
        """Requests queued or being prefilled."""
        with self._lock:
            return len(self._waiting) + (self.prefilling is not None)

    @property
    def waiting(self) -> list[Request]:
        """A snapshot of the queue, head first (the request being prefilled not included)."""
        with self._lock:
            return list(self._waiting)

    @property
    def num_aborts_pending(self) -> int:
        """Aborts requested of prefilling or running requests, not yet taken by the engine."""
        with self._lock:
            return len(self._aborts)

    def has_waiting(self) -> bool:
        with self._lock:
            return bool(self._waiting) or self.prefilling is not None

    # -- engine thread --------------------------------------------------------------------------
    def set_num_running(self, n: int) -> None:
        """The engine's running requests after a step (for the ``max_waiting`` bound)."""
        with self._lock:
            self._num_running = n

    def take_aborts(self) -> list[Request]:
        """Aborts of prefilling or running requests since the last call: each is marked
        ``FINISHED_ABORTED`` now; a prefilling one is dropped and its KV freed here, a running
        one is left to the engine, which frees its row at its next boundary."""
        with self._lock:
            aborts, self._aborts = self._aborts, []
        out = []
        for req in aborts:
            if req.status.finished:
                continue
            req.status = RequestStatus.FINISHED_ABORTED
            if self.prefilling is not None and self.prefilling.request is req:
                self.drop_prefilling()
            out.append(req)
        return out

    def schedule(self, num_running: int, forwards: int = 1) -> list[PrefillChunk]:
        """The prefill chunks of this boundary, in order (see the module docstring): at most
        ``max_prefill_tokens`` times ``forwards`` (the running batch's decode forwards since
        the last boundary, at least 1) prompt tokens. Starting a request allocates its KV
        (pages, and a slot where the engine prefills into it)."""
        budget = self.max_prefill_tokens
        if budget is not None:
            budget *= max(1, forwards)
        chunks: list[PrefillChunk] = []
        joined = 0
        while budget is None or budget > 0:
            st = self.prefilling
            if st is None:
                st = self._start_next(num_running + joined)
                if st is None:
                    break
            req = st.request
            n = req.layout.num_prefill_tokens
            end = n if budget is None else min(n, st.pos + budget)
            if end < n:
                end -= end % self.piece  # on a piece boundary (see "fixed pieces")
                if end <= st.pos:
                    break  # less than a piece left: this prompt goes on at the next boundary
            chunks.append(PrefillChunk(req, st.pos, end))
            if budget is not None:
                budget -= end - st.pos
            st.pos = end
            if end < n:
                break  # budget spent; the rest at the next boundary
            with self._lock:
                # NOTE: it joins the batch now; count it at once, or add() would count its slot
                # free until the step ends (set_num_running) and let a burst past max_waiting.
                self.prefilling = None
                self._num_running += 1
            joined += 1
        return chunks

    def _start_next(self, running: int) -> _Prefilling | None:
        with self._lock:
            if not self._waiting or running >= self.max_batch_size:
                return None
            head = self._waiting[0]
            if not self.kv.can_admit(head.prompt_len, head.params.max_new_tokens):
                return None
            self.kv.admit(head.request_id, head.prompt_len, head.params.max_new_tokens)
            self._waiting.popleft()
            self.prefilling = _Prefilling(head, 0)
            return self.prefilling

    def drop_prefilling(self) -> Request | None:
        """Drop the request being prefilled (aborted, or its prefill failed); its KV is freed.
        Returns it."""
        st, self.prefilling = self.prefilling, None
        if st is None:
            return None
        self.kv.free(st.request.request_id)
        return st.request
