"""Page-locking an existing CPU tensor with ``cudaHostRegister``, in chunks.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator: slow for
100 GB-class buffers (64 GiB in 50 s on an H200 host) and rounded up to a power of two. Instead
the owner allocates pageable memory, touches it, and registers it here (96 GiB in ~5 s, 14x
faster). Used by the CPU full KV pool (:mod:`herald.kv.cpu_pool`, HERALD §IV-B1); any large staging
buffer can use it too. Also here: the host's waits on the device that the offloading path makes
(:func:`host_wait`, :func:`copy_to_host`, :meth:`PinnedStaging.take`), which sleep, not spin.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

__all__ = [
    "REGISTER_CHUNK_BYTES",
    "PinnedStaging",
    "copy_to_host",
    "host_wait",
    "page_copy_runs",
    "register_chunks",
    "register_pinned",
    "unregister_pinned",
]

_GIB = 1 << 30
REGISTER_CHUNK_BYTES = 16 * _GIB  # the ~5 s for 96 GiB above was measured with 16 GiB chunks


def register_pinned(tensor: torch.Tensor, chunk_bytes: int = REGISTER_CHUNK_BYTES) -> list[int]:
    """Register a contiguous CPU tensor's memory with CUDA; returns the registered base addresses.

    Inner chunk boundaries are at ``align_up(start, 4096) + i * chunk_bytes`` (``chunk_bytes`` a
    multiple of 4096), so no OS page is registered twice and a tensor of at most ``chunk_bytes``
    is one registration. NOTE: one DMA (``cudaMemcpyAsync``) must not span two registrations (the
    driver rejects it with "invalid argument"); a buffer copied from or to as a whole must
    therefore be one registration, and a larger buffer whose start is page-aligned splits only
    at page boundaries (CpuKVPool aligns its storage so that no page slab is split). The tensor
    must stay alive until :func:`unregister_pinned` has been called on the returned list.

    Raises:
        ValueError: not a contiguous CPU tensor, or a bad ``chunk_bytes``.
        RuntimeError: a ``cudaHostRegister`` error (its code in the message); chunks registered
            before it are unregistered again.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("register_pinned needs a contiguous CPU tensor")
    if chunk_bytes < 4096 or chunk_bytes % 4096:
        raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    cudart = torch.cuda.cudart()
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    registered: list[int] = []
    for addr, nxt in register_chunks(start, end, chunk_bytes):
        rc = int(cudart.cudaHostRegister(addr, nxt - addr, 0))
        if rc != 0:
            unregister_pinned(registered)
            raise RuntimeError(
                f"cudaHostRegister of {(nxt - addr) / _GIB:.2f} GiB at offset "
                f"{(addr - start) / _GIB:.2f} GiB of a {(end - start) / _GIB:.2f} GiB buffer "
                f"failed with CUDA error {rc} (too little lockable memory? see ulimit -l)"
            )
        registered.append(addr)
    return registered


def register_chunks(start: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``[addr, next)`` byte ranges :func:`register_pinned` registers for ``[start, end)``:
    inner boundaries at ``align_up(start, 4096) + i * chunk_bytes``, i >= 1."""
    base = -(-start // 4096) * 4096
    out = []
    addr = start
    while addr < end:
        nxt = min(end, base + (max(addr - base, 0) // chunk_bytes + 1) * chunk_bytes)
        out.append((addr, nxt))
        addr = nxt
    return out


def unregister_pinned(addresses: list[int]) -> None:
    """``cudaHostUnregister`` each address from :func:`register_pinned`, then empty the list.

    The caller must make sure no asynchronous copy still uses the memory. RuntimeError with the
    CUDA error codes if any call failed (all are attempted; the list is emptied regardless).
    """
    if not addresses:
        return
    cudart = torch.cuda.cudart()
    errors = [rc for a in addresses if (rc := int(cudart.cudaHostUnregister(a))) != 0]
    addresses.clear()
    if errors:
        raise RuntimeError(f"cudaHostUnregister failed with CUDA error(s) {errors}")


def host_wait(stream: torch.cuda.Stream | None = None) -> None:
    """Block the calling thread until ``stream`` (default: the current stream) has run all the
    work queued on it so far, asleep.

    NOTE: ``Stream.synchronize()``, ``synchronize()`` on a default ``torch.cuda.Event`` and a
    copy to pageable host memory (``.to("cpu")``, ``.tolist()``) busy-wait: with fewer CUDA
    contexts than cores the runtime spins a core for the whole wait, a core the CPU selection
    kernel's threads are using. An event made with ``blocking=True`` makes the host thread
    sleep until the device signals it.
    """
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    event.synchronize()


def copy_to_host(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src`` (a CUDA tensor) copied into ``out`` (pinned host memory of its shape; default a
    new pinned tensor) on the current stream, waited for with :func:`host_wait` (no spinning).
    Returns ``out``, complete."""
    if out is None:
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out.copy_(src, non_blocking=True)
    host_wait()
    return out


class PinnedStaging:
    """A host staging buffer (pinned with :func:`register_pinned` when ``pin``) reused for
    asynchronous host-to-device copies.

    Args:
        numel: capacity in elements; dtype: element type; pin: register it with CUDA (the
            buffer then supports true async copies at full PCIe speed).

    :meth:`take` returns a contiguous view of ``shape`` from element ``offset`` (default 0;
    within ``numel`` elements, else RuntimeError from ``view``) and first waits until the copy
    recorded by the last :meth:`copied` completed. NOTE: no staging reuse before its copy
    completed; :meth:`copied` records an event on the current CUDA stream after the caller
    issued its copies from the view. Zero-filled at creation, so never-written rows read as 0,
    not NaN bit patterns.
    """

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.numel = numel
        self.buf = torch.zeros(numel, dtype=dtype)
        self.pin = pin
        self._addrs = register_pinned(self.buf) if pin else []
        self._event: torch.cuda.Event | None = None

    def take(self, shape: tuple[int, ...] | torch.Size, offset: int = 0) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.buf[offset : offset + math.prod(shape)].view(shape)

    def copied(self) -> None:
        if self.pin:
            # blocking: take() and close() sleep on it (see host_wait)
            self._event = torch.cuda.Event(blocking=True)
            self._event.record()

    def close(self) -> None:
        """Wait for the last copy, then unregister (idempotent)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        unregister_pinned(self._addrs)


def page_copy_runs(
    page_ids: Sequence[int], page_bytes: int, boundaries: Sequence[int]
) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """Split ``page_ids`` into runs that one copy each can move (``CpuKVPool.copy_pages``).

    Args:
        page_ids: page ids in output order; page p occupies bytes ``[p, p + 1) * page_bytes``.
        page_bytes: bytes per page (> 0).
        boundaries: byte offsets where one pinned registration ends and the next begins.

    Returns ``[(index into page_ids, first page id, count, cuts)]`` covering ``page_ids`` in
    order: each run holds consecutive ids and spans no boundary, except a single page that
    boundaries cut inside: then ``count`` is 1 and ``cuts`` holds their byte offsets within the
    page (ascending), where its copy must be split. ``cuts`` is empty otherwise.
    """
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    cuts = sorted(set(boundaries))
    runs: list[tuple[int, int, int, tuple[int, ...]]] = []
    j, n = 0, len(page_ids)
    while j < n:
        first, count = page_ids[j], 1
        while j + count < n and page_ids[j + count] == first + count:
            count += 1
        p, end = first, first + count
        lo = bisect.bisect_right(cuts, first * page_bytes)
        hi = bisect.bisect_left(cuts, end * page_bytes)
        at: dict[int, list[int]] = {}  # page -> offsets of the cuts within it (0: its start)
        for cut in cuts[lo:hi]:
            page, rem = divmod(cut, page_bytes)
            at.setdefault(page, []).append(rem)
        for page in sorted(at):
            if page > p:
                runs.append((j + p - first, p, page - p, ()))
                p = page
            inner = tuple(r for r in at[page] if r)
            if inner:
                runs.append((j + page - first, page, 1, inner))
                p = page + 1
        if p < end:
            runs.append((j + p - first, p, end - p, ()))
        j += count
    return runs
