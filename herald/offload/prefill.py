"""Prefill in the offloading engine: the prompt forward, its KV to the stores, the first selection.

A prompt is prefilled on the GPU, in chunks over one or more block boundaries, into a temporary
store holding every layer's full KV ``[1, Hkv, S + B, D]`` (:class:`PromptPrefill`). When its last
chunk has run and it joins the batch (slot ``slot``):

- the first ``num_dense_layers`` layers' KV goes to the dense store's slot;
- every other layer's KV goes to the request's CPU pages (the selection reads it there later);
- the policy takes what it keeps of the prompt (InfiniGen: the proxy channels of the keys);
- the first block's selection runs exactly, with its B [MASK] queries, on the GPU while the
  prompt KV is still there (HERALD §IV-B2), filling the active pool's selected rows and the last
  prompt block's rows; then the temporary store is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from herald.attention.base import QueryRecorder
from herald.attention.slots import SlotAttention
from herald.engine.request import Request
from herald.engine.scheduler import PrefillChunk
from herald.kv.pinned import host_wait
from herald.offload.selection.compact_cpu import update_compact
from herald.offload.selection.cpu import scatter_blocks
from herald.offload.selection.gpu_topk import select_topk_rows

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine

_STAGING_BYTES = 256 * 1024**2
"""Pinned staging for a prompt's KV on its way to the CPU pool (a few layers per copy)."""


class PromptPrefill:
    """The request being prefilled and its temporary full-KV store (one at a time)."""

    def __init__(self, core: OffloadEngine) -> None:
        self.core = core
        self.request: Request | None = None
        self.tk: list[torch.Tensor] = []
        self.tv: list[torch.Tensor] = []
        self.temp: SlotAttention | None = None

    def drop(self) -> None:
        """Free the temporary store (the request joined, was aborted, or failed)."""
        self.request, self.tk, self.tv, self.temp = None, [], [], None

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
        for c in range(chunk.start, chunk.end, core.prefill_chunk):
            e = min(chunk.end, c + core.prefill_chunk)
            self.temp.prepare([c], e - c, block_size=b)
            pos = torch.arange(c, e, device=core.device)[None]
            core.model(ids[None, c - chunk.start : e - chunk.start], pos, self.temp)

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
        self._to_stores(req, slot, s)
        self.core.policy.on_prompt_keys(slot, {i: t[0, :, :s] for i, t in enumerate(self.tk)})
        return self._first_selection(req, slot, s)

    def _to_stores(self, req: Request, slot: int, s: int) -> None:
        core = self.core
        b, nd = core.block_size, core.num_dense
        for layer in range(nd):
            core.dense_k[layer][slot, :, :s] = self.tk[layer][0, :, :s]  # type: ignore[index]
            core.dense_v[layer][slot, :, :s] = self.tv[layer][0, :, :s]  # type: ignore[index]
        nblk = s // b
        if not nblk:
            return
        pages = core.kv.pages(req.request_id)[:nblk]
        idx = torch.tensor(pages, dtype=torch.long)
        store = core.cpu_pool.storage  # [L', 2, pages, Hkv, B, D]
        hkv, d = store.shape[3], store.shape[5]
        # A few offloaded layers at a time: their K and V in the pages' layout on the device,
        # one copy into pinned staging, one scatter on the selection kernel's threads (a
        # pageable copy and an OpenMP index_copy_ per layer and tensor took ~0.1-0.3 s for a
        # 16K-token prompt, the bulk of a join).
        layer_bytes = 2 * nblk * hkv * b * d * store.element_size()
        group = max(1, min(store.shape[0], _STAGING_BYTES // layer_bytes))
        for l0 in range(0, store.shape[0], group):
            l1 = min(store.shape[0], l0 + group)
            n = nblk * b
            kv = [torch.stack([self.tk[nd + pl][0, :, :n], self.tv[nd + pl][0, :, :n]])
                  for pl in range(l0, l1)]  # fmt: skip
            rows = torch.stack(kv)  # [g, 2, Hkv, nblk * B, D]
            rows = rows.view(l1 - l0, 2, hkv, nblk, b, d).transpose(2, 3).to(store.dtype)
            if core.cuda:
                numel = max(rows.numel(), _STAGING_BYTES // store.element_size())
                host = core.staging("prompt_kv", numel).take(rows.shape)
                host.copy_(rows, non_blocking=True)
                # NOTE: copy-before-read: the scatter reads the staging after the copy is done.
                host_wait(torch.cuda.current_stream(core.device))
            else:
                host = rows.contiguous()
            scatter_blocks(store[l0:l1], 2, idx, host, num_threads=core.selection_threads)
        # The prompt's K is in the pages (host copies): its int8 copy, if kept.
        update_compact(core.cpu_pool, pages, core.selection_threads)

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
        core.model(toks[None], pos, recorder)
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
