"""A retrieval job: what the engine thread hands the retrieval worker for one block's selection
(:mod:`herald.offload.retrieval`), and what the worker fills in."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RetrievalJob:
    """Select for the next block of rows ``0..n-1`` (KV slot order).

    ``prefix_lens[i]`` tokens of committed prefix are ranked (pages ``page_table[i, :prefix/B]``);
    the tail block (page ``page_table[i, prefix/B]``) is attended but never selected; its dense-
    layer rows sit at ``dense_tail_start[i]``. ``budgets[i]`` entries per KV head are selected
    into rows ``[0, k)`` of ``pool`` buffer ``buffer``.
    """

    request_ids: list[str]
    prefix_lens: list[int]
    dense_tail_start: list[int]
    budgets: list[int]
    query_positions: list[int]
    page_table: torch.Tensor
    buffer: int
    ready: torch.cuda.Event | None = None
    record: bool = False
    # first_pass="int8-gpu": the tail's KV on the device, [L', 2, n, Hkv, B, D] (the draft
    # group's, or the block just committed).
    tail_kv: torch.Tensor | None = None
    # Filled by the worker.
    num_selected: list[int] = field(default_factory=list)
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    seconds: float = 0.0
    t_submit: float = 0.0  # host perf_counter stamps: handed to the worker, begun, ended
    t_start: float = 0.0
    t_end: float = 0.0
    # Per offloaded layer: host seconds in (query to host, CPU kernel with its fused gather,
    # issuing the copies).
    layer_seconds: list[tuple[float, float, float]] = field(default_factory=list)
    # Per request group (keyed by its first row): the copies' row mask of the idle pool,
    # (counts, pinned host mask, device mask); the GPU fetch's device tensors, (counts, pinned
    # host table and counts, device table, device counts).
    pad_mask: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    fetch_meta: dict[
        int, tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    ] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    cuda_done: torch.cuda.Event | None = None
    error: BaseException | None = None

    def wait(self, stream: torch.cuda.Stream | None = None) -> float:
        """Block the host until the job ran; make ``stream`` wait for its GPU work. Returns the
        host seconds spent waiting (the block-boundary stall)."""
        t0 = time.perf_counter()
        self.done.wait()
        if self.error is not None:
            raise RuntimeError("retrieval stream failed") from self.error
        if stream is not None and self.cuda_done is not None:
            # NOTE: copy-before-read: the main stream reads the idle pool after this point only.
            stream.wait_event(self.cuda_done)
        return time.perf_counter() - t0
