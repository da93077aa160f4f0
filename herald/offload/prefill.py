"""Prefill in the offloading engine: the prompt forward, its KV to the stores, the first selection.

A prompt is prefilled on the GPU, in chunks over one or more block boundaries, into a temporary
store holding every layer's full KV ``[1, Hkv, S + B, D]`` (:class:`PromptPrefill`). The
offloaded layers' KV of each prompt block goes to the request's CPU pages (the selection reads it
there later) as soon as a chunk's forward has completed the block: on CUDA, copied on a side
stream and written into the pages by the CPU while the next chunk's forward runs. When its last
chunk has run and it joins the batch (slot ``slot``):

- the first ``num_dense_layers`` layers' KV goes to the dense store's slot;
- the last chunk's blocks reach the CPU pages (their copy overlapping the first selection);
- the policy takes what it keeps of the prompt (InfiniGen: the proxy channels of the keys);
- the first block's selection runs exactly, with its B [MASK] queries, on the GPU while the
  prompt KV is still there (HERALD §IV-B2), filling the active pool's selected rows and the last
  prompt block's rows; then the temporary store is dropped.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple

import torch

from herald.attention.base import QueryRecorder
from herald.attention.slots import SlotAttention
from herald.engine.request import Request
from herald.engine.scheduler import PrefillChunk
from herald.offload.selection.compact_cpu import update_compact
from herald.offload.selection.cpu import scatter_blocks
from herald.offload.selection.gpu_topk import select_topk_rows

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine

_STAGING_BYTES = 256 * 1024**2
"""Pinned staging for a prompt's KV on its way to the CPU pool: at least this, or one prefill
forward's blocks of every offloaded layer if more, up to :data:`_STAGING_MAX_BYTES`."""
_STAGING_MAX_BYTES = 1024**3


class _PendingCopy(NamedTuple):
    """Prompt blocks on their way to the CPU pool pages ``pages``: ``host`` ``[L', 2, n, Hkv, B,
    D]`` in the pool's dtype (on CUDA pinned staging, complete once ``event`` fired; on the CPU
    the rows themselves, ``event`` None); ``rows`` the device tensor the copy reads, held until
    then."""

    host: torch.Tensor
    pages: torch.Tensor
    event: torch.cuda.Event | None
    rows: torch.Tensor


class PromptPrefill:
    """The request being prefilled and its temporary full-KV store (one at a time)."""

    def __init__(self, core: OffloadEngine) -> None:
        self.core = core
        self.request: Request | None = None
        self.tk: list[torch.Tensor] = []
        self.tv: list[torch.Tensor] = []
        self.temp: SlotAttention | None = None
        self.offloaded = 0  # prompt blocks whose KV went to the CPU pool (or is on its way)
        self._pending: _PendingCopy | None = None
        self._stream: torch.cuda.Stream | None = None

    def drop(self) -> None:
        """Free the temporary store (the request joined, was aborted, or failed)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.event is not None:
            pending.event.synchronize()  # NOTE: the copy in flight reads the store freed here
        self.request, self.tk, self.tv, self.temp = None, [], [], None
        self.offloaded = 0

    def run_chunk(self, chunk: PrefillChunk) -> None:
        """Prompt tokens ``[chunk.start, chunk.end)`` forward into the temporary store."""
        core, req = self.core, chunk.request
        if core.hooks.synthetic_prefill is not None or chunk.end == chunk.start:
            return  # synthetic: random KV at join time, no forward
        b, cfg = core.block_size, core.config
        if self.request is not req:
            self.drop()
            shape = (1, cfg.num_kv_heads, req.layout.num_prefill_tokens + b, cfg.head_dim)
            dev, dt = core.device, core.dtype
            self.tk = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_layers)]
            self.tv = [torch.zeros(shape, device=dev, dtype=dt) for _ in range(cfg.num_layers)]
            self.temp = SlotAttention(list(self.tk), list(self.tv))
            self.request = req
        assert self.temp is not None
        ids = torch.tensor(req.prompt_ids[chunk.start : chunk.end], dtype=torch.long)
        ids = ids.to(core.device)
        s = req.layout.num_prefill_tokens
        for c in range(chunk.start, chunk.end, core.prefill_chunk):
            e = min(chunk.end, c + core.prefill_chunk)
            self.temp.prepare([c], e - c, block_size=b)
            pos = torch.arange(c, e, device=core.device)[None]
            core.model(ids[None, c - chunk.start : e - chunk.start], pos, self.temp)
            # The blocks this forward completed go to the CPU pool while the next one runs.
            self._offload(req, min(e, s) // b)

    def finish(self, req: Request, slot: int) -> tuple[int, int]:
        """The prefilled prompt's KV to the stores and the first block's selection (see the
        module docstring). Returns ``(k, last)``: selected rows and last-block rows in the
        active pool."""
        if self.core.hooks.synthetic_prefill is not None:
            return self._synthetic(req, slot)
        s = req.layout.num_prefill_tokens
        if s == 0:
            return 0, 0
        assert self.temp is not None and self.request is req
        core = self.core
        for layer in range(core.num_dense):
            core.dense_k[layer][slot, :, :s] = self.tk[layer][0, :, :s]  # type: ignore[index]
            core.dense_v[layer][slot, :, :s] = self.tv[layer][0, :, :s]  # type: ignore[index]
        self._offload(req, s // core.block_size)  # normally sent by the last chunk already
        core.policy.on_prompt_keys(slot, {i: t[0, :, :s] for i, t in enumerate(self.tk)})
        selected = self._first_selection(req, slot, s)
        self._flush()  # the last copy ran beside the first selection's forward
        return selected

    # -- the prompt's KV to the CPU pool --------------------------------------------------------
    def _offload(self, req: Request, upto: int) -> None:
        """Prompt blocks ``[offloaded, upto)`` of the offloaded layers to the request's CPU
        pages: in the pages' layout on the device, one copy into pinned staging, one scatter
        on the selection kernel's threads. On CUDA the copy goes on a side stream and is left
        in flight: the scatter runs at the next call (after the next chunk's forward was
        queued, so the CPU writes the pages while the GPU computes) or at :meth:`_flush`."""
        core, b = self.core, self.core.block_size
        store = core.cpu_pool.storage  # [L', 2, pages, Hkv, B, D]
        per_block = store[:, :, 0].numel() * store.element_size()
        chunk_blocks = max(1, core.prefill_chunk // b)
        cap = min(_STAGING_MAX_BYTES, max(_STAGING_BYTES, per_block * chunk_blocks))
        most = max(1, cap // per_block)
        while self.offloaded < upto:
            self._flush()
            first, self.offloaded = self.offloaded, min(upto, self.offloaded + most)
            self._send(req, first, self.offloaded, cap)
        if not core.cuda:
            self._flush()

    def _send(self, req: Request, first: int, end: int, cap: int) -> None:
        core, b, nd = self.core, self.core.block_size, self.core.num_dense
        store = core.cpu_pool.storage
        hkv, d, n = store.shape[3], store.shape[5], end - first
        pages = torch.tensor(core.kv.pages(req.request_id)[first:end], dtype=torch.long)
        cur = torch.cuda.current_stream(core.device) if core.cuda else None
        if cur is not None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(core.device)
            # NOTE: write-before-copy: the side stream waits for the forward that wrote them
            self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream) if cur is not None else nullcontext():
            r0, r1 = first * b, end * b
            rows = torch.stack([torch.stack([self.tk[nd + pl][0, :, r0:r1],
                                             self.tv[nd + pl][0, :, r0:r1]])
                                for pl in range(store.shape[0])])  # fmt: skip
            # [L', 2, Hkv, n * B, D] -> the pages' layout [L', 2, n, Hkv, B, D]
            rows = rows.view(-1, 2, hkv, n, b, d).transpose(2, 3).to(store.dtype)
            if cur is None:
                self._pending = _PendingCopy(rows.contiguous(), pages, None, rows)
                return
            staging = core.staging("prompt_kv", cap // store.element_size())
            host = staging.take(rows.shape)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # sleep while waiting (host_wait)
            event.record(self._stream)
        # NOTE: ``rows`` (allocated on the side stream) is kept until the copy completed.
        self._pending = _PendingCopy(host, pages, event, rows)

    def _flush(self) -> None:
        """Complete the copy in flight: wait for it, scatter the staging into the pages and
        refresh their int8 copy (if the pool keeps one)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        core = self.core
        if pending.event is not None:
            pending.event.synchronize()  # NOTE: copy-before-read of the staging
        scatter_blocks(core.cpu_pool.storage, 2, pending.pages, pending.host,
                       num_threads=core.selection_threads)  # fmt: skip
        update_compact(core.cpu_pool, pending.pages, core.selection_threads)

    def _first_selection(self, req: Request, slot: int, s: int) -> tuple[int, int]:
        """The first block's B queries, exact over the full prompt KV, on the model device."""
        core = self.core
        b, d = core.block_size, core.config.head_dim
        assert self.temp is not None
        last = b if s >= b else 0
        k = core.budget_for(s)
        recorder = QueryRecorder(self.temp)
        start = req.layout.first_block_start
        toks, _ = core.batch.fresh_block(req)
        self.temp.prepare([start], b)
        pos = torch.arange(start, start + b, device=core.device)[None]
        # Through the runner: a one-request B-token forward like a decode forward of batch size
        # 1, replayed from its piecewise CUDA graphs where the engine uses them (eager, this
        # forward was most of the 43-57 ms a join added to an H100's prefill of LLaDA2.0-mini).
        # ``recorder.q`` then holds the graphs' static query buffers: read below, before any
        # other forward of this shape.
        core.runner.forward(toks[None], pos, recorder)
        buf = core.pool.active
        for layer in core.pool.layers:
            keys, vals = self.tk[layer][0], self.tv[layer][0]
            idx = select_topk_rows(recorder.q[layer][0], keys, s + b, last + b, k)
            gi = idx[..., None].expand(-1, -1, d)
            core.pool.k(buf, layer)[slot, :, :k] = keys.gather(1, gi)
            core.pool.v(buf, layer)[slot, :, :k] = vals.gather(1, gi)
            core.pool.k(buf, layer)[slot, :, k : k + last] = keys[:, s - last : s]
            core.pool.v(buf, layer)[slot, :, k : k + last] = vals[:, s - last : s]
        return k, last

    def _synthetic(self, req: Request, slot: int) -> tuple[int, int]:
        """Random KV in place of the prompt forward and the first selection (benchmarks)."""
        core = self.core
        hook = core.hooks.synthetic_prefill
        assert hook is not None
        b, s = core.block_size, req.layout.num_prefill_tokens
        hook.fill_rows(core.dense.tensors(), slot, 0, s)
        nblk = s // b
        if nblk and hook.cpu_pages:
            pages = torch.tensor(core.kv.pages(req.request_id)[:nblk], dtype=torch.long)
            shape = (core.config.num_kv_heads, b, core.config.head_dim)
            values = hook.page_values(nblk, shape, core.cpu_pool.dtype)
            store = core.cpu_pool.storage  # [L', 2, pages, Hkv, B, D]
            for pl in range(store.shape[0]):
                for kv in range(2):
                    store[pl, kv].index_copy_(0, pages, values)
            update_compact(core.cpu_pool, pages, core.selection_threads)
        core.policy.on_synthetic_prefill(slot, s)
        if s == 0:
            return 0, 0
        last = b if s >= b else 0
        k = core.budget_for(s)
        core.pool.all_k(core.pool.active)[:, slot, :, : k + last].normal_()
        core.pool.all_v(core.pool.active)[:, slot, :, : k + last].normal_()
        return k, last
