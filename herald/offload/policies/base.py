"""The selection policy interface: what an offloading mode decides and the core does not.

A policy answers four questions for the lockstep core (:mod:`herald.offload.engine`):

- **when** to select block n+1's critical KV: during block n's step 0 with the block's own
  queries (:meth:`SelectionPolicy.step0_attention`), ahead of time from block n's draft
  (:attr:`SelectionPolicy.drafts`, :meth:`SelectionPolicy.on_draft`), or after block n commits;
- **with which queries**: the block's B queries, one representative query, a proxy's channels;
- **where**: on the CPU next to the full KV, or on the GPU after fetching it;
- **what to fetch** into the pool's selected rows ``[0, k)``: and it must have written them into
  the right buffer before the core reads it (:meth:`SelectionPolicy.next_block`).

To add a policy: subclass :class:`SelectionPolicy` in a module of this package and register it
in :data:`herald.offload.policies.POLICIES` under its mode name (``OffloadConfig.mode``); the core
is not touched. The core's services a policy may use are its attributes documented in
:class:`~herald.offload.engine.OffloadEngine` (``pool``, ``kv``, ``cpu_pool``, ``batch``,
``k_sel``, ``last_len``, ``budget_for``, ``gather_and_write``, ``page_tables``, ``handoff``,
``attn``, ``hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from herald.attention.base import AttentionBackend
from herald.kv.pinned import PinnedStaging

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine


@dataclass
class NextBlock:
    """What the block boundary waited for: the retrieval job that selected the next block (None
    when the policy selects at the next step 0) and the host seconds the boundary stalled."""

    job: Any = None
    stall: float = 0.0


class SelectionPolicy:
    """Base policy: selects nothing ahead, keeps no state; every hook is a no-op.

    ``drafts``: the core takes a draft of each block at step 0 (the argmax at every position)
    and fuses the draft group into step 1's forward (HERALD §IV-A1), handing its KV to
    :meth:`on_draft`.
    """

    drafts: bool = False

    def __init__(self, core: OffloadEngine) -> None:
        self.core = core

    def step0_attention(self) -> AttentionBackend | None:
        """The backend of the block's step 0 (selecting into the active pool as it attends),
        or None for the core's plain sparse attention."""
        return None

    def on_draft(self, draft_kv: torch.Tensor) -> None:
        """Block n's draft KV ``[L', 2, n, Hkv, B, D]`` (device), after the fused step 1."""

    def on_commit(self, blocks: torch.Tensor) -> None:
        """Block n's committed KV ``[L', 2, n, Hkv, B, D]`` (device), already in the CPU pool."""

    def next_block(self, finishing: bool) -> NextBlock:
        """At the block boundary, before the pools swap: make the idle pool's selected rows of
        block n+1 complete, and the main stream wait for every write into them. ``finishing``:
        every row finishes with this block (nothing needs a next block)."""
        return NextBlock()

    def on_prompt_keys(self, slot: int, keys: dict[int, torch.Tensor]) -> None:
        """A prompt joined as ``slot``: ``keys[layer]`` ``[Hkv, S, D]`` (device) of every layer."""

    def on_synthetic_prefill(self, slot: int, num_tokens: int) -> None:
        """A synthetic prefill (benchmarks) joined as ``slot`` with ``num_tokens`` prompt KV."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Slot compaction (the KV manager): move the policy's per-slot state."""

    def device_bytes(self) -> int:
        """Bytes the policy holds on the model device (counted in the engine's KV usage)."""
        return 0

    def describe(self) -> str:
        """What the policy keeps beyond the pools, for the engine's start-up line ("" if none)."""
        return ""

    def pinned_staging(self) -> list[PinnedStaging]:
        """The pinned staging buffers the policy owns."""
        return []

    def cancel(self) -> None:
        """A step failed: wait for and drop any selection in flight."""

    def close(self) -> None:
        """Stop threads and release buffers (idempotent)."""
