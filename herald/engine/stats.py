"""Counters of an engine's life: tokens, forwards, seconds, and per-block stream timings."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_KEPT = 10_000
"""Per-step and per-block records kept; older ones are dropped (a long-lived server)."""


@dataclass
class BlockTiming:
    """One lockstep block of an offloading engine (seconds, host clock).

    ``main``: the main stream, from the block's first forward to the end of its commit.
    ``retrieval``: the retrieval job for the next block, start to end. ``stall``: how long the
    block boundary waited for it. ``retrieval_submit`` / ``retrieval_start`` / ``retrieval_end``:
    when that job was handed over, began and ended, in seconds after this block's first forward
    began (None when no job ran). ``retrieval_layers``: the job's host seconds summed over the
    offloaded layers, split into query to host, CPU kernel, and gather + copies. ``steps``: the
    forwards of the block, commit included.
    """

    main: float
    retrieval: float
    stall: float
    batch: int
    retrieval_start: float | None = None
    retrieval_end: float | None = None
    steps: int = 0
    retrieval_submit: float | None = None
    retrieval_layers: dict[str, float] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Counters of one engine's life, all in tokens / seconds. ``blocks`` is empty for the dense
    engine (its rows are not in lockstep)."""

    num_prefill_tokens: int = 0
    """Prompt tokens run through prefill forwards (whole blocks: a prompt's last, partial block
    is decoded with its first generated block)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that joined the batch (whole prompts)."""
    num_generated_tokens: int = 0
    num_forwards: int = 0
    num_batch_rows: int = 0
    """Rows of every decode forward, summed (over ``num_forwards``: the mean batch size)."""
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_batch_sizes: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    num_nonfinite_steps: int = 0
    blocks: list[BlockTiming] = field(default_factory=list)
    blocks_dropped: int = 0
    """Block records dropped by :meth:`trim`: ``blocks[i]`` is block ``blocks_dropped + i``."""

    def trim(self) -> None:
        """Drop the oldest per-step and per-block records once there are more than
        :data:`MAX_KEPT` (keeping the newest tenth)."""
        for records in (self.step_seconds, self.step_batch_sizes):
            if len(records) > MAX_KEPT:
                del records[: len(records) - MAX_KEPT // 10]
        if len(self.blocks) > MAX_KEPT:
            drop = len(self.blocks) - MAX_KEPT // 10
            del self.blocks[:drop]
            self.blocks_dropped += drop
