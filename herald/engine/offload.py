"""The offloading engine: HERALD, and MAGE-Offload in the same machinery (DESIGN §2, §4).

Memory: the first ``num_dense_layers`` layers keep their full KV on the GPU (dense store, exact
attention). Every other layer's full KV lives in the CPU pool (:class:`CpuKVPool`); denoising reads
a double-buffered GPU sparse pool (:class:`GpuSparseKVPool`) holding, per request and KV head, the
selected rows, the last completed block, the current block and (at one step) the draft.

Blocks run in lockstep across the batch: every running request denoises block n together, the
batch commits together, and the block boundary swaps the pools. Per block (main stream):

    step 0        forward over the active pool; accept tokens; draft = argmax at every position
                  (MAGE: exact attention over the full KV with the block's B queries, selecting)
    step 1        lookahead: one 2B forward (block + draft group); the draft KV goes to the CPU
                  pool and the retrieval stream starts selecting for block n+1
    steps 2..     forwards until no row has a mask left
    commit        forward on the clean blocks; their KV goes to the CPU pool
    boundary      wait for the retrieval stream (lookahead off: run it now); copy the completed
                  block into the idle pool; swap pools; finished requests leave

Every cross-stream hand-off is fenced; the NOTE comments say where and why.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from herald.config import OffloadConfig, SamplingParams
from herald.diffusion.batch import DecodeBatch
from herald.diffusion.block import BlockLayout
from herald.engine.cuda_graph import PiecewiseGraphForward
from herald.engine.dense import EngineStats
from herald.engine.request import Request, abort_request, new_request
from herald.engine.retrieval import RetrievalJob, RetrievalWorker
from herald.kv.cpu_pool import CpuKVPool
from herald.kv.dense_cache import (
    DEFAULT_KV_PAD,
    SlotAttention,
    _sdpa_folded,
    attend_prefix_and_tail,
    check_kv_pad,
    padded_kv_len,
)
from herald.kv.gpu_selection import select_topk_rows
from herald.kv.pinned import PinnedStaging
from herald.kv.proxy import proxy_channels, proxy_topk
from herald.kv.selection import default_num_threads, gather_selected, select_topk
from herald.kv.sparse_pool import GpuSparseKVPool
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig

GATHER_CHUNKS = 4
"""Groups of requests whose selected-row gather and host-to-device copy are pipelined (MAGE with
CPU selection and InfiniGen, once per layer at step 0)."""

MAGE_FETCH_AHEAD = 4
"""Requests whose full-KV copies MAGE's step 0 keeps in flight ahead of the attention reading
them (device memory: this many requests' K/V of one layer)."""


@dataclass
class BlockTiming:
    """Per-block timing (seconds, host clock): main stream, retrieval stream, boundary stall.

    ``retrieval_submit`` / ``retrieval_start`` / ``retrieval_end``: when the retrieval job for
    the next block was handed over, began and ended, in seconds after this block's first step
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
class OffloadStats(EngineStats):
    """The dense engine's counters plus per-block stream timings."""

    blocks: list[BlockTiming] = field(default_factory=list)


@dataclass
class _Prefill:
    """A prompt being prefilled over one or more block boundaries: its full KV of every layer in
    a temporary store ``[1, Hkv, S + B, D]`` per layer (allocated at the first chunk)."""

    req: Request
    pos: int = 0  # prompt tokens prefilled so far
    tk: list[torch.Tensor] | None = None
    tv: list[torch.Tensor] | None = None
    temp: SlotAttention | None = None


class _RoutedAttention:
    """Dense store for the first layers, sparse pool for the rest."""

    def __init__(self, num_dense: int, dense: SlotAttention | None, sparse: SlotAttention) -> None:
        self.num_dense, self.dense, self.sparse = num_dense, dense, sparse

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer_id < self.num_dense:
            assert self.dense is not None
            return self.dense.forward(layer_id, q, k, v)
        return self.sparse.forward(layer_id, q, k, v)


class _MageAttention:
    """Step 0 of a MAGE block: exact attention of the B block queries over the full KV of every
    offloaded layer, selecting the top-k rows into the active pool as a by-product."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.e = engine

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        e = self.e
        if layer_id < e.num_dense:
            return e.attn.forward(layer_id, q, k, v)
        if e.offload.selection_device == "gpu":
            return e._mage_layer_gpu(layer_id, q, k, v)
        return e._mage_layer_cpu(layer_id, q, k, v)


class _ProxyAttention:
    """Step 0 of an InfiniGen block: proxy top-k from the partial-key cache, fetch the rows from
    the CPU pool into the active pool, then sparse attention over it like every other step."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.e = engine

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        e = self.e
        if layer_id >= e.num_dense:
            e._proxy_fetch(layer_id, q)
        return e.attn.forward(layer_id, q, k, v)


class OffloadEngine:
    """Block-diffusion decoding with the full KV in CPU memory (HERALD / MAGE-Offload).

    Args:
        model, config: as for :class:`~herald.engine.dense.DenseEngine`.
        offload: the switches (:class:`~herald.config.OffloadConfig`).
        max_batch_size, max_seq_len: running requests and tokens per request at most.
        prefill_chunk_tokens: prompt tokens per prefill forward (whole blocks).
        max_prefill_tokens: prompt tokens prefilled per block boundary at most (whole blocks, at
            least one); one request is prefilled at a time, its full prompt KV held in a
            temporary GPU store until its last chunk, then it joins the batch. None: every
            admitted prompt is prefilled whole at the boundary.
        cpu_pool: an existing pool (tests); default: one sized by ``offload.cpu_kv_gb`` /
            ``offload.cpu_kv_tokens`` or by ``max_batch_size x max_seq_len``.
        retrieval_delay: a callable returning seconds to sleep at each retrieval layer (the
            stress test injects random delays to expose missing fences).
        record_selection: keep each retrieval job's queries and indices (tests).
        random_prefill: fill each prompt's KV (CPU pool, dense store, first block's sparse pool)
            with random values instead of running the prompt forward and the first selection
            (decode-throughput benchmarks only: decode speed does not depend on the values).
            ``"gpu"``: the same but leave the CPU pages as they are (a benchmark that filled the
            whole pool once saves ~1 GiB of writes per 32K-token LLaDA2.0-mini request).
        kv_pad: key lengths of every attention (main and retrieval streams) rounded up to a
            multiple of this, masked per row (:class:`~herald.kv.dense_cache.SlotAttention`).
            The default, :data:`~herald.kv.dense_cache.DEFAULT_KV_PAD`, makes outputs
            independent of which requests share the batch and equal to a dense engine's with
            the same padding at budget 1.0, on the CPU and the GPU. 0: off (the batch's longest
            row, exactly).
        use_cuda_graph: on CUDA, replay everything but attention from piecewise CUDA graphs
            (:mod:`herald.engine.cuda_graph`) in the plain and fused steps and the commit,
            captured once per batch size (default on, as the dense engine; on the H200 a
            32K x 32 LLaDA2.0-mini step takes ~25 ms with graphs, ~43 ms eager; the GPU test
            checks graphs give eager's tokens with the retrieval thread running).
    """

    def __init__(
        self,
        model: BlockDiffusionLM,
        config: ModelConfig,
        offload: OffloadConfig,
        *,
        max_batch_size: int,
        max_seq_len: int,
        prefill_chunk_tokens: int = 4096,
        max_prefill_tokens: int | None = None,
        cpu_pool: CpuKVPool | None = None,
        retrieval_delay: Callable[[], float] | None = None,
        record_selection: bool = False,
        random_prefill: bool | str = False,
        kv_pad: int = DEFAULT_KV_PAD,
        use_cuda_graph: bool = True,
    ) -> None:
        offload.validate()
        check_kv_pad(kv_pad)
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}"
            )
        self.model, self.config, self.offload = model, config, offload
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.dtype != torch.bfloat16:
            raise ValueError(
                f"offloading modes run bf16 models (the CPU pool and the selection kernel hold "
                f"bf16), got {self.dtype}"
            )
        b = self.block_size = config.block_size
        L = config.num_layers
        self.num_dense = min(offload.num_dense_layers, L)
        self.max_seq_len = -(-max_seq_len // b) * b
        self.max_batch_size = max_batch_size
        self.prefill_chunk = max(b, (prefill_chunk_tokens // b) * b)
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 or None, got {max_prefill_tokens}")
        self.max_prefill_tokens = (
            None if max_prefill_tokens is None else max(b, (max_prefill_tokens // b) * b)
        )
        self._prefilling: _Prefill | None = None
        hkv, d = config.num_kv_heads, config.head_dim
        # Dense store: rows [0, max_seq_len) by absolute position + B rows for a draft.
        # NOTE: with kv_pad, store capacities are whole multiples of it, so a padded key length
        # is never clipped to a capacity (which would make it depend on the engine's size).
        dshape = (max_batch_size, hkv, padded_kv_len(self.max_seq_len + b, kv_pad), d)
        self.dense_k: list[torch.Tensor | None] = [None] * L
        self.dense_v: list[torch.Tensor | None] = [None] * L
        for i in range(self.num_dense):
            self.dense_k[i] = torch.zeros(dshape, device=self.device, dtype=self.dtype)
            self.dense_v[i] = torch.zeros(dshape, device=self.device, dtype=self.dtype)
        pooled = list(range(self.num_dense, L))
        self.k_cap = math.ceil(offload.kv_budget * self.max_seq_len)
        self.pool = GpuSparseKVPool(
            pooled,
            L,
            max_batch_size,
            hkv,
            padded_kv_len(self.k_cap + 3 * b, kv_pad),
            d,
            self.device,
            self.dtype,
        )
        if cpu_pool is None:
            n_pages = max_batch_size * (self.max_seq_len // b + 1)
            if offload.cpu_kv_gb is not None:
                cpu_pool = CpuKVPool.from_gib(offload.cpu_kv_gb, len(pooled), hkv, d, b)
            elif offload.cpu_kv_tokens is not None:
                cpu_pool = CpuKVPool.from_tokens(offload.cpu_kv_tokens, len(pooled), hkv, d, b)
            else:
                cpu_pool = CpuKVPool(len(pooled), hkv, d, b, n_pages)
        self.cpu_pool = cpu_pool
        self.kv_pad = kv_pad
        self.dense_attn = (
            SlotAttention(self.dense_k, self.dense_v, kv_pad=kv_pad) if self.num_dense else None
        )
        self.sparse_attn = SlotAttention(*self.pool.store(self.pool.active), kv_pad=kv_pad)
        self.attn = _RoutedAttention(self.num_dense, self.dense_attn, self.sparse_attn)
        self.selection_threads = _selection_threads(offload.selection_threads)
        if random_prefill not in (False, True, "gpu"):
            raise ValueError(f"random_prefill must be False, True or 'gpu', got {random_prefill!r}")
        self.random_prefill = random_prefill
        self.proxy_chans: dict[int, torch.Tensor] = {}
        self.partial_k: dict[int, torch.Tensor] = {}
        if offload.selection_queries == "proxy":
            for layer_id in pooled:
                chans = proxy_channels(model.layers[layer_id], offload.proxy_ratio)  # type: ignore[arg-type]
                self.proxy_chans[layer_id] = chans.to(self.device)
                self.partial_k[layer_id] = torch.zeros(
                    max_batch_size,
                    hkv,
                    self.max_seq_len,
                    chans.shape[1],
                    device=self.device,
                    dtype=self.dtype,
                )
        self.record_selection = record_selection
        self.selections: list[RetrievalJob] = []
        self.batch = DecodeBatch(b, config.mask_token_id, config.eos_token_ids, self.device)
        self.waiting: deque[Request] = deque()
        self.k_sel: list[int] = []  # selected rows per slot in the active pool
        self.last_len: list[int] = []  # rows of the last completed block (0 or B) per slot
        self._phase = "denoise"
        self._block_step = 0
        self._job: RetrievalJob | None = None
        self._draft = torch.empty(0, dtype=torch.long)
        self._block_t0 = 0.0
        self.stats = OffloadStats()
        self.cuda = self.device.type == "cuda"
        self.use_cuda_graph = use_cuda_graph and self.cuda
        self._graphs: dict[tuple[int, int], PiecewiseGraphForward] = {}
        self._random_pages: torch.Tensor | None = None
        self._stagings: dict[str, PinnedStaging] = {}
        self._copy_stream: torch.cuda.Stream | None = None
        self._eager_keys: set[tuple[int, int]] = set()
        # Last: the pinned registrations and the worker thread, so that nothing above (a GPU
        # allocation running out of memory) can leave a thread or pinned memory behind.
        # Pinned host staging for the batched block hand-offs (draft and commit KV -> CPU pool):
        # [L', 2, slots, Hkv, B, D] elements.
        self._handoff = PinnedStaging(
            len(pooled) * 2 * max_batch_size * hkv * b * d, cpu_pool.dtype, self.cuda
        )
        # The retrieval stream serves the representative query only (MAGE and InfiniGen select
        # on the main stream), and only then needs its pinned staging.
        self.worker: RetrievalWorker | None = None
        if offload.selection_queries == "representative":
            try:
                self.worker = RetrievalWorker(
                    model,
                    self.num_dense,
                    self.dense_k,
                    self.dense_v,
                    cpu_pool,
                    self.pool,
                    config.mask_token_id,
                    b,
                    output_mode=offload.output_mode,
                    num_threads=self.selection_threads,
                    delay=retrieval_delay,
                    kv_pad=kv_pad,
                )
            except BaseException:
                self._handoff.close()
                raise

    # -- sizes ----------------------------------------------------------------------------------
    def budget_for(self, prefix: int) -> int:
        """Selected rows per KV head for a block whose committed prefix is ``prefix`` tokens:
        ``min(ceil(kv_budget x prefix), prefix - last block)``."""
        last = self.block_size if prefix >= self.block_size else 0
        return min(math.ceil(self.offload.kv_budget * prefix), prefix - last)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """CPU pool pages a request holds while it runs: its canvas (prompt + max_new_tokens,
        rounded up to whole blocks of B tokens) plus one draft / scratch page."""
        layout = BlockLayout(prompt_len, self.block_size, max_new_tokens)
        return layout.total_len // self.block_size + 1

    def _pages_needed(self, req: Request) -> int:
        return self.pages_needed(req.prompt_len, req.params.max_new_tokens)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a prompt. Raises ValueError at once if it can never fit (length, CPU pool)."""
        req = new_request(
            list(prompt_ids), params, self.block_size, self.max_seq_len, self.config.vocab_size
        )
        need = self._pages_needed(req)
        total = self.cpu_pool.num_free_pages + self.cpu_pool.num_used_pages
        if need > total:
            raise ValueError(
                f"request needs {need} CPU KV pages ({need * self.block_size} tokens) but the "
                f"CPU pool holds {total} in all; enlarge it (--cpu-kv-gb or --cpu-kv-tokens)"
            )
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or len(self.batch) > 0 or self._prefilling is not None

    def abort(self, request: Request) -> None:
        """Cancel ``request``. A waiting one leaves the queue now. A running one is marked
        ``FINISHED_ABORTED``; blocks run in lockstep, so it keeps its row (its tokens are
        discarded) until the block boundary, where it leaves and its CPU pages are freed. It is
        never returned by :meth:`step`. A finished request is left as it is."""
        abort_request(request, self.waiting)

    def close(self) -> None:
        """Stop the retrieval thread, release every request's pages and the pinned memory."""
        if self.worker is not None:
            self.worker.close()
        prefilling = [self._prefilling.req] if self._prefilling is not None else []
        for req in self.batch.requests + prefilling:
            if req.request_id in self.cpu_pool:
                self.cpu_pool.free(req.request_id)
        self._prefilling = None
        self._sync()
        self._handoff.close()
        for staging in self._stagings.values():
            staging.close()
        self._stagings.clear()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # -- admission: prefill + the first block's exact selection ---------------------------------
    @torch.inference_mode()
    def _admit(self) -> None:
        """At a block boundary: prefill waiting requests (pages allocated first), within
        ``max_prefill_tokens``; a prompt whose prefill is not done continues at the next one."""
        budget = self.max_prefill_tokens
        while True:
            st = self._prefilling
            if st is not None and st.req.status.finished:  # aborted while prefilling
                self.cpu_pool.free(st.req.request_id)
                self._prefilling = st = None
            if st is None:
                if not (
                    self.waiting
                    and len(self.batch) < self.max_batch_size
                    and self.cpu_pool.can_allocate(self._pages_needed(self.waiting[0]))
                ):
                    return
                req = self.waiting.popleft()
                self.cpu_pool.allocate(req.request_id, self._pages_needed(req))
                st = self._prefilling = _Prefill(req)
            req = st.req
            n = req.layout.num_prefill_tokens
            end = n if budget is None or self.random_prefill else min(n, st.pos + budget)
            t0 = time.perf_counter()
            try:
                if end > st.pos and not self.random_prefill:
                    self._prefill_chunk(st, end)
                if budget is not None:
                    budget -= end - st.pos
                st.pos = end
                done = st.pos >= n
                if done:
                    k, last = self._prefill(st, len(self.batch))
                self._sync()
            except BaseException:
                # The request is dropped (the caller fails it); its pages come back.
                self._prefilling = None
                self.cpu_pool.free(req.request_id)
                raise
            self.stats.prefill_seconds += time.perf_counter() - t0
            if not done:
                return  # budget spent; the rest at the next block boundary
            self._prefilling = None
            self.k_sel.append(k)
            self.last_len.append(last)
            self.batch.add(req)
            if budget is not None and budget <= 0:
                return

    def _prefill_chunk(self, st: _Prefill, end: int) -> None:
        """Prompt tokens ``[st.pos, end)`` forward into the request's temporary full store."""
        b, cfg = self.block_size, self.config
        s = st.req.layout.num_prefill_tokens
        if st.tk is None:
            shape = (1, cfg.num_kv_heads, s + b, cfg.head_dim)
            dev, dt, nl = self.device, self.dtype, cfg.num_layers
            st.tk = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(nl)]
            st.tv = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(nl)]
            st.temp = SlotAttention(list(st.tk), list(st.tv))
        assert st.temp is not None
        ids = torch.tensor(st.req.prompt_ids[st.pos : end], dtype=torch.long, device=self.device)
        for c in range(st.pos, end, self.prefill_chunk):
            e = min(end, c + self.prefill_chunk)
            st.temp.prepare([c], e - c, block_size=b)
            pos = torch.arange(c, e, device=self.device)[None]
            self.model(ids[None, c - st.pos : e - st.pos], pos, st.temp)
        self.stats.num_prefill_tokens += end - st.pos

    def _prefill(self, st: _Prefill, slot: int) -> tuple[int, int]:
        """The prefilled prompt's KV to the dense store (slot ``slot``) and the CPU pool; the
        first block's selection with its B queries, exact, on the GPU. Returns (k, last)."""
        req = st.req
        if self.random_prefill:
            return self._random_prefill(req, slot)
        b, cfg = self.block_size, self.config
        s = req.layout.num_prefill_tokens
        if s == 0:
            return 0, 0
        assert st.tk is not None and st.tv is not None and st.temp is not None
        tk, tv, temp = st.tk, st.tv, st.temp
        pages = self.cpu_pool.pages(req.request_id)
        nblk = s // b
        for layer in range(cfg.num_layers):
            if layer < self.num_dense:
                self.dense_k[layer][slot, :, :s] = tk[layer][0, :, :s]  # type: ignore[index]
                self.dense_v[layer][slot, :, :s] = tv[layer][0, :, :s]  # type: ignore[index]
            elif nblk:
                pl = layer - self.num_dense
                idx = torch.tensor(pages[:nblk], dtype=torch.long)
                for src, dst in ((tk, self.cpu_pool.k_pages(pl)), (tv, self.cpu_pool.v_pages(pl))):
                    rows = src[layer][0, :, :s].to("cpu", dst.dtype)
                    dst.index_copy_(0, idx, rows.view(-1, nblk, b, cfg.head_dim).transpose(0, 1))
        for layer, chans in self.proxy_chans.items():
            keys = tk[layer][0, :, :s]  # [Hkv, s, D]
            idx = chans[:, None, :].expand(-1, s, -1)
            self.partial_k[layer][slot, :, :s] = keys.gather(2, idx)
        last = b if s >= b else 0
        k = self.budget_for(s)
        # The first block's B queries, exact over the full prompt KV (DESIGN §2 "Prefill").
        recorder = _QueryRecorder(temp)
        start = req.layout.first_block_start
        toks, _ = self.batch.fresh_block(req)
        temp.prepare([start], b)
        pos = torch.arange(start, start + b, device=self.device)[None]
        self.model(toks[None], pos, recorder)
        buf = self.pool.active
        for layer in self.pool.layers:
            keys, vals = tk[layer][0], tv[layer][0]
            idx = select_topk_rows(recorder.q[layer][0], keys, s + b, last + b, k)
            gi = idx[..., None].expand(-1, -1, cfg.head_dim)
            self.pool.k(buf, layer)[slot, :, :k] = keys.gather(1, gi)
            self.pool.v(buf, layer)[slot, :, :k] = vals.gather(1, gi)
            self.pool.k(buf, layer)[slot, :, k : k + last] = keys[:, s - last : s]
            self.pool.v(buf, layer)[slot, :, k : k + last] = vals[:, s - last : s]
        return k, last

    def _random_prefill(self, req: Request, slot: int) -> tuple[int, int]:
        """Random KV in place of the prompt forward and the first selection (benchmarks)."""
        b, s = self.block_size, req.layout.num_prefill_tokens
        self.stats.num_prefill_tokens += s
        for t in self.dense_k[: self.num_dense] + self.dense_v[: self.num_dense]:
            assert t is not None
            t[slot, :, :s].normal_()
        nblk = s // b
        if nblk and self.random_prefill != "gpu":
            pages = torch.tensor(self.cpu_pool.pages(req.request_id)[:nblk], dtype=torch.long)
            hkv, d = self.config.num_kv_heads, self.config.head_dim
            if self._random_pages is None or self._random_pages.shape[0] < nblk:
                g = torch.Generator().manual_seed(0)
                self._random_pages = torch.randn(nblk, hkv, b, d, generator=g).to(
                    self.cpu_pool.dtype
                )
            store = self.cpu_pool.storage  # [L', 2, pages, Hkv, B, D]
            for pl in range(store.shape[0]):
                for kv in range(2):
                    store[pl, kv].index_copy_(0, pages, self._random_pages[:nblk])
        for t in self.partial_k.values():
            t[slot, :, :s].normal_()
        if s == 0:
            return 0, 0
        last = b if s >= b else 0
        k = self.budget_for(s)
        self.pool.all_k(self.pool.active)[:, slot, :, : k + last].normal_()
        self.pool.all_v(self.pool.active)[:, slot, :, : k + last].normal_()
        return k, last

    # -- batched block hand-offs ----------------------------------------------------------------
    def _pool_blocks(self, buffer: int, offsets: list[int]) -> torch.Tensor:
        """Rows ``[offsets[i], offsets[i] + B)`` of slots ``0..n-1`` of every pooled layer of
        ``buffer``, K and V, as one new device tensor ``[L', 2, n, Hkv, B, D]``."""
        b, n = self.block_size, len(offsets)
        ks, vs = self.pool.all_k(buffer), self.pool.all_v(buffer)
        if all(o == offsets[0] for o in offsets):
            o = offsets[0]
            return torch.stack([ks[:, :n, :, o : o + b], vs[:, :n, :, o : o + b]], dim=1)
        return torch.stack(
            [
                torch.stack([t[:, i, :, o : o + b] for i, o in enumerate(offsets)], dim=1)
                for t in (ks, vs)
            ],
            dim=1,
        )

    def _blocks_to_cpu(self, blocks: torch.Tensor, pages: list[int]) -> None:
        """Write ``blocks`` ``[L', 2, n, Hkv, B, D]`` (device) into CPU pool page ``pages[i]``
        of every offloaded layer, for each row i. Synchronous: on return the pages hold the
        values (one device-to-host copy, then one host scatter)."""
        idx = torch.tensor(pages, dtype=torch.long)
        store = self.cpu_pool.storage
        if not self.cuda:
            store.index_copy_(2, idx, blocks.to(store.dtype))
            return
        host = self._handoff.take(blocks.shape)
        host.copy_(blocks, non_blocking=True)
        # NOTE: copy-before-read: the host scatter below reads the staging only after the
        # device-to-host copy completed; and since this call returns only then, the staging is
        # free for the next hand-off and every page written here is complete for any reader
        # (the selection kernel, the gathers, MAGE's host reads).
        torch.cuda.current_stream(self.device).synchronize()
        store.index_copy_(2, idx, host)

    # -- one step -------------------------------------------------------------------------------
    def _prepare(self, length: int = 0, draft_group: bool = False) -> None:
        b = self.block_size
        starts = self.batch.starts()
        if self.dense_attn is not None:
            self.dense_attn.prepare(starts, length or b, draft_group=draft_group)
        prefix = [k + last for k, last in zip(self.k_sel, self.last_len, strict=True)]
        self.sparse_attn.prepare(prefix, length or b, draft_group=draft_group)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one forward of the running batch (a denoising step, the fused draft step or the
        commit forward) and return the requests that finished."""
        if not len(self.batch):
            self._admit()
            if not len(self.batch):
                return []
            self._phase, self._block_step = "denoise", 0
        t0 = time.perf_counter()
        if self._block_step == 0 and self._phase == "denoise":
            self._block_t0 = t0
        finished = self._commit() if self._phase == "commit" else self._denoise_step()
        self.stats.num_forwards += 1
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.num_generated_tokens += sum(len(r.output_ids) for r in finished)
        return finished

    def _denoise_step(self) -> list[Request]:
        b, s = self.block_size, self._block_step
        input_ids, positions = self.batch.inputs()
        mage = self.offload.selection_queries == "block"
        # "proxy" (InfiniGen) selects at step 0 like MAGE, from the partial-key cache.
        lookahead = self.offload.lookahead == "draft"
        if s == 0 and mage:
            self._prepare()
            hidden = self.model(input_ids, positions, _MageAttention(self))
        elif s == 0 and self.offload.selection_queries == "proxy":
            self._prepare()
            hidden = self.model(input_ids, positions, _ProxyAttention(self))
        elif s == 1 and lookahead:
            self._prepare(2 * b, draft_group=True)
            ids = torch.cat([input_ids, self._draft], dim=1)
            hidden = self._forward(ids, torch.cat([positions, positions], dim=1))
            # The draft group's KV sits in the active pool right after the block's rows; later
            # steps of this block never write those rows, so it can be read after apply().
            draft_kv = self._pool_blocks(
                self.pool.active,
                [k + last + b for k, last in zip(self.k_sel, self.last_len, strict=True)],
            )
        else:
            self._prepare()
            hidden = self._forward(input_ids, positions)
        want_draft = s == 0 and lookahead
        finished_rows, _, draft = self.batch.apply(
            self.model, hidden, advance_clean=False, want_draft=want_draft
        )
        if draft is not None:
            self._draft = draft
        if s == 1 and lookahead and not all(map(self._last_block, self.batch.requests)):
            self._start_retrieval(draft_kv)
        self._block_step += 1
        if not bool(self.batch.masked.any()):
            self._phase = "commit"
        return [self.batch.requests[i] for i in finished_rows]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A forward through :attr:`attn` (prepared by the caller), from CUDA graphs if enabled."""
        if not self.use_cuda_graph:
            return self.model(input_ids, positions, self.attn)
        key = (input_ids.shape[0], input_ids.shape[1])
        runner = self._graphs.get(key)
        if runner is None:
            if key not in self._eager_keys:
                # NOTE: one eager forward per new shape before capture (cuBLAS / cuDNN handles,
                # torch.compile kernels); it is this step's real forward.
                self._eager_keys.add(key)
                return self.model(input_ids, positions, self.attn)
            runner = self._graphs[key] = PiecewiseGraphForward(self.model, *key)
        return runner.forward(input_ids, positions, self.attn)

    def _last_block(self, req: Request) -> bool:
        """True when ``req`` ends with the current block by length (then no request of a batch
        made only of such needs the next block's selection)."""
        added = self.block_size - max(0, req.prompt_len - req.block_start)  # this block's tokens
        return req.reaches_length(added)

    def _start_retrieval(self, draft_kv: torch.Tensor | None) -> RetrievalJob:
        """Hand the next block's selection to the retrieval stream (lookahead: its thread; off:
        run now). ``draft_kv`` (``[L', 2, n, Hkv, B, D]``, device): the draft group's KV, copied
        to each request's scratch page first; None: the tail is the block just committed."""
        b = self.block_size
        reqs = self.batch.requests
        starts = self.batch.starts()
        draft = draft_kv is not None
        if draft_kv is not None:
            scratch = [self.cpu_pool.pages(r.request_id)[-1] for r in reqs]
            self._blocks_to_cpu(draft_kv, scratch)
        tables = []
        for req, st in zip(reqs, starts, strict=True):
            pages = self.cpu_pool.pages(req.request_id)
            tail = pages[-1] if draft else pages[st // b]
            tables.append(pages[: st // b] + [tail])
        page_table = _page_table(tables)
        ready = None
        if self.cuda:
            # NOTE: the event covers the main stream's work so far: the dense layers' KV of the
            # draft (or of the committed block) that the retrieval stream reads on the GPU. The
            # CPU pages were written synchronously (_blocks_to_cpu).
            ready = torch.cuda.Event()
            ready.record()
        job = RetrievalJob(
            request_ids=[r.request_id for r in reqs],
            prefix_lens=starts,
            dense_tail_start=[st + b if draft else st for st in starts],
            budgets=[self.budget_for(st + b) for st in starts],
            query_positions=[st + b + b // 2 for st in starts],
            page_table=page_table,
            buffer=self.pool.idle,
            ready=ready,
            record=self.record_selection,
        )
        if self.record_selection:
            self.selections.append(job)
        assert self.worker is not None  # representative-query modes only
        self._job = self.worker.submit(job) if draft else self.worker.run_now(job)
        return job

    def _commit(self) -> list[Request]:
        b = self.block_size
        input_ids, positions = self.batch.inputs()
        self._prepare()
        self._forward(input_ids, positions)  # the clean block's KV lands in its rows
        reqs, starts = self.batch.requests, self.batch.starts()
        active = self.pool.active
        # The clean block's KV of every row and pooled layer, in one device tensor. Rows that
        # finished (or were aborted) are written too: their pages are freed right after.
        blocks = self._pool_blocks(
            active, [k + last for k, last in zip(self.k_sel, self.last_len, strict=True)]
        )
        pages = [
            self.cpu_pool.pages(r.request_id)[st // b] for r, st in zip(reqs, starts, strict=True)
        ]
        self._blocks_to_cpu(blocks, pages)
        for layer, chans in self.proxy_chans.items():
            blk = blocks[self.pool.layers.index(layer), 0]  # [n, Hkv, B, D]
            part = blk.gather(3, chans[None, :, None, :].expand(len(reqs), -1, b, -1))
            for i, st in enumerate(starts):
                self.partial_k[layer][i, :, st : st + b] = part[i]
        main_t = time.perf_counter() - self._block_t0
        stall, retrieval = 0.0, 0.0
        rstart: float | None = None
        rend: float | None = None
        rsubmit: float | None = None
        rlayers: dict[str, float] = {}
        k_next = [self.budget_for(st + b) for st in starts]
        finishing = all(r.status.finished for r in reqs)
        if self.offload.selection_queries == "representative" and (
            self._job is not None or not finishing
        ):
            sync = self._job is None
            if sync:  # lookahead off (or no step 1 ran): select now, after commit
                self._start_retrieval(None)
            assert self._job is not None
            stream = torch.cuda.current_stream(self.device) if self.cuda else None
            stall = self._job.wait(stream)
            if sync:  # the whole synchronous selection is the boundary's wait
                stall = time.perf_counter() - self._block_t0 - main_t
            job = self._job
            retrieval = job.seconds
            rstart, rend = job.t_start - self._block_t0, job.t_end - self._block_t0
            rsubmit = job.t_submit - self._block_t0
            if job.layer_seconds:
                lay = torch.tensor(job.layer_seconds).sum(0).tolist()
                rlayers = {"query_to_host": lay[0], "kernel": lay[1], "gather_copy": lay[2]}
            self._job = None
        # The completed block becomes the next pool's last block: -> idle rows [k', k' + B).
        idle = self.pool.idle
        for kv, dst in enumerate((self.pool.all_k(idle), self.pool.all_v(idle))):
            if all(x == k_next[0] for x in k_next):
                dst[:, : len(reqs), :, k_next[0] : k_next[0] + b] = blocks[:, kv]
            else:
                for i, kn in enumerate(k_next):
                    dst[:, i, :, kn : kn + b] = blocks[:, kv, i]
        self.pool.swap()
        self.sparse_attn.set_store(*self.pool.store(self.pool.active))
        self.k_sel, self.last_len = k_next, [b] * len(reqs)
        self.stats.blocks.append(
            BlockTiming(
                main_t,
                retrieval,
                stall,
                len(reqs),
                rstart,
                rend,
                self._block_step + 1,
                rsubmit,
                rlayers,
            )
        )
        # Finished requests leave; the rest move to their next block.
        done = [i for i, r in enumerate(reqs) if r.status.finished]
        self.batch.advance([i for i in range(len(reqs)) if i not in done])
        for i in done:
            self.cpu_pool.free(reqs[i].request_id)
        for src_row, dst_row in self.batch.remove(done):
            self._move_slot(src_row, dst_row)
        for i in sorted(done, reverse=True):
            last = len(self.k_sel) - 1
            self.k_sel[i], self.last_len[i] = self.k_sel[last], self.last_len[last]
            self.k_sel.pop()
            self.last_len.pop()
        self._phase, self._block_step = "denoise", 0
        self._admit()
        return []

    def _move_slot(self, src: int, dst: int) -> None:
        for t in self.dense_k[: self.num_dense] + self.dense_v[: self.num_dense]:
            assert t is not None
            t[dst].copy_(t[src])
        self.pool.move_slot(src, dst)
        for t in self.partial_k.values():
            t[dst].copy_(t[src])

    # -- MAGE step 0 ----------------------------------------------------------------------------
    def _staging(self, name: str, numel: int) -> PinnedStaging:
        """The pinned staging buffer ``name`` (created on first use, grown if too small)."""
        st = self._stagings.get(name)
        if st is None or st.numel < numel:
            if st is not None:
                st.close()
            st = self._stagings[name] = PinnedStaging(numel, self.cpu_pool.dtype, self.cuda)
        return st

    def _fetch_full(self, layer: int, i: int, start: int) -> tuple[torch.Tensor, Any]:
        """Start copying request i's committed K/V pages of ``layer`` to the device.

        Returns ``(pages, ready)``: ``pages`` ``[2, ceil(start / B), Hkv, B, D]`` in the pool's
        dtype and ``ready`` a CUDA event to wait on before reading it (None on CPU). On CUDA the
        copies are DMAs straight from the pinned pool, one per run of consecutive pages
        (:meth:`CpuKVPool.copy_pages`), queued on a copy stream so that they overlap the
        attention of earlier requests. NOTE: an earlier version gathered the rows on the CPU
        into pinned staging first: that bound MAGE's per-block full fetch to 4-9 GB/s instead of
        PCIe speed, a handicap the baseline must not have."""
        pl = layer - self.num_dense
        n = -(-start // self.block_size)
        ids = self.cpu_pool.pages(self.batch.requests[i].request_id)[:n]
        pool = self.cpu_pool
        shape = (2, n, pool.num_kv_heads, pool.page_size, pool.head_dim)
        # made (and ordered after the main stream) by the caller on CUDA
        on_copy_stream = torch.cuda.stream(self._copy_stream) if self.cuda else nullcontext()
        with on_copy_stream:
            pages = torch.empty(shape, dtype=pool.dtype, device=self.device)
            for kv in (0, 1):
                pool.copy_pages(pl, kv, ids, pages[kv])
            if not self.cuda:
                return pages, None
            ready = torch.cuda.Event()
            ready.record()
        # NOTE: allocated on the copy stream, read and freed on the main stream.
        pages.record_stream(torch.cuda.current_stream(self.device))
        return pages, ready

    def _full_rows(
        self, fetched: tuple[torch.Tensor, Any], start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[Hkv, start, D]`` (model dtype, device) of :meth:`_fetch_full`."""
        pages, ready = fetched
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        two, n, hkv, b, d = pages.shape
        rows = pages.transpose(1, 2).reshape(two, hkv, n * b, d)[:, :, :start].to(self.dtype)
        return rows[0], rows[1]

    def _proxy_fetch(self, layer: int, q: torch.Tensor) -> None:
        """InfiniGen step 0 for one layer: proxy top-k per row, rows fetched into the pool."""
        b, buf = self.block_size, self.pool.active
        reqs, starts = self.batch.requests, self.batch.starts()
        chans = self.proxy_chans[layer]
        ranked = [st - last for st, last in zip(starts, self.last_len, strict=True)]
        picked = [max(0, min(kk, r)) for kk, r in zip(self.k_sel, ranked, strict=True)]
        hkv = self.cpu_pool.num_kv_heads
        # The picks of every request land in one device tensor and come to the host in one copy
        # per layer (NOTE: one copy per request was one host-device sync per request and layer).
        shape = (len(reqs), hkv, max([1, *picked]))
        idx = torch.full(shape, -1, dtype=torch.int32, device=q.device)
        tables = []
        for i, req in enumerate(reqs):
            part = self.partial_k[layer][i, :, : ranked[i]]
            idx[i, :, : picked[i]] = proxy_topk(q[i], part, chans, self.k_sel[i])
            tables.append(self.cpu_pool.pages(req.request_id)[: max(1, -(-ranked[i] // b))])
        idx = idx.cpu()
        table = _page_table(tables)
        if self.cuda:
            # NOTE: copy-before-read: the commit's hand-off is synchronous, but any other
            # device-to-host copy into the pool still in flight must land before host reads.
            torch.cuda.current_stream(self.device).synchronize()
        num = torch.tensor(picked, dtype=torch.int32)
        self._gather_and_write(buf, layer, table, idx, num)

    def _gather_and_write(
        self,
        buf: int,
        layer: int,
        table: torch.Tensor,
        indices: torch.Tensor,
        num_selected: torch.Tensor,
    ) -> None:
        """Gather the selected rows of ``layer`` into pinned staging and write them into the pool
        rows ``[0, k_r)`` of every request: in up to GATHER_CHUNKS groups of requests, each
        group's asynchronous host-to-device copy overlapping the next group's gather."""
        pl = layer - self.num_dense
        kp, vp = self.cpu_pool.k_pages(pl), self.cpu_pool.v_pages(pl)
        n, hkv, kmax = indices.shape
        per_req = 2 * hkv * kmax * kp.shape[3]
        staging = self._staging("selected", n * per_req)
        # NOTE: take() waits until the previous layer's copies from this staging completed
        flat = staging.take((n * per_req,))
        step = max(1, -(-n // GATHER_CHUNKS))
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            host = flat[c0 * per_req : c1 * per_req].view(2, c1 - c0, hkv, kmax, kp.shape[3])
            gather_selected(
                kp,
                vp,
                table[c0:c1],
                indices[c0:c1],
                num_selected[c0:c1],
                out=host,
                num_threads=self.selection_threads,
            )
            gathered = host.to(self.device, self.dtype, non_blocking=True)
            self._write_selected(buf, layer, gathered, first=c0)
        staging.copied()

    def _write_selected(self, buf: int, layer: int, gathered: torch.Tensor, first: int = 0) -> None:
        """Gathered rows ``[2, m, Hkv, k_max, D]`` of requests ``first .. first + m - 1`` -> their
        pool rows ``[0, k_r)``.

        NOTE: exactly k_r rows each: rows past a request's k in ``gathered`` are uninitialised,
        and the pool rows after k_r hold the last completed block."""
        gk, gv = gathered[0], gathered[1]
        for j in range(gathered.shape[1]):
            i, kk = first + j, self.k_sel[first + j]
            self.pool.k(buf, layer)[i, :, :kk] = gk[j, :, :kk]
            self.pool.v(buf, layer)[i, :, :kk] = gv[j, :, :kk]

    def _mage_layer_gpu(self, layer: int, q, k, v) -> torch.Tensor:
        """Fetch the full KV over PCIe, exact attention + top-k on the GPU."""
        if self.cuda:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            # NOTE: copy-after-write on the device: the page copies queue behind everything on
            # the main stream so far, device-to-host writes into the pool included (host writes
            # into it are synchronous).
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        b, buf = self.block_size, self.pool.active
        outs = []
        starts = self.batch.starts()
        fetched: dict[int, tuple[torch.Tensor, Any]] = {}
        try:
            for i, st in enumerate(starts):
                # Copies run up to MAGE_FETCH_AHEAD requests ahead of the attention that reads them.
                for j in range(i, min(len(starts), i + MAGE_FETCH_AHEAD)):
                    if j not in fetched:
                        fetched[j] = self._fetch_full(layer, j, starts[j])
                kr, vr = self._full_rows(fetched.pop(i), st)
                # [Hkv, padded(st + B), D]: the key length rounded up to a multiple of kv_pad (zero
                # rows, masked) in the same copy, so the exact attention rounds like the dense
                # engine's step over the same keys
                n = st + b
                pad = kr.new_zeros(kr.shape[0], padded_kv_len(n, self.kv_pad) - n, kr.shape[2])
                keys = torch.cat([kr, k[i].transpose(0, 1), pad], dim=1)
                vals = torch.cat([vr, v[i].transpose(0, 1), pad], dim=1)
                if self.kv_pad:  # masked even when n is a multiple, as SlotAttention always is
                    outs.append(
                        attend_prefix_and_tail(
                            q[i : i + 1], keys[None], vals[None], [n], [n], 0, self.kv_pad
                        )
                    )
                else:
                    outs.append(_sdpa_folded(q[i : i + 1], keys[None], vals[None], None))
                kk = self.k_sel[i]
                idx = select_topk_rows(q[i], keys, n, self.last_len[i] + b, kk)
                gi = idx[..., None].expand(-1, -1, keys.shape[-1])
                self.pool.k(buf, layer)[i, :, :kk] = keys.gather(1, gi)
                self.pool.v(buf, layer)[i, :, :kk] = vals.gather(1, gi)
        finally:
            # NOTE: copies still in flight after an error must not go unseen: the main stream
            # waits for them, so its next synchronization (before any host write into the
            # pool) covers them.
            for _, ready in fetched.values():
                if ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(ready)
        return torch.cat(outs)

    def _mage_layer_cpu(self, layer: int, q, k, v) -> torch.Tensor:
        """Exact attention + top-k with the CPU kernel (B queries, n_q = B)."""
        b, buf, pl = self.block_size, self.pool.active, layer - self.num_dense
        reqs, starts = self.batch.requests, self.batch.starts()
        tables = []
        for i, req in enumerate(reqs):
            pages = self.cpu_pool.pages(req.request_id)
            # The current block's K/V go to the scratch page: attended, never selected.
            self.cpu_pool.write_block(
                pl, req.request_id, len(pages) - 1, k[i].transpose(0, 1), v[i].transpose(0, 1)
            )
            tables.append(pages[: starts[i] // b] + [pages[-1]])
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()  # NOTE: copies before reads
        table = _page_table(tables)
        seq = torch.tensor([st + b for st in starts], dtype=torch.int32)
        tails = torch.tensor([last + b for last in self.last_len], dtype=torch.int32)
        budgets = torch.tensor([max(kk, 1) for kk in self.k_sel], dtype=torch.int32)
        kp, vp = self.cpu_pool.k_pages(pl), self.cpu_pool.v_pages(pl)
        res = select_topk(
            q.to("cpu", torch.bfloat16),
            kp,
            vp,
            table,
            seq,
            budgets,
            tail_lens=tails,
            output_mode=self.offload.output_mode,
            num_threads=self.selection_threads,
        )
        self._gather_and_write(buf, layer, table, res.indices, res.num_selected)
        if self.offload.output_mode == "selected":
            # Attention over the selected rows (+ last and current block) is what "selected"
            # means; computed on the model device from the pool just filled, in the model's own
            # arithmetic (at budget 1.0 it is exactly the dense step).
            return self.attn.forward(layer, q, k, v)
        # "full": the kernel's exact attention (float32 from bf16), which rounds differently
        # from the device's SDPA, so budget 1.0 matches dense only up to near-ties.
        return res.attn_output.to(self.device, self.dtype)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Request]:
        """Decode every prompt to completion; returns the requests in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        self._sync()
        return reqs


def _page_table(tables: list[list[int]]) -> torch.Tensor:
    """Rows of page ids -> [n, max_len] int32, short rows padded with their last page (the
    kernel reads only the first ceil(S / B) entries of a row)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)


class _QueryRecorder:
    """Attention backend wrapper that keeps each layer's queries."""

    def __init__(self, inner: SlotAttention) -> None:
        self.inner = inner
        self.q: dict[int, torch.Tensor] = {}

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.q[layer_id] = q
        return self.inner.forward(layer_id, q, k, v)


def _selection_threads(requested: int | None) -> int:
    """The CPU kernel's threads: ``requested``; else ``HERALD_SELECTION_THREADS``; else every
    usable core but two, which stay free for the main stream's host work (kernel launches) and
    the retrieval thread's own Python (see :attr:`OffloadConfig.selection_threads`)."""
    if requested is not None:
        return requested
    if os.environ.get("HERALD_SELECTION_THREADS"):
        return default_num_threads()
    return max(1, default_num_threads() - 2)
