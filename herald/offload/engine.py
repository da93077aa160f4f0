"""The offloading engine's core: lockstep blocks over a CPU full KV pool and GPU sparse pools.

Memory (HERALD §IV-B1): the first ``num_dense_layers`` layers keep their full KV on the GPU (a
dense store, exact attention). Every other layer's full KV lives in the CPU pool
(:class:`~herald.kv.cpu_pool.CpuKVPool`); denoising reads a double-buffered GPU sparse pool
(:class:`~herald.kv.sparse_pool.GpuSparseKVPool`) holding, per request and KV head, the selected
rows, the last completed block, the current block and (at one step) the draft.

Blocks run in lockstep across the batch: every running request denoises block n together, the
batch commits together, and the block boundary swaps the pools. Per block (main stream):

    step 0        forward over the active pool (a policy may select during it, with the block's
                  own queries); with a drafting policy, draft = argmax at every position
    step 1        drafting policies: one 2B forward (block + draft group); the draft's KV is
                  handed to the policy, which starts selecting for block n+1 (always run, even
                  when step 0 left no mask, so the selection's input never depends on the batch)
    steps 2..     forwards until no row has a mask left
    commit        forward on the clean blocks; their KV goes to the CPU pool
    boundary      the policy completes the next block's selection in the idle pool (waiting for
                  its retrieval stream); the completed block is copied into the idle pool; the
                  pools swap; finished requests leave; the scheduler admits waiting ones

What is selected, when and where is the policy's (:mod:`herald.offload.policies`); this module
runs the block. Every cross-stream hand-off is fenced; the NOTE comments say where and why.
"""

from __future__ import annotations

import math
import time

import torch

from herald.attention.routed import RoutedAttention
from herald.attention.sdpa import padded_kv_len
from herald.attention.slots import SlotAttention
from herald.config import EngineConfig
from herald.engine.base import Engine
from herald.engine.hooks import EngineHooks
from herald.engine.request import Request
from herald.engine.scheduler import PrefillChunk
from herald.engine.stats import BlockTiming
from herald.env import selection_threads
from herald.kv.cpu_pool import CpuKVPool
from herald.kv.dense import DenseKVCache
from herald.kv.manager import KVManager
from herald.kv.pinned import PinnedStaging
from herald.kv.sparse_pool import GpuSparseKVPool
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig
from herald.offload.handoff import BlockHandoff, page_table, pool_blocks
from herald.offload.policies import make_policy
from herald.offload.policies.base import NextBlock
from herald.offload.prefill import PromptPrefill
from herald.offload.selection.cpu import gather_selected

GATHER_CHUNKS = 4
"""Groups of requests whose selected-row gather and host-to-device copy are pipelined in
:meth:`OffloadEngine.gather_and_write` (once per layer)."""


class OffloadEngine(Engine):
    """Block-diffusion decoding with the full KV in CPU memory (see the module docstring).

    Args:
        model, config, engine_config, hooks: as :class:`~herald.engine.base.Engine`;
            ``engine_config.offload`` holds the switches (:class:`~herald.config.OffloadConfig`).
        cpu_pool: an existing CPU pool to use (a benchmark shares one across engines); default:
            one sized by ``offload.cpu_kv_gb`` / ``offload.cpu_kv_tokens``, else by
            ``max_batch_size x max_seq_len``.

    With ``kv_pad`` every store's capacity is a whole multiple of it, so a padded key length is
    never clipped to a capacity (which would make it depend on the engine's size).

    Raises ValueError (no offload config, a model that is not bf16: the CPU pool and the
    selection kernel hold bf16), torch.OutOfMemoryError (the GPU stores do not fit).
    """

    def __init__(
        self,
        model: BlockDiffusionLM,
        config: ModelConfig,
        engine_config: EngineConfig,
        hooks: EngineHooks | None = None,
        *,
        cpu_pool: CpuKVPool | None = None,
    ) -> None:
        if engine_config.offload is None:
            raise ValueError("OffloadEngine needs engine_config.offload (use DenseEngine)")
        super().__init__(model, config, engine_config, hooks)
        if self.dtype != torch.bfloat16:
            raise ValueError(
                f"offloading modes run bf16 models (the CPU pool and the selection kernel hold "
                f"bf16), got {self.dtype}"
            )
        self.offload = off = engine_config.offload
        self.num_dense = min(off.num_dense_layers, config.num_layers)
        self.selection_threads = selection_threads(off.selection_threads)
        self._alloc_gpu_stores()
        self._owns_cpu_pool = cpu_pool is None
        self.cpu_pool = cpu_pool if cpu_pool is not None else self._new_cpu_pool()
        kv = KVManager(self.max_batch_size, self.block_size, self.cpu_pool, prefill_in_slot=False)
        kv.add_store(self.dense, self.dense.num_bytes)
        kv.add_store(self.pool, self.pool.num_bytes)
        self._init_scheduler(kv)
        self.k_sel: list[int] = []  # selected rows per slot in the active pool
        self.last_len: list[int] = []  # rows of the last completed block (0 or B) per slot
        self._in_commit = False
        self._block_step = 0
        self._draft = torch.empty(0, dtype=torch.long)
        self._block_t0 = 0.0
        self._block_forwards = self.block_size  # forwards of the last block (prefill budget)
        self._stagings: dict[str, PinnedStaging] = {}
        self.prompt = PromptPrefill(self)
        # Last: the pinned registrations and the policy's threads, so that nothing above (a GPU
        # allocation running out of memory) can leave a thread or pinned memory behind.
        self.handoff = BlockHandoff(
            self.cpu_pool, self.max_batch_size, self.cuda, self.selection_threads
        )
        try:
            self.policy = make_policy(self)
            kv.add_store(self.policy, self.policy.device_bytes())
        except BaseException:
            self.handoff.close()
            if self._owns_cpu_pool:
                self.cpu_pool.close()
            raise

    def _alloc_gpu_stores(self) -> None:
        b, cfg, pad = self.block_size, self.config, self.kv_pad
        # Dense store: rows [0, max_seq_len) by absolute position + B rows for a draft.
        self.dense = DenseKVCache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.max_batch_size,
            padded_kv_len(self.max_seq_len + b, pad), self.device, self.dtype,
            layers=self.num_dense, move_all_rows=True,
        )  # fmt: skip
        self.dense_k, self.dense_v = self.dense.k, self.dense.v
        assert self.offload is not None
        self.k_cap = math.ceil(self.offload.kv_budget * self.max_seq_len)
        self.pool = GpuSparseKVPool(
            list(range(self.num_dense, cfg.num_layers)), cfg.num_layers, self.max_batch_size,
            cfg.num_kv_heads, padded_kv_len(self.k_cap + 3 * b, pad), cfg.head_dim,
            self.device, self.dtype,
        )  # fmt: skip
        dense_attn = None
        if self.num_dense:
            dense_attn = SlotAttention(self.dense_k, self.dense_v, kv_pad=pad)
        self.sparse_attn = SlotAttention(*self.pool.store(self.pool.active), kv_pad=pad)
        self.attn = RoutedAttention(self.num_dense, dense_attn, self.sparse_attn)

    def _new_cpu_pool(self) -> CpuKVPool:
        off, cfg, b = self.offload, self.config, self.block_size
        assert off is not None
        dims = (len(self.pool.layers), cfg.num_kv_heads, cfg.head_dim, b)
        # the CPU pool's int8 copy of K (first_pass="int8") counts in the pool's size
        fp = off.first_pass if off.first_pass == "int8" else "none"
        if off.cpu_kv_gb is not None:
            return CpuKVPool.from_gib(off.cpu_kv_gb, *dims, first_pass=fp)
        if off.cpu_kv_tokens is not None:
            return CpuKVPool.from_tokens(off.cpu_kv_tokens, *dims, first_pass=fp)
        return CpuKVPool(*dims, self.max_batch_size * (self.max_seq_len // b + 1), first_pass=fp)

    # -- sizes ----------------------------------------------------------------------------------
    def budget_for(self, prefix: int) -> int:
        """Selected rows per KV head for a block whose committed prefix is ``prefix`` tokens:
        ``min(ceil(kv_budget x prefix), prefix - last block)``."""
        assert self.offload is not None
        last = self.block_size if prefix >= self.block_size else 0
        return min(math.ceil(self.offload.kv_budget * prefix), prefix - last)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """CPU pool pages a request holds while it runs (:meth:`KVManager.pages_needed`)."""
        return self.kv.pages_needed(prompt_len, max_new_tokens)

    def describe(self) -> str:
        extra = self.policy.describe()
        return f"{super().describe()}; {self.cpu_pool.describe()}" + (f"; {extra}" if extra else "")

    def pinned_staging(self) -> list[PinnedStaging]:
        """Every pinned staging buffer of this engine and its policy (the CPU pool not
        included): the hand-off's, the gathers', the retrieval stream's."""
        return [self.handoff.staging, *self._stagings.values(), *self.policy.pinned_staging()]

    def pool_prefix(self) -> list[int]:
        """Rows already in each slot's active pool before the current block: selected rows
        plus the last completed block."""
        return [k + last for k, last in zip(self.k_sel, self.last_len, strict=True)]

    # -- services for the policies ----------------------------------------------------------------
    def staging(self, name: str, numel: int) -> PinnedStaging:
        """The pinned staging buffer ``name`` (created on first use, grown if too small)."""
        st = self._stagings.get(name)
        if st is None or st.numel < numel:
            if st is not None:
                st.close()
            st = self._stagings[name] = PinnedStaging(numel, self.cpu_pool.dtype, self.cuda)
        return st

    def gather_and_write(
        self,
        buf: int,
        layer: int,
        table: torch.Tensor,
        indices: torch.Tensor,
        num_selected: torch.Tensor,
    ) -> None:
        """Gather the selected rows of ``layer`` from the CPU pool into pinned staging and write
        them into pool rows ``[0, k_r)`` of every request: in up to :data:`GATHER_CHUNKS` groups
        of requests, each group's asynchronous host-to-device copy overlapping the next group's
        gather. ``indices`` ``[n, Hkv, k_max]`` int32 and ``num_selected`` ``[n]`` as
        :func:`~herald.offload.selection.cpu.select_topk` returns them."""
        pl = layer - self.num_dense
        kp, vp = self.cpu_pool.k_pages(pl), self.cpu_pool.v_pages(pl)
        n, hkv, kmax = indices.shape
        per_req = 2 * hkv * kmax * kp.shape[3]
        staging = self.staging("selected", n * per_req)
        # NOTE: take() waits until the previous layer's copies from this staging completed
        flat = staging.take((n * per_req,))
        faults = self.hooks.faults
        if faults is not None and faults.poison_staging:
            flat.fill_(float("nan"))
        step = max(1, -(-n // GATHER_CHUNKS))
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            host = flat[c0 * per_req : c1 * per_req].view(2, c1 - c0, hkv, kmax, kp.shape[3])
            gather_selected(
                kp, vp, table[c0:c1], indices[c0:c1], num_selected[c0:c1], out=host,
                num_threads=self.selection_threads,
            )  # fmt: skip
            gathered = host.to(self.device, self.dtype, non_blocking=True)
            self.write_selected(buf, layer, gathered, first=c0)
        staging.copied()

    def write_selected(self, buf: int, layer: int, gathered: torch.Tensor, first: int = 0) -> None:
        """Gathered rows ``[2, m, Hkv, k_max, D]`` of requests ``first .. first + m - 1`` -> their
        pool rows ``[0, k_r)``.

        NOTE: exactly k_r rows each: rows past a request's k in ``gathered`` are uninitialised,
        and the pool rows after k_r hold the last completed block."""
        gk, gv = gathered[0], gathered[1]
        for j in range(gathered.shape[1]):
            i, kk = first + j, self.k_sel[first + j]
            self.pool.k(buf, layer)[i, :, :kk] = gk[j, :, :kk]
            self.pool.v(buf, layer)[i, :, :kk] = gv[j, :, :kk]

    def page_tables(self, tails: list[int] | None = None) -> torch.Tensor:
        """Page table of the batch rows: each request's committed pages then one tail page
        (``tails[i]``, default: its scratch page, the last it holds)."""
        b, tables = self.block_size, []
        for i, (req, st) in enumerate(zip(self.batch.requests, self.batch.starts(), strict=True)):
            pages = self.kv.pages(req.request_id)
            tail = pages[-1] if tails is None else tails[i]
            tables.append(pages[: st // b] + [tail])
        return page_table(tables)

    # -- boundary -------------------------------------------------------------------------------
    def _prefill(self, chunk: PrefillChunk) -> None:
        self.prompt.run_chunk(chunk)

    def _join(self, chunk: PrefillChunk) -> None:
        req = chunk.request
        slot = self.kv.join(req.request_id, len(self.batch), 0)
        try:
            k, last = self.prompt.finish(req, slot)
        finally:
            self.prompt.drop()
        self.k_sel.append(k)
        self.last_len.append(last)
        self.batch.add(req)

    def _forwards_per_boundary(self) -> int:
        """The forwards of the last block (its denoising steps and the commit; before the first
        block, ``block_size``): this engine admits once per block."""
        return self._block_forwards

    def _reset_after_failure(self) -> None:
        self.policy.cancel()
        self._sync()
        self.prompt.drop()
        self.k_sel, self.last_len = [], []
        self._in_commit, self._block_step = False, 0

    def close(self) -> None:
        """Stop the policy's threads, release every request's pages and the pinned memory (the
        CPU pool too, when this engine made it). Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.policy.close()
        super().close()
        self.prompt.drop()
        self.handoff.close()
        for staging in self._stagings.values():
            staging.close()
        self._stagings.clear()
        if self._owns_cpu_pool:
            # NOTE: unregistered now (after the device synchronization above), not by a
            # finalizer at an arbitrary point, which could fall inside another capture.
            self.cpu_pool.close()

    # -- one step -------------------------------------------------------------------------------
    def _step(self) -> list[Request]:
        """One forward of the running batch: a denoising step, the fused draft step or the
        commit forward (then the block boundary)."""
        if self.scheduler.prefilling is None and self.prompt.request is not None:
            self.prompt.drop()  # its request was aborted mid-prefill
        if not len(self.batch):
            self._admit()
            if not len(self.batch):
                return []
            self._in_commit, self._block_step = False, 0
        t0 = time.perf_counter()
        if self._block_step == 0 and not self._in_commit:
            self._block_t0 = t0
        rows, boundary = len(self.batch), self._in_commit
        finished = self._commit() if boundary else self._denoise_step()
        self.stats.num_forwards += 1
        self.stats.num_batch_rows += rows
        self.stats.decode_seconds += time.perf_counter() - t0
        if boundary:
            self._admit()  # the block boundary's prefill and joins (counted as prefill)
        return finished

    def _prepare(self, length: int = 0, draft_group: bool = False) -> None:
        self.attn.prepare(
            self.batch.starts(), self.pool_prefix(), length or self.block_size, draft_group
        )

    def _denoise_step(self) -> list[Request]:
        b, s = self.block_size, self._block_step
        input_ids, positions = self.batch.inputs()
        drafts = self.policy.drafts
        draft_kv = None
        step0 = self.policy.step0_attention() if s == 0 else None
        if step0 is not None:
            self._prepare()
            hidden = self.model(input_ids, positions, step0)
        elif s == 1 and drafts:
            self._prepare(2 * b, draft_group=True)
            ids = torch.cat([input_ids, self._draft], dim=1)
            hidden = self.runner.forward(ids, torch.cat([positions, positions], dim=1), self.attn)
            # The draft group's KV sits in the active pool right after the block's rows; later
            # steps of this block never write those rows, so it can be read after apply().
            offsets = [p + b for p in self.pool_prefix()]
            draft_kv = pool_blocks(self.pool, self.pool.active, offsets, b)
        else:
            self._prepare()
            hidden = self.runner.forward(input_ids, positions, self.attn)
        finished_rows, _, draft = self.batch.apply(
            self.model, hidden, advance_clean=False, want_draft=s == 0 and drafts
        )
        if draft is not None:
            self._draft = draft
        if draft_kv is not None and not all(map(self._last_block, self.batch.requests)):
            self.policy.on_draft(draft_kv)
        self._block_step += 1
        if not self.batch.any_masked() and not (s == 0 and drafts and self._needs_next()):
            # NOTE: a drafting policy always gets its fused draft step, even when step 0 left no
            # mask in any row: a row's next selection must not depend on whether its batch mates
            # still had masks (alone it would otherwise select from its committed block, next to
            # a slower mate from its draft: other inputs, other rounding, other tokens).
            self._in_commit = True
        return [self.batch.requests[i] for i in finished_rows]

    def _needs_next(self) -> bool:
        """Some running row has a block after this one."""
        return any(not r.status.finished and not self._last_block(r) for r in self.batch.requests)

    def _last_block(self, req: Request) -> bool:
        """True when ``req`` ends with the current block by length (then no request of a batch
        made only of such needs the next block's selection).

        NOTE: from the block's position, not from ``output_ids``: a row's block tokens are
        appended at the step its last mask is accepted, so a count of them would read "last
        block" one step early for a row that finished its masks at step 0 or 1, and then the
        fused draft step's selection would be skipped when the row runs alone but not next to a
        slower mate (other selection inputs, other tokens)."""
        end = min(req.prompt_len + req.params.max_new_tokens, req.layout.total_len)
        return req.block_start + self.block_size >= end

    def _commit(self) -> list[Request]:
        b = self.block_size
        input_ids, positions = self.batch.inputs()
        self._prepare()
        self.runner.forward(input_ids, positions, self.attn)  # the clean blocks' KV -> their rows
        reqs, starts = self.batch.requests, self.batch.starts()
        # The clean block's KV of every row and pooled layer, in one device tensor. Rows that
        # finished (or were aborted) are written too: their pages are freed right after.
        blocks = pool_blocks(self.pool, self.pool.active, self.pool_prefix(), b)
        pages = [self.kv.pages(r.request_id)[st // b] for r, st in zip(reqs, starts, strict=True)]
        self.handoff.to_cpu(blocks, pages)
        self.policy.on_commit(blocks)
        main_t = time.perf_counter() - self._block_t0
        k_next = [self.budget_for(st + b) for st in starts]
        finishing = all(r.status.finished for r in reqs)
        nxt = self.policy.next_block(finishing)
        self._swap_pools(blocks, k_next)
        self.stats.blocks.append(self._timing(main_t, nxt, len(reqs)))
        self._leave()
        self._block_forwards = self._block_step + 1
        self._in_commit, self._block_step = False, 0
        return []

    def _swap_pools(self, blocks: torch.Tensor, k_next: list[int]) -> None:
        """The completed block becomes the next pool's last block (idle rows [k', k' + B)),
        then the pools swap. NOTE: the policy's ``next_block`` has made the main stream wait for
        every write into the idle pool before this point."""
        b, n, idle = self.block_size, len(k_next), self.pool.idle
        for kv, dst in enumerate((self.pool.all_k(idle), self.pool.all_v(idle))):
            if all(x == k_next[0] for x in k_next):
                dst[:, :n, :, k_next[0] : k_next[0] + b] = blocks[:, kv]
            else:
                for i, kn in enumerate(k_next):
                    dst[:, i, :, kn : kn + b] = blocks[:, kv, i]
        self.pool.swap()
        self.sparse_attn.set_store(*self.pool.store(self.pool.active))
        self.k_sel, self.last_len = k_next, [b] * n

    def _timing(self, main_t: float, nxt: NextBlock, batch: int) -> BlockTiming:
        t0 = self._block_t0
        job = nxt.job
        if job is None:
            return BlockTiming(main_t, 0.0, nxt.stall, batch, steps=self._block_step + 1)
        layers: dict[str, float] = {}
        if job.layer_seconds:
            lay = torch.tensor(job.layer_seconds).sum(0).tolist()
            layers = {"query_to_host": lay[0], "kernel": lay[1], "gather_copy": lay[2]}
        return BlockTiming(
            main_t, job.seconds, nxt.stall, batch, job.t_start - t0, job.t_end - t0,
            self._block_step + 1, job.t_submit - t0, layers,
        )  # fmt: skip

    def _leave(self) -> None:
        """Finished (and aborted) requests leave; the rest move to their next block."""
        reqs = self.batch.requests
        done = [i for i, r in enumerate(reqs) if r.status.finished]
        self.batch.advance([i for i in range(len(reqs)) if i not in done])
        for src, dst in self._release_rows(done):
            self.k_sel[dst], self.last_len[dst] = self.k_sel[src], self.last_len[src]
        del self.k_sel[len(self.batch) :], self.last_len[len(self.batch) :]
