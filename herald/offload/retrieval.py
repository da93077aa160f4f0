"""The retrieval stream: block n+1's selection phase, run while block n denoises (HERALD §IV-B3).

A :class:`RetrievalWorker` owns one thread and, on CUDA, one CUDA stream. For each
:class:`RetrievalJob` it runs a single-token forward of the representative [MASK] query at the
centre of the next block through every layer:

- dense layers (the first ``num_dense_layers``): exact attention on the GPU over the dense store's
  prefix rows plus the tail block (the draft, or the completed block when lookahead is off); -
  offloaded layers: the query goes to the CPU, :func:`~herald.offload.selection.cpu.select_topk`
  runs exact attention over the CPU pool (prefix pages + tail page, the tail attended but never
  ranked) and returns the output and the top-k rows, the selected K/V rows gathered into pinned
  staging by the same call; one async copy per layer, on a copy stream of the worker's, fills the
  idle sparse pool while the next layer's projections and selection go on. With the GPU fetch
  (``HERALD_FETCH``, by default on CUDA where Triton is present) the kernel only selects: the
  positions go to the GPU and a GPU kernel on the copy stream reads the rows from the page-locked
  pool itself (:mod:`herald.offload.gpu_fetch`).

Fences (each has a NOTE where it is enforced):
- the job starts only after ``ready`` (the main stream's draft/commit KV copies are complete), on
  both of its streams;
- the staging buffer of a layer is reused only after its previous host-to-device copy completed;
- the main stream reads the idle pool only after waiting on ``cuda_done``
  (:meth:`RetrievalJob.wait`);
- with the GPU fetch, the host also waits for ``cuda_done`` before a job counts as done: the
  engine may free and rewrite CPU pages once the job is done, and the fetch reads them
  asynchronously.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time

import torch

from herald.attention.prefix_tail import attend_prefix_and_tail
from herald.engine.hooks import FaultInjection
from herald.env import settings
from herald.kv.cpu_pool import CpuKVPool
from herald.kv.pinned import PinnedStaging
from herald.kv.sparse_pool import GpuSparseKVPool
from herald.layers.fusion import run_eagerly_in_this_thread
from herald.layers.moe_triton import triton_enabled
from herald.models.base import BlockDiffusionLM, DecoderLayer
from herald.offload.gpu_fetch import fetch_rows, gpu_fetch_available
from herald.offload.retrieval_device import device_scored_layer
from herald.offload.retrieval_job import RetrievalJob
from herald.offload.selection.compact_cpu import compact_args, select_topk_compact
from herald.offload.selection.compact_device import DeviceCompactKeys
from herald.offload.selection.cpu import select_topk


class RetrievalWorker:
    """Runs :class:`RetrievalJob` s on a background thread (and its own CUDA stream)."""

    def __init__(
        self,
        model: BlockDiffusionLM,
        num_dense_layers: int,
        dense_k: list[torch.Tensor | None],
        dense_v: list[torch.Tensor | None],
        cpu_pool: CpuKVPool,
        pool: GpuSparseKVPool,
        mask_token_id: int,
        block_size: int,
        *,
        output_mode: str = "full",
        num_threads: int | None = None,
        faults: FaultInjection | None = None,
        kv_pad: int = 0,
        groups: int | None = None,
        device_keys: DeviceCompactKeys | None = None,
    ) -> None:
        self.model = model
        self.layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        self.num_dense = num_dense_layers
        self.dense_k, self.dense_v = dense_k, dense_v
        self.cpu_pool, self.pool = cpu_pool, pool
        self.mask_token_id, self.block_size = mask_token_id, block_size
        self.output_mode, self.num_threads = output_mode, num_threads
        self.faults = faults
        # first_pass="int8-gpu": the offloaded layers select on the device from these
        # (herald.offload.retrieval_device) instead of the CPU kernel.
        self.device_keys = device_keys
        self.kv_pad = kv_pad  # dense layers' key length padding (SlotAttention's kv_pad)
        if groups is not None and (
            isinstance(groups, bool) or not isinstance(groups, int) or groups < 1
        ):
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        self.groups = groups if groups is not None else settings().retrieval_groups
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda = self.device.type == "cuda"
        # High priority: the main stream keeps the GPU busy with a denoising forward; without
        # priority every small kernel of the single-query forward queues behind it, and the
        # retrieval stream's latency (its critical path is sequential over layers) grows ~2x.
        self.stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # The selected rows' host-to-device copies into the idle pool run on a stream of their
        # own: on the retrieval stream they would sit in front of the layer's o_proj + FFN and
        # the next layer's projections, so the next layer's query (and with it the CPU kernel)
        # would wait for every copy of this layer's rows; here they overlap the next layer.
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # The GPU reads the selected rows from the pool (HERALD_FETCH, herald.env): CUDA only.
        fetch = settings().fetch
        if fetch == "gpu" and self.cuda and not gpu_fetch_available(self.device):
            raise RuntimeError("HERALD_FETCH=gpu needs Triton; install it or unset HERALD_FETCH")
        self.gpu_fetch = self.cuda and (fetch == "gpu" or (fetch == "auto" and triton_enabled()))
        # One pinned staging buffer per offloaded layer: [2, slots, Hkv, k_cap, D] elements, or
        # with the GPU fetch the selected positions only, [slots, Hkv, k_cap] int32.
        hkv, d = cpu_pool.num_kv_heads, cpu_pool.head_dim
        numel = pool.num_slots * hkv * pool.capacity
        dtype = torch.int32 if self.gpu_fetch else cpu_pool.dtype
        if not self.gpu_fetch:
            numel *= 2 * d
        self._staging = [PinnedStaging(numel, dtype, self.cuda) for _ in pool.layers]
        self._q_host: torch.Tensor | None = None  # pinned, for the query (sized at first use)
        self._queue: queue.Queue[RetrievalJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="herald-retrieval", daemon=True)
        self._thread.start()

    def staging_buffers(self) -> list[PinnedStaging]:
        """The pinned staging buffers this worker owns, one per offloaded layer."""
        return list(self._staging)

    def submit(self, job: RetrievalJob) -> RetrievalJob:
        job.t_submit = time.perf_counter()
        self._queue.put(job)
        return job

    def run_now(self, job: RetrievalJob) -> RetrievalJob:
        """Run ``job`` on the calling thread (lookahead off: the caller waits anyway)."""
        job.t_submit = time.perf_counter()
        self._run(job)
        return job

    def close(self) -> None:
        """Stop the thread; unregister the pinned staging (after all its copies completed)."""
        self._queue.put(None)
        self._thread.join(timeout=60)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for staging in self._staging:
            staging.close()

    def _loop(self) -> None:
        run_eagerly_in_this_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def _run(self, job: RetrievalJob) -> None:
        t0 = job.t_start = time.perf_counter()
        try:
            if self.cuda:
                assert self.stream is not None
                with torch.cuda.stream(self.stream), torch.inference_mode():
                    if job.ready is not None:
                        # NOTE: copy-before-read: the draft / committed KV copies of the main
                        # stream complete before this stream reads the dense store, and the
                        # host reads of the CPU pool below wait for the same event (a blocking
                        # one: the host sleeps, HeraldPolicy._start makes it).
                        self.stream.wait_event(job.ready)
                        job.ready.synchronize()
                    # NOTE: the copy stream writes the idle pool only after ``ready`` too (the
                    # main stream's last reads of that buffer), and cuda_done covers its copies.
                    assert self.copy_stream is not None
                    self.copy_stream.wait_stream(self.stream)
                    self._select(job)
                    self.stream.wait_stream(self.copy_stream)
                    job.cuda_done = torch.cuda.Event(blocking=True)
                    job.cuda_done.record(self.stream)
                    if self.gpu_fetch:  # NOTE: pages are read until here (module docstring)
                        job.cuda_done.synchronize()
            else:
                with torch.inference_mode():
                    self._select(job)
        except BaseException as e:  # surfaced to the main thread by RetrievalJob.wait
            job.error = e
        job.t_end = time.perf_counter()
        job.seconds = job.t_end - t0
        job.done.set()

    def _group_ranges(self, n: int) -> list[tuple[int, int]]:
        """The job's rows ``[0, n)`` as contiguous request groups ``[a, e)`` of near-equal
        size (see ``OffloadConfig.retrieval_groups``)."""
        g = self.groups if self.groups is not None else 1
        g = max(1, min(g, n))
        bounds = [n * i // g for i in range(g + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(g)]

    def _select(self, job: RetrievalJob) -> None:
        """The representative query's forward through every layer, in request groups.

        NOTE: the pipeline: right after a group's layer output is queued on the stream, the
        next layer's query projection and its copy to the host are queued behind it, then the
        host turns to the next group's selection. So while the CPU kernel selects for one group,
        the GPU computes the others' layer outputs and next queries, and the kernel's threads
        do not wait for the GPU between layers (with one group they do, ~5 ms per layer at
        LLaDA2.0-mini 32K bs 80, results/offload/gpu_fetch/). A row's inputs are the same in any
        group: its selection too. One group is the default until the split is measured on the
        GPU (``OffloadConfig.retrieval_groups``).
        """
        n, b = len(job.request_ids), self.block_size
        self._inject_delay()
        ranges = self._group_ranges(n)
        ids = torch.full((n, 1), self.mask_token_id, dtype=torch.long, device=self.device)
        pos = torch.tensor(job.query_positions, dtype=torch.long, device=self.device)[:, None]
        seq = torch.tensor([p + b for p in job.prefix_lens], dtype=torch.int32)
        tails = torch.full((n,), b, dtype=torch.int32)
        budgets = torch.tensor([max(x, 1) for x in job.budgets], dtype=torch.int32)
        hidden = [self.model.embed(ids[a:e]) for a, e in ranges]
        # per group: the current layer's query (device) and, for an offloaded layer, its host
        # copy in flight (pinned view, event) or None (on the CPU)
        queries: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.cuda.Event] | None]] = [
            self._query(0, self.layers[0], hidden[g], pos[a:e], a)
            for g, (a, e) in enumerate(ranges)
        ]
        last = len(self.layers) - 1
        for layer_id, layer in enumerate(self.layers):
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []
            for g, (a, e) in enumerate(ranges):
                q, pending = queries[g]
                if layer_id < self.num_dense:
                    kc, vc = self.dense_k[layer_id], self.dense_v[layer_id]
                    assert kc is not None and vc is not None
                    o = attend_prefix_and_tail(
                        q, kc[a:e], vc[a:e], job.prefix_lens[a:e], job.dense_tail_start[a:e], b,
                        self.kv_pad,
                    )  # fmt: skip
                else:
                    o = self._offloaded_layer(
                        job, layer_id, q, pending, (a, e), seq[a:e], tails[a:e], budgets[a:e],
                        g == len(ranges) - 1, parts,
                    )  # fmt: skip
                hidden[g] = layer.finish(hidden[g], o)
                if layer_id < last:
                    queries[g] = self._query(
                        layer_id + 1, self.layers[layer_id + 1], hidden[g], pos[a:e], a
                    )
            if job.record and parts:
                job.recorded[layer_id] = _merge_records(parts)
            self._inject_delay()

    def _inject_delay(self) -> None:
        if self.faults is not None and self.faults.max_delay > 0:
            time.sleep(self.faults.delay())

    def _query(
        self, layer_id: int, layer: DecoderLayer, hidden: torch.Tensor, pos: torch.Tensor, row0: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.cuda.Event] | None]:
        """A group's query at ``layer_id`` queued on this stream and, for an offloaded layer on
        CUDA, its copy to the host queued behind it (waited for by :meth:`_query_to_host`)."""
        q, _, _ = layer.qkv(hidden, pos)
        if layer_id < self.num_dense or not self.cuda or self.device_keys is not None:
            return q, None
        return q, self._start_query_copy(q, row0)

    def _start_query_copy(
        self, q: torch.Tensor, row0: int
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        """``q`` ``[n, 1, H, D]`` copied (bf16) into rows ``row0..`` of the pinned query buffer
        on this stream; returns the host view and a blocking event recorded after the copy.

        NOTE: into pinned memory, then a blocking wait (:meth:`_query_to_host`): a plain
        ``q.to("cpu")`` is a copy to pageable memory that spins a core until this stream (behind
        the layer's projections, at a low share of a GPU busy with a denoising forward) gets
        there, a core the kernel's threads need. Each group copies into its own rows of the
        buffer; a group's next copy is queued only after its kernel call returned."""
        per_row = q[0].numel()
        if self._q_host is None:  # (small: from PyTorch's pinned allocator)
            self._q_host = torch.empty(
                self.pool.num_slots * per_row, dtype=torch.bfloat16, pin_memory=True
            )
        host = self._q_host[row0 * per_row : row0 * per_row + q.numel()].view(q.shape)
        host.copy_(q.to(torch.bfloat16), non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record()
        return host, event

    def _query_to_host(
        self, q: torch.Tensor, pending: tuple[torch.Tensor, torch.cuda.Event] | None
    ) -> torch.Tensor:
        """The layer's query ``[n, 1, H, D]`` bf16 on the host, once this stream computed and
        copied it (asleep until then, see :meth:`_start_query_copy`)."""
        if pending is None:
            return q.to(torch.bfloat16)
        host, event = pending
        event.synchronize()
        return host

    def _offloaded_layer(
        self,
        job: RetrievalJob,
        layer_id: int,
        q: torch.Tensor,
        pending: tuple[torch.Tensor, torch.cuda.Event] | None,
        rows: tuple[int, int],
        seq: torch.Tensor,
        tails: torch.Tensor,
        budgets: torch.Tensor,
        last_group: bool,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """One offloaded layer for the group of job rows ``rows = [a, e)``: the CPU kernel's
        selection and attention output, and the selected rows on their way into the idle pool.
        ``last_group``: the layer's staging is marked copied after this group's copies (one
        event for all the groups' copies: they run in order on the copy stream)."""
        if self.device_keys is not None:
            return device_scored_layer(self, job, layer_id, q, rows, last_group, parts)
        a, e = rows
        n = e - a
        pl = layer_id - self.num_dense
        kp, vp = self.cpu_pool.k_pages(pl), self.cpu_pool.v_pages(pl)
        hkv, d = kp.shape[1], kp.shape[3]
        kmax = max(1, int(torch.minimum(budgets, seq - tails).max()))  # select_topk's k_max
        staging = self._staging[self.pool.layers.index(layer_id)]
        out = None
        if not self.gpu_fetch:
            # NOTE: no staging reuse before its copy is done: take() waits (asleep) until the
            # previous block's H2D from this layer's buffer completed before the kernel writes it
            # (the first group; the later ones find the wait done). Each group writes its own
            # region: its rows times the pool's capacity.
            shape = (2, n, hkv, kmax, d)
            out = staging.take(shape, offset=a * 2 * hkv * self.pool.capacity * d)
            if self.faults is not None and self.faults.poison_staging:
                out.fill_(float("nan"))
        t0 = time.perf_counter()
        q_cpu = self._query_to_host(q, pending)
        t1 = time.perf_counter()
        # The kernel gathers the selected K/V rows into the staging itself (gather_out), each
        # (request, KV head) as soon as its top-k is known: no separate gather pass.
        # first_pass="int8" (the pool keeps an int8 copy of K): the compact pass, same indices.
        compact = compact_args(self.cpu_pool, pl)
        res = (select_topk_compact if compact else select_topk)(
            q_cpu,
            kp,
            vp,
            job.page_table[a:e],
            seq,
            budgets,
            tail_lens=tails,
            output_mode=self.output_mode,
            num_threads=self.num_threads,
            gather_out=out,
            **compact,
        )
        t2 = time.perf_counter()
        sel = res.num_selected.tolist()
        if len(job.num_selected) < e:  # the first offloaded layer (every layer selects as many)
            job.num_selected.extend(sel)
        if job.record:
            parts.append((q_cpu.clone(), res.indices.clone()))
        # float32 to the device, then cast there: a cast on the host would run on PyTorch's
        # OpenMP threads, which spin on for a while after it, into the next kernel call.
        o = res.attn_output.to(self.device, non_blocking=True).to(self.dtype)
        if out is None:
            self._fetch_to_pool(job, layer_id, res.indices, sel, a, last_group)
        else:
            self._copy_to_pool(job, layer_id, out, sel, a, last_group)
        job.layer_seconds.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return o.view(n, 1, -1, d)

    def _fetch_meta(
        self, job: RetrievalJob, sel: list[int], a: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The page table and selected counts of the job's group at row ``a`` on the device,
        for the GPU fetch: copied once per job and group (every layer selects the same counts)
        on the copy stream.

        NOTE: the host tensors are pinned and kept on the job until the job is dropped, so the
        asynchronous copies never read freed memory."""
        meta = job.fetch_meta.get(a)
        if meta is None or meta[0] != sel:
            table = job.page_table[a : a + len(sel)].to(torch.int32).pin_memory()
            counts = torch.tensor(sel, dtype=torch.int32).pin_memory()
            dev_table = table.to(self.device, non_blocking=True)
            dev_counts = counts.to(self.device, non_blocking=True)
            meta = job.fetch_meta[a] = (list(sel), table, counts, dev_table, dev_counts)
        return meta[3], meta[4]

    def _fetch_to_pool(
        self,
        job: RetrievalJob,
        layer_id: int,
        indices: torch.Tensor,
        sel: list[int],
        a: int,
        last_group: bool,
    ) -> None:
        """The GPU fetch of one layer for the group at job row ``a`` (``HERALD_FETCH=gpu``):
        the selected positions to the device through this layer's pinned staging, then
        :func:`fetch_rows` reads the rows from the CPU pool into rows ``[0, k_r)`` of the
        group's slots of the idle pool (zeros in ``[k_r, max k)``), all on the copy stream,
        then (last group) the staging's reuse event.

        NOTE: with several groups, a group's rows from its own largest k up to the job's keep
        an earlier block's values (one group zeroes only up to its own k). They are finite (the
        pool starts zeroed and only ever receives K/V rows or zeros) and the sparse attention
        masks every row at or past a request's k, so they weigh exactly 0. The staging event
        covers every group's copies because they all run in order on the one copy stream."""
        m = max(sel)
        pl = layer_id - self.num_dense
        staging = self._staging[self.pool.layers.index(layer_id)]
        if m > 0:
            # NOTE: take() waits until the previous copy out of this layer's staging completed
            # (the first group; each group has its own region).
            host = staging.take(
                tuple(indices.shape), offset=a * indices.shape[1] * self.pool.capacity
            )
            # a plain memcpy: a torch copy would run on PyTorch's OpenMP threads, which spin on
            # after it into the next kernel call (see _offloaded_layer)
            ctypes.memmove(host.data_ptr(), indices.contiguous().data_ptr(), 4 * indices.numel())
        with torch.cuda.stream(self.copy_stream):
            if m > 0:
                table, counts = self._fetch_meta(job, sel, a)
                dev = host.to(self.device, non_blocking=True)
                n = len(sel)
                fetch_rows(
                    self.cpu_pool.k_pages(pl), self.cpu_pool.v_pages(pl), table, dev, counts,
                    self.pool.k(job.buffer, layer_id)[a : a + n],
                    self.pool.v(job.buffer, layer_id)[a : a + n], m,
                )  # fmt: skip
            if last_group:
                staging.copied()  # recorded on the copy stream, after every group's copies

    def _pad_mask(self, job: RetrievalJob, sel: list[int], a: int) -> torch.Tensor:
        """``[n, 1, max(sel), 1]`` bool on the device, true at rows ``>= sel[i]`` of the group's
        request ``i``: built once per job and group (every layer selects the same counts) on the
        copy stream.

        NOTE: the host tensor is pinned and kept on the job until the job is dropped, so the
        asynchronous copy never reads freed memory."""
        mask = job.pad_mask.get(a)
        if mask is None or mask[0] != sel:
            m = max(sel)
            host = torch.arange(m)[None, :] >= torch.tensor(sel)[:, None]
            if self.cuda:
                host = host.pin_memory()
            dev = host.to(self.device, non_blocking=True).view(len(sel), 1, m, 1)
            mask = job.pad_mask[a] = (list(sel), host, dev)
        return mask[2]

    def _copy_to_pool(
        self,
        job: RetrievalJob,
        layer_id: int,
        out: torch.Tensor,
        sel: list[int],
        a: int,
        last_group: bool,
    ) -> None:
        """Staging ``out`` -> rows ``[0, k_r)`` of the group's slots (from job row ``a``) of the
        idle pool at ``layer_id``, on the copy stream (CUDA), then (last group) the staging's
        reuse event on that stream.

        NOTE: rows past a request's k_r (num_selected) in the staging buffer are stale or
        uninitialised: left in the pool they would be garbage (possibly NaN bit patterns) in
        rows that attention masks but still multiplies by zero (0 * NaN = NaN). They are copied
        with the rest (one copy for the group) and zeroed on the device in the same stream."""
        n, m = len(sel), max(sel)
        kd = self.pool.k(job.buffer, layer_id)[a : a + n]
        vd = self.pool.v(job.buffer, layer_id)[a : a + n]
        staging = self._staging[self.pool.layers.index(layer_id)]
        with torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext():
            # One copy per tensor of rows [0, m) of every request, m the largest k: a copy per
            # request (rows of different k, as a server's mixed prompt lengths give) was a
            # strided host-to-device copy each, 2 x n x layers of them, 0.2-0.4 s per block.
            kd[:, :, :m].copy_(out[0, :, :, :m], non_blocking=True)
            vd[:, :, :m].copy_(out[1, :, :, :m], non_blocking=True)
            if any(x != m for x in sel):  # then zero the copied rows [k_r, m) (see the NOTE)
                pad = self._pad_mask(job, sel, a)
                kd[:, :, :m].masked_fill_(pad, 0)
                vd[:, :, :m].masked_fill_(pad, 0)
            if last_group:
                staging.copied()  # recorded on the copy stream, after every group's copies


def _merge_records(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's recorded (host query, indices) of every group, in row order; the indices
    padded with -1 to the widest group's k_max."""
    width = max(idx.shape[2] for _, idx in parts)
    padded = [torch.nn.functional.pad(idx, (0, width - idx.shape[2]), value=-1) for _, idx in parts]
    return torch.cat([q for q, _ in parts]), torch.cat(padded)
