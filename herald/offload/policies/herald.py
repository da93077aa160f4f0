"""HERALD: representative-query selection on the CPU, ahead of time from a draft (HERALD §IV).

**When**: with ``lookahead="draft"``, block n+1's selection starts right after block n's fused
step 1, from the prefix plus block n's draft, on the retrieval stream while block n keeps
denoising (HERALD §IV-A1); with ``lookahead="off"`` it runs after block n commits, on the engine's
thread, and the boundary waits for all of it. **Queries**: one [MASK] query at the centre of block
n+1 through every layer (HERALD §IV-A2). **Where**: the CPU selection kernel over the CPU pool
(:mod:`herald.offload.retrieval`). **Fetch**: the selected rows of every offloaded layer, gathered
into pinned staging and copied into the idle pool, layer by layer, overlapping the next layer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from herald.kv.pinned import PinnedStaging
from herald.offload.policies.base import NextBlock, SelectionPolicy
from herald.offload.retrieval import RetrievalJob, RetrievalWorker
from herald.offload.selection.compact_device import DeviceCompactKeys

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine


class HeraldPolicy(SelectionPolicy):
    """The representative query on the retrieval stream (see the module docstring)."""

    def __init__(self, core: OffloadEngine) -> None:
        super().__init__(core)
        off = core.offload
        assert off is not None
        self.drafts = off.lookahead == "draft"
        self._job: RetrievalJob | None = None
        self._committed: torch.Tensor | None = None  # the last on_commit's blocks
        # first_pass="int8-gpu": an int8 copy of the offloaded layers' keys on the device,
        # scored there instead of the CPU kernel (herald.offload.selection.compact_device)
        self.keys: DeviceCompactKeys | None = None
        if off.first_pass == "int8-gpu":
            cfg = core.config
            self.keys = DeviceCompactKeys(
                core.pool.layers, core.max_batch_size, cfg.num_kv_heads, core.max_seq_len,
                cfg.head_dim, core.device,
            )  # fmt: skip
        self.worker = RetrievalWorker(
            core.model,
            core.num_dense,
            core.dense_k,
            core.dense_v,
            core.cpu_pool,
            core.pool,
            core.config.mask_token_id,
            core.block_size,
            output_mode=off.output_mode,
            num_threads=core.selection_threads,
            faults=core.hooks.faults,
            kv_pad=core.kv_pad,
            groups=off.retrieval_groups,
            device_keys=self.keys,
        )

    def device_bytes(self) -> int:
        return self.keys.nbytes if self.keys is not None else 0

    def describe(self) -> str:
        if self.keys is None:
            return ""
        gib = self.keys.nbytes / 2**30
        return f"first pass int8-gpu: int8 copy of K on {self.core.device}, {gib:.2f} GiB"

    def on_draft(self, draft_kv: torch.Tensor) -> None:
        self._start(draft_kv)

    def on_commit(self, blocks: torch.Tensor) -> None:
        if self.keys is not None:  # (the tail of a selection that starts after the commit)
            self._committed = blocks
            self.keys.write_blocks(blocks[:, 0], self.core.batch.starts())

    def on_prompt_keys(self, slot: int, keys: dict[int, torch.Tensor]) -> None:
        if self.keys is not None:
            for layer in self.keys.layers:
                self.keys.write(layer, slot, 0, keys[layer])

    def on_synthetic_prefill(self, slot: int, num_tokens: int) -> None:
        if self.keys is not None:
            self.keys.fill_random(slot, num_tokens)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if self.keys is not None:
            self.keys.move_slot(src, dst, length)

    def next_block(self, finishing: bool) -> NextBlock:
        core = self.core
        if self._job is None and finishing:
            return NextBlock()
        sync = self._job is None
        t0 = time.perf_counter()
        if sync:  # lookahead off (or no step 1 ran): select now, after the commit
            self._start(None)
        job = self._job
        assert job is not None
        self._job = None
        stream = torch.cuda.current_stream(core.device) if core.cuda else None
        stall = job.wait(stream)
        if sync:  # the whole synchronous selection is the boundary's wait
            stall = time.perf_counter() - t0
        return NextBlock(job, stall)

    def _start(self, draft_kv: torch.Tensor | None) -> None:
        """Hand the next block's selection to the retrieval stream (lookahead: its thread; off:
        run now). ``draft_kv`` (``[L', 2, n, Hkv, B, D]``, device): the draft group's KV, copied
        to each request's scratch page first; None: the tail is the block just committed."""
        core = self.core
        b = core.block_size
        reqs, starts = core.batch.requests, core.batch.starts()
        draft = draft_kv is not None
        if draft_kv is not None:
            if self.keys is None:  # (scored on the device, the tail is read from draft_kv)
                scratch = [core.kv.pages(r.request_id)[-1] for r in reqs]
                core.handoff.to_cpu(draft_kv, scratch)
            tails = None  # the scratch page
        else:
            tails = [
                core.kv.pages(r.request_id)[st // b] for r, st in zip(reqs, starts, strict=True)
            ]
        table = core.page_tables(tails)
        ready = None
        if core.cuda:
            # NOTE: the event covers the main stream's work so far: the dense layers' KV of the
            # draft (or of the committed block) that the retrieval stream reads on the GPU. The
            # CPU pages were written synchronously (BlockHandoff.to_cpu). Blocking: the
            # retrieval thread synchronizes on it asleep instead of spinning a core.
            ready = torch.cuda.Event(blocking=True)
            ready.record()
        record = core.hooks.on_selection is not None
        job = RetrievalJob(
            request_ids=[r.request_id for r in reqs],
            prefix_lens=starts,
            dense_tail_start=[st + b if draft else st for st in starts],
            budgets=[core.budget_for(st + b) for st in starts],
            query_positions=[st + b + b // 2 for st in starts],
            page_table=table,
            buffer=core.pool.idle,
            ready=ready,
            record=record,
            tail_kv=(draft_kv if draft_kv is not None else self._committed) if self.keys else None,
        )
        if core.hooks.on_selection is not None:
            core.hooks.on_selection(job)
        self._job = self.worker.submit(job) if draft else self.worker.run_now(job)

    def pinned_staging(self) -> list[PinnedStaging]:
        return self.worker.staging_buffers()

    def cancel(self) -> None:
        if self._job is not None:
            self._job.done.wait()
            self._job = None
        self._committed = None

    def close(self) -> None:
        self.cancel()
        self.worker.close()
