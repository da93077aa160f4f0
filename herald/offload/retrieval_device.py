"""One offloaded layer of HERALD's retrieval job with the selection scored on the model's device
(``OffloadConfig.first_pass="int8-gpu"``, :mod:`herald.offload.selection.compact_device`).

In place of the CPU kernel (:meth:`RetrievalWorker._offloaded_layer`): the representative
query's approximate top-k from the device's int8 keys, then the selected rows into the idle pool
(the GPU fetch reads them from the page-locked CPU pool; without it, the CPU gathers them into
the pinned staging as the kernel would), then the layer's ``selected`` output on the device from
those rows and the tail's exact KV. With the GPU fetch nothing waits for the host: the positions
stay on the device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from herald.kv.pinned import copy_to_host
from herald.offload.gpu_fetch import fetch_rows
from herald.offload.retrieval_job import RetrievalJob
from herald.offload.selection.compact_device import attend_selected_and_tail, select_int8
from herald.offload.selection.cpu import gather_selected

if TYPE_CHECKING:
    from herald.offload.retrieval import RetrievalWorker


def device_scored_layer(
    w: RetrievalWorker,
    job: RetrievalJob,
    layer_id: int,
    q: torch.Tensor,
    rows: tuple[int, int],
    last_group: bool,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The group of job rows ``rows = [a, e)`` at offloaded layer ``layer_id``: its selected
    rows on their way into the idle pool and its attention output ``[n, 1, H, D]`` (device)."""
    a, e = rows
    keys, tail_kv = w.device_keys, job.tail_kv
    assert keys is not None and tail_kv is not None
    li = w.pool.layers.index(layer_id)
    prefix = job.prefix_lens[a:e]
    # as the CPU kernel counts them: min(max(budget, 1), ranked positions)
    sel = [min(max(bud, 1), pre) for bud, pre in zip(job.budgets[a:e], prefix, strict=True)]
    if len(job.num_selected) < e:  # the first offloaded layer (every layer selects as many)
        job.num_selected.extend(sel)
    t0 = time.perf_counter()
    qd = q[:, 0]  # [n, H, D]
    tail_k, tail_v = tail_kv[li, 0, a:e], tail_kv[li, 1, a:e]  # [n, Hkv, B, D]
    idx = select_int8(qd, keys, layer_id, a, prefix, sel, tail_k)
    t1 = time.perf_counter()
    if w.gpu_fetch:
        _fetch(w, job, layer_id, idx, sel, a)
    else:
        _gather_and_copy(w, job, layer_id, idx, sel, a, last_group)
    if job.record:
        host_q = qd[:, None].to(torch.bfloat16).cpu()
        parts.append((host_q, idx.cpu()))
    m = max(1, max(sel))
    if w.cuda:
        assert w.stream is not None and w.copy_stream is not None
        w.stream.wait_stream(w.copy_stream)  # NOTE: copy-before-read: the rows are in the pool
    kd = w.pool.k(job.buffer, layer_id)[a:e, :, :m]
    vd = w.pool.v(job.buffer, layer_id)[a:e, :, :m]
    if max(sel):  # true at rows >= k_i
        pad = w._pad_mask(job, sel, a)[:, 0, :, 0]
    else:  # nothing selected: only the tail is attended
        pad = torch.ones(e - a, m, dtype=torch.bool, device=w.device)
    o = attend_selected_and_tail(qd, kd, vd, pad, tail_k, tail_v)
    job.layer_seconds.append((0.0, t1 - t0, time.perf_counter() - t1))
    return o.to(w.dtype).view(e - a, 1, *qd.shape[1:])


def _fetch(
    w: RetrievalWorker, job: RetrievalJob, layer_id: int, idx: torch.Tensor, sel: list[int], a: int
) -> None:
    """The GPU reads the selected rows from the page-locked pool, on the copy stream, after the
    retrieval stream computed ``idx``."""
    assert w.copy_stream is not None and w.stream is not None
    pl = layer_id - w.num_dense
    n, m = len(sel), max(sel)
    with torch.cuda.stream(w.copy_stream):
        w.copy_stream.wait_stream(w.stream)  # NOTE: the positions are computed first
        if m > 0:
            table, counts = w._fetch_meta(job, sel, a)
            fetch_rows(
                w.cpu_pool.k_pages(pl), w.cpu_pool.v_pages(pl), table, idx, counts,
                w.pool.k(job.buffer, layer_id)[a : a + n],
                w.pool.v(job.buffer, layer_id)[a : a + n], m,
            )  # fmt: skip
        # NOTE: the positions were made on the retrieval stream and are read on this one: the
        # allocator must not hand their memory out again before this stream has passed here.
        idx.record_stream(w.copy_stream)


def _gather_and_copy(
    w: RetrievalWorker,
    job: RetrievalJob,
    layer_id: int,
    idx: torch.Tensor,
    sel: list[int],
    a: int,
    last_group: bool,
) -> None:
    """Without the GPU fetch: the positions to the host, the CPU gathers the rows into the
    layer's pinned staging, one copy per tensor into the pool (as after the CPU kernel)."""
    n, hkv, kmax = idx.shape
    pl = layer_id - w.num_dense
    d = w.cpu_pool.head_dim
    staging = w._staging[w.pool.layers.index(layer_id)]
    # NOTE: take() waits (asleep) until the previous copy out of this region completed.
    out = staging.take((2, n, hkv, kmax, d), offset=a * 2 * hkv * w.pool.capacity * d)
    if w.faults is not None and w.faults.poison_staging:
        out.fill_(float("nan"))
    idx_host = copy_to_host(idx) if w.cuda else idx
    counts = torch.tensor(sel, dtype=torch.int32)
    table = job.page_table[a : a + n].to(torch.int32)
    gather_selected(w.cpu_pool.k_pages(pl), w.cpu_pool.v_pages(pl), table, idx_host, counts, out)
    w._copy_to_pool(job, layer_id, out, sel, a, last_group)
