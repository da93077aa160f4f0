"""MAGE-Offload: exact selection with the block's own B queries at its first denoising step.

**When**: during step 0 of every block, no lookahead (the queries are the block's own).
**Queries**: all B positions of the block. **Where**: ``selection_device="gpu"`` fetches each
offloaded layer's full committed KV over PCIe every block and runs exact attention + top-k on the
GPU; ``"cpu"`` runs the CPU kernel with the B queries over the CPU pool (compute-bound there, the
cost HERALD's representative query removes). **Fetch**: the top-k rows into the active pool, used
by step 0 itself and reused for the rest of the block.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from herald.attention.base import AttentionBackend
from herald.attention.prefix_tail import attend_prefix_and_tail
from herald.attention.sdpa import padded_kv_len, sdpa_folded
from herald.kv.pinned import copy_to_host
from herald.offload.policies.base import SelectionPolicy
from herald.offload.selection.cpu import select_topk
from herald.offload.selection.gpu_topk import select_topk_rows

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine

FETCH_AHEAD = 4
"""Requests whose full-KV copies GPU selection keeps in flight ahead of the attention reading
them (device memory: this many requests' K/V of one layer)."""


class MagePolicy(SelectionPolicy):
    """Block queries at step 0, exact, on the GPU or the CPU (see the module docstring)."""

    def __init__(self, core: OffloadEngine) -> None:
        super().__init__(core)
        assert core.offload is not None
        self.on_gpu = core.offload.selection_device == "gpu"
        self.output_mode = core.offload.output_mode
        self._copy_stream: torch.cuda.Stream | None = None

    def step0_attention(self) -> AttentionBackend:
        return _Step0(self)

    # -- GPU selection --------------------------------------------------------------------------
    def _fetch_full(self, layer: int, i: int, start: int) -> tuple[torch.Tensor, Any]:
        """Start copying request i's committed K/V pages of ``layer`` to the device.

        Returns ``(pages, ready)``: ``pages`` ``[2, ceil(start / B), Hkv, B, D]`` in the pool's
        dtype and ``ready`` a CUDA event to wait on before reading it (None on CPU). On CUDA the
        copies are DMAs straight from the pinned pool, one per run of consecutive pages
        (:meth:`CpuKVPool.copy_pages`), queued on a copy stream so that they overlap the
        attention of earlier requests. NOTE: gathering the rows on the CPU into pinned staging
        first would bind the per-block full fetch to 4-9 GB/s instead of PCIe speed, a handicap
        the baseline must not have."""
        core = self.core
        pool = core.cpu_pool
        n = -(-start // core.block_size)
        ids = core.kv.pages(core.batch.requests[i].request_id)[:n]
        shape = (2, n, pool.num_kv_heads, pool.page_size, pool.head_dim)
        # made (and ordered after the main stream) by the caller on CUDA
        on_copy_stream = torch.cuda.stream(self._copy_stream) if core.cuda else nullcontext()
        with on_copy_stream:
            pages = torch.empty(shape, dtype=pool.dtype, device=core.device)
            for kv in (0, 1):
                pool.copy_pages(layer - core.num_dense, kv, ids, pages[kv])
            if not core.cuda:
                return pages, None
            ready = torch.cuda.Event()
            ready.record()
        # NOTE: allocated on the copy stream, read and freed on the main stream.
        pages.record_stream(torch.cuda.current_stream(core.device))
        return pages, ready

    def _full_rows(
        self, fetched: tuple[torch.Tensor, Any], start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[Hkv, start, D]`` (model dtype, device) of :meth:`_fetch_full`."""
        pages, ready = fetched
        if ready is not None:
            torch.cuda.current_stream(self.core.device).wait_event(ready)
        two, n, hkv, b, d = pages.shape
        rows = pages.transpose(1, 2).reshape(two, hkv, n * b, d)[:, :, :start]
        rows = rows.to(self.core.dtype)
        return rows[0], rows[1]

    def layer_gpu(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Fetch the full KV over PCIe, exact attention + top-k on the GPU."""
        core = self.core
        if core.cuda:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(core.device)
            # NOTE: copy-after-write on the device: the page copies queue behind everything on
            # the main stream so far, device-to-host writes into the pool included (host writes
            # into it are synchronous).
            self._copy_stream.wait_stream(torch.cuda.current_stream(core.device))
        outs = []
        starts = core.batch.starts()
        fetched: dict[int, tuple[torch.Tensor, Any]] = {}
        try:
            for i, st in enumerate(starts):
                # Copies run up to FETCH_AHEAD requests ahead of the attention that reads them.
                for j in range(i, min(len(starts), i + FETCH_AHEAD)):
                    if j not in fetched:
                        fetched[j] = self._fetch_full(layer, j, starts[j])
                kr, vr = self._full_rows(fetched.pop(i), st)
                outs.append(self._attend_and_select(layer, i, st, q, k, v, kr, vr))
        finally:
            # NOTE: copies still in flight after an error must not go unseen: the main stream
            # waits for them, so its next synchronization (before any host write into the
            # pool) covers them.
            for _, ready in fetched.values():
                if ready is not None:
                    torch.cuda.current_stream(core.device).wait_event(ready)
        return torch.cat(outs)

    def _attend_and_select(
        self, layer: int, i: int, st: int, q, k, v, kr: torch.Tensor, vr: torch.Tensor
    ) -> torch.Tensor:
        """Row i: exact attention over its full KV + its block, and its top-k into the pool."""
        core = self.core
        b, buf = core.block_size, core.pool.active
        # [Hkv, padded(st + B), D]: the key length rounded up to a multiple of kv_pad (zero
        # rows, masked) in the same copy, so the exact attention rounds like the dense engine's
        # step over the same keys
        n = st + b
        pad = kr.new_zeros(kr.shape[0], padded_kv_len(n, core.kv_pad) - n, kr.shape[2])
        keys = torch.cat([kr, k[i].transpose(0, 1), pad], dim=1)
        vals = torch.cat([vr, v[i].transpose(0, 1), pad], dim=1)
        if core.kv_pad:  # masked even when n is a multiple, as the slot backend always is
            out = attend_prefix_and_tail(
                q[i : i + 1], keys[None], vals[None], [n], [n], 0, core.kv_pad
            )
        else:
            out = sdpa_folded(q[i : i + 1], keys[None], vals[None], None)
        kk = core.k_sel[i]
        idx = select_topk_rows(q[i], keys, n, core.last_len[i] + b, kk)
        gi = idx[..., None].expand(-1, -1, keys.shape[-1])
        core.pool.k(buf, layer)[i, :, :kk] = keys.gather(1, gi)
        core.pool.v(buf, layer)[i, :, :kk] = vals.gather(1, gi)
        return out

    # -- CPU selection --------------------------------------------------------------------------
    def layer_cpu(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Exact attention + top-k with the CPU kernel (B queries, n_q = B)."""
        core = self.core
        b, buf, pl = core.block_size, core.pool.active, layer - core.num_dense
        reqs, starts = core.batch.requests, core.batch.starts()
        for i, req in enumerate(reqs):
            pages = core.kv.pages(req.request_id)
            # The current block's K/V go to the scratch page: attended, never selected.
            core.cpu_pool.write_block(
                pl, req.request_id, len(pages) - 1, k[i].transpose(0, 1), v[i].transpose(0, 1)
            )
        # NOTE: copies before reads: on CUDA the query's copy to the host waits for the page
        # copies above too (same stream), asleep (copy_to_host), not spinning.
        q_host = copy_to_host(q.to(torch.bfloat16)) if core.cuda else q.to(torch.bfloat16)
        table = core.page_tables()
        seq = torch.tensor([st + b for st in starts], dtype=torch.int32)
        tails = torch.tensor([last + b for last in core.last_len], dtype=torch.int32)
        budgets = torch.tensor([max(kk, 1) for kk in core.k_sel], dtype=torch.int32)
        res = select_topk(
            q_host,
            core.cpu_pool.k_pages(pl),
            core.cpu_pool.v_pages(pl),
            table,
            seq,
            budgets,
            tail_lens=tails,
            output_mode=self.output_mode,
            num_threads=core.selection_threads,
        )
        core.gather_and_write(buf, layer, table, res.indices, res.num_selected)
        if self.output_mode == "selected":
            # Attention over the selected rows (+ last and current block) is what "selected"
            # means; computed on the model device from the pool just filled, in the model's own
            # arithmetic (at budget 1.0 it is exactly the dense step).
            return core.attn.forward(layer, q, k, v)
        # "full": the kernel's exact attention (float32 from bf16), which rounds differently
        # from the device's SDPA, so budget 1.0 matches dense only up to near-ties.
        return res.attn_output.to(core.device, core.dtype)


class _Step0:
    """Step 0 of a block: the dense layers as usual; every offloaded layer attends exactly over
    its full KV with the B block queries, selecting the top-k rows into the active pool."""

    def __init__(self, policy: MagePolicy) -> None:
        self.policy = policy

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        core = self.policy.core
        if layer_id < core.num_dense:
            return core.attn.forward(layer_id, q, k, v)
        if self.policy.on_gpu:
            return self.policy.layer_gpu(layer_id, q, k, v)
        return self.policy.layer_cpu(layer_id, q, k, v)
