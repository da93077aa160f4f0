"""KVManager: the one owner of GPU KV slots and CPU KV pages.

Every engine holds one. It is the only code that allocates and frees the two units of KV memory:

- **GPU slots**: one per request, an index into every slot store (the dense cache, the offloading
  engine's dense store, its GPU sparse pools, InfiniGen's partial-key cache). Running requests
  always hold slots ``0..n-1`` in decode-batch row order, so a batched forward reads plain views;
  when requests leave, :meth:`release` moves the last rows into the holes (the same moves
  :class:`~herald.engine.decode_batch.DecodeBatch` makes, :func:`compact_moves`) and copies their
  KV in every registered store.
- **CPU pages** (offloading engines): a request's pages of the CPU full KV pool
  (:class:`~herald.kv.cpu_pool.CpuKVPool`), one diffusion block of every offloaded layer each,
  allocated all at once when the request is admitted and returned when it leaves.

Threads: :meth:`check_fits` and the sizes are read-only and safe from any thread (the server's
HTTP handlers call them through ``Engine.add_request``); everything else runs on the thread that
steps the engine (the retrieval thread reads no page list: it gets page tables the engine thread
built).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from herald.diffusion.block import BlockLayout
from herald.kv.cpu_pool import CpuKVPool


class RequestTooLarge(ValueError):
    """A request this engine can never run (HTTP 400): its context, its vocabulary, or its CPU
    pages. ``param`` and ``code`` fill the OpenAI error body."""

    def __init__(self, message: str, *, param: str | None = "max_tokens", code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class SlotStore(Protocol):
    """Storage indexed by GPU slot, compacted by the KV manager when requests leave."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src`` into slot ``dst``; ``length`` is the moved request's committed
        tokens (a store may copy only those rows, or everything)."""
        ...


@dataclass(frozen=True)
class KVUsage:
    """KV memory in use (``/metrics``): CPU pages (0 / 0 for dense), GPU slots and bytes."""

    cpu_pages_used: int
    cpu_pages_total: int
    gpu_slots_used: int
    gpu_slots_total: int
    gpu_kv_bytes: int


def compact_moves(num_rows: int, leaving: Sequence[int]) -> list[tuple[int, int]]:
    """The (src, dst) moves that keep rows ``0..n-1`` dense when ``leaving`` rows go: for each
    leaving row, highest first, the current last row moves into it (unless it is the last).

    NOTE: a row can move twice (4 -> 3, then 3 -> 1 when rows 1 and 3 both leave); apply the
    moves in order."""
    moves: list[tuple[int, int]] = []
    n = num_rows
    for row in sorted(set(leaving), reverse=True):
        last = n - 1
        if row != last:
            moves.append((last, row))
        n -= 1
    return moves


class KVManager:
    """GPU slots and CPU pages of one engine.

    Args:
        num_slots: GPU slots (the engine's ``max_batch_size``).
        block_size: B, tokens per diffusion block and per CPU page.
        cpu_pool: the offloading engine's CPU full KV pool, or None (dense: no pages).
        prefill_in_slot: True when a request is prefilled straight into its slot (the dense
            engine), so admission takes a slot; False when it is prefilled into a temporary
            store and takes its slot only when it joins the batch (the offloading engine).
    """

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        cpu_pool: CpuKVPool | None = None,
        *,
        prefill_in_slot: bool,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self.cpu_pool = cpu_pool
        self.prefill_in_slot = prefill_in_slot
        self._slot_of: dict[str, int] = {}
        self._joined: set[str] = set()  # requests in the decode batch (the others prefill)
        self._stores: list[SlotStore] = []
        self._store_bytes = 0

    def add_store(self, store: SlotStore, num_bytes: int = 0) -> None:
        """Register a slot store: its slots move with :meth:`release` / :meth:`join`;
        ``num_bytes`` counts into :meth:`usage`."""
        self._stores.append(store)
        self._store_bytes += num_bytes

    # -- sizes (any thread) ---------------------------------------------------------------------
    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """CPU pages a request holds while it runs: its canvas (prompt + ``max_new_tokens``,
        in whole blocks) plus one scratch page (the draft of the lookahead, MAGE's current
        block); 0 without a CPU pool."""
        if self.cpu_pool is None:
            return 0
        layout = BlockLayout(prompt_len, self.block_size, max_new_tokens)
        return layout.total_len // self.block_size + 1

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise :class:`RequestTooLarge` when the request needs more CPU pages than the whole
        pool holds (it could never run). Reads only what was fixed at construction."""
        if self.cpu_pool is None:
            return
        need = self.pages_needed(prompt_len, max_new_tokens)
        total = self.cpu_pool.num_pages
        if need > total:
            b = self.block_size
            raise RequestTooLarge(
                f"the request needs {need} CPU KV pages ({need * b} tokens: prompt + max_tokens "
                f"in blocks of {b}, plus one) but the CPU pool holds {total} pages in all; lower "
                "max_tokens or the prompt, or enlarge the pool (--cpu-kv-gb or --cpu-kv-tokens)",
                code="kv_capacity_exceeded",
            )

    # -- allocation (engine thread) -------------------------------------------------------------
    def can_admit(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether the CPU pages (and, with ``prefill_in_slot``, a slot) are free now."""
        if self.prefill_in_slot and len(self._slot_of) >= self.num_slots:
            return False
        if self.cpu_pool is None:
            return True
        return self.cpu_pool.can_allocate(self.pages_needed(prompt_len, max_new_tokens))

    def admit(self, request_id: str, prompt_len: int, max_new_tokens: int) -> int | None:
        """Allocate a request's pages (and its slot with ``prefill_in_slot``, returned; else
        None). All or nothing: raises ``CpuPoolFullError`` / RuntimeError with nothing taken."""
        if self.cpu_pool is not None:
            pages = self.pages_needed(prompt_len, max_new_tokens)
            self.cpu_pool.allocate(request_id, pages)
        if not self.prefill_in_slot:
            return None
        try:
            return self._take_slot(request_id)
        except BaseException:
            self._free_pages(request_id)
            raise

    def join(self, request_id: str, row: int, length: int) -> int:
        """The request joins the decode batch as row ``row`` (= the number of running
        requests): give it slot ``row``, moving its prefilled KV (``length`` tokens) there
        when it was prefilled into another slot. Returns the slot."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            slot = self._take_slot(request_id)
        if slot != row:
            holder = next((r for r, s in self._slot_of.items() if s == row), None)
            if holder in self._joined:
                raise RuntimeError(f"slot {row} is taken: running requests must hold 0..{row - 1}")
            if holder is not None:
                # A request admitted at this boundary after this one (the scheduler starts the
                # next prompt before the engine joins this one) took the slot this one joins:
                # its prefill runs after this join, so its slot holds nothing yet; it takes
                # the slot this one leaves.
                self._slot_of[holder] = slot
            for store in self._stores:
                store.move_slot(slot, row, length)
            self._slot_of[request_id] = row
        self._joined.add(request_id)
        return row

    def release(
        self, running: Sequence[tuple[str, int]], leaving: Sequence[int]
    ) -> list[tuple[int, int]]:
        """Rows ``leaving`` of the decode batch leave: their slots and pages come back and the
        remaining rows are compacted (:func:`compact_moves`), their KV moved in every store.

        Args:
            running: (request id, committed length) of every batch row, in row order.
            leaving: row indices.

        Returns the row moves, for the decode batch to mirror.
        """
        for row in leaving:
            self.free(running[row][0])
        order = list(running)
        moves = compact_moves(len(order), leaving)
        for src, dst in moves:
            rid, length = order[src]
            for store in self._stores:
                store.move_slot(src, dst, length)
            self._slot_of[rid] = dst
            order[dst] = order[src]
        return moves

    def free(self, request_id: str) -> None:
        """Return a request's slot and pages (each if it holds one). Idempotent."""
        self._slot_of.pop(request_id, None)
        self._joined.discard(request_id)
        self._free_pages(request_id)

    def _free_pages(self, request_id: str) -> None:
        if self.cpu_pool is not None and request_id in self.cpu_pool:
            self.cpu_pool.free(request_id)

    def _take_slot(self, request_id: str) -> int:
        if request_id in self._slot_of:
            raise ValueError(
                f"request {request_id!r} already holds slot {self._slot_of[request_id]}"
            )
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if not free:
            raise RuntimeError(f"all {self.num_slots} GPU KV slots are taken")
        self._slot_of[request_id] = free[0]
        return free[0]

    # -- reading --------------------------------------------------------------------------------
    def slot(self, request_id: str) -> int:
        """The request's slot; KeyError if it holds none."""
        return self._slot_of[request_id]

    def pages(self, request_id: str) -> list[int]:
        """The request's CPU page ids in block order (a copy); KeyError if it holds none."""
        if self.cpu_pool is None:
            raise KeyError(f"request {request_id!r}: this engine has no CPU pool")
        return self.cpu_pool.pages(request_id)

    @property
    def num_slots_used(self) -> int:
        return len(self._slot_of)

    def usage(self) -> KVUsage:
        pool = self.cpu_pool
        return KVUsage(
            cpu_pages_used=pool.num_used_pages if pool is not None else 0,
            cpu_pages_total=pool.num_pages if pool is not None else 0,
            gpu_slots_used=len(self._slot_of),
            gpu_slots_total=self.num_slots,
            gpu_kv_bytes=self._store_bytes,
        )
