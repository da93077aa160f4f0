"""Instrumentation that tests and benchmarks pass to an engine (``hooks=EngineHooks(...)``).

None of it changes what a served engine computes: a server builds its engine without hooks (its
start-up memory check, :mod:`herald.server.peak`, sets :class:`SyntheticPrefill` for one step and
takes it off again).

- :class:`SyntheticPrefill`: random KV in place of the prompt forward (decode-throughput
  benchmarks: decode speed does not depend on the KV's values);
- :class:`FaultInjection`: random delays in the retrieval stream and poisoned (NaN) pinned
  staging, to expose missing fences and rows copied past a request's selection;
- :class:`SelectionRecorder`: every retrieval job, with its queries and selected rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SyntheticPrefill:
    """Fill each prompt's KV with random values instead of running the prompt forward and the
    first block's selection.

    ``cpu_pages``: also write random values into the CPU pool's pages (False: leave them as they
    are: a benchmark that filled the whole pool once saves ~1 GiB of host writes per 32K-token
    LLaDA2.0-mini request). ``seed`` seeds the CPU pages' values.
    """

    cpu_pages: bool = True
    seed: int = 0
    _pages: torch.Tensor | None = field(default=None, repr=False)

    def fill_rows(self, tensors: list[torch.Tensor], slot: int, start: int, end: int) -> None:
        """Random rows ``[start, end)`` of ``slot`` in every ``[slots, Hkv, rows, D]`` tensor."""
        for t in tensors:
            t[slot, :, start:end].normal_()

    def page_values(self, num_pages: int, shape: tuple[int, int, int], dtype: torch.dtype):
        """``[num_pages, *shape]`` random CPU page values (made once, grown when needed)."""
        if self._pages is None or self._pages.shape[0] < num_pages:
            g = torch.Generator().manual_seed(self.seed)
            self._pages = torch.randn(num_pages, *shape, generator=g).to(dtype)
        return self._pages[:num_pages]


@dataclass
class FaultInjection:
    """Faults injected into the retrieval stream. ``max_delay``: sleep a uniform random time in
    ``[0, max_delay]`` seconds before the job and after every layer (0: never). ``poison_staging``:
    fill every pinned staging buffer with NaN before each use, so a row copied past a request's
    selection poisons the output (masked pool rows still meet a zero probability, and 0 * NaN is
    NaN). ``seed`` seeds the delays."""

    max_delay: float = 0.0
    poison_staging: bool = False
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_delay < 0:
            raise ValueError(f"max_delay must be >= 0, got {self.max_delay}")
        self._rng = random.Random(self.seed)

    def delay(self) -> float:
        """Seconds to sleep at the next delay point."""
        return self._rng.uniform(0.0, self.max_delay) if self.max_delay > 0 else 0.0


@dataclass
class SelectionRecorder:
    """Keeps every retrieval job (``jobs``), each with its per-layer ``(query, indices)`` in
    ``job.recorded`` once it is done (``job.done.is_set()``)."""

    jobs: list[Any] = field(default_factory=list)

    def __call__(self, job: Any) -> None:
        self.jobs.append(job)


@dataclass(frozen=True)
class EngineHooks:
    """What an engine is built with beyond its configuration (all optional)."""

    synthetic_prefill: SyntheticPrefill | None = None
    faults: FaultInjection | None = None
    on_selection: Callable[[Any], None] | None = None
    """Called with each retrieval job when it is handed over; the job records its queries and
    selected rows (``job.recorded``) when this is set."""
