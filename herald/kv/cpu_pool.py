"""The CPU full KV pool: every prefix token's K and V for the offloaded layers (HERALD §IV-B1).

Owns one CPU allocation ``[num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]`` (K at
index 0, V at 1), allocated once at start-up and, when CUDA is available, pinned with
``cudaHostRegister`` in chunks of <= 16 GiB (:mod:`herald.kv.pinned`; on an H200 host 96 GiB
register in ~5 s, 14x faster than ``pin_memory=True``, which also rounds sizes up to a power of
two), plus the page allocator that hands pages to requests.

A page holds one diffusion block (``page_size`` = block size B) for every layer: block i of a
request (absolute positions ``[i*B, (i+1)*B)``) lives in the request's i-th page. Layers are the
pool's own indices ``0..num_layers-1``; the engine maps model layers onto them (the first two model
layers stay dense on the GPU, so model layer l >= 2 is pool layer l - 2).

Data in: the prompt's KV at prefill, and each block's draft KV and committed KV, written into
:attr:`storage` by the offloading engine's block hand-off (MAGE with CPU selection also writes the
current block into a scratch page with :meth:`CpuKVPool.write_block`). Data out: :meth:`k_pages` /
:meth:`v_pages` feed the CPU selection kernel (:func:`herald.offload.selection.cpu.select_topk`)
and the gather of the selected rows, on the retrieval thread or the engine thread, through page
tables the engine thread builds; the allocator is guarded by a lock all the same.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import threading
import time
from collections.abc import Sequence
from types import TracebackType

import torch

from herald.env import settings
from herald.kv.compact_keys import FIRST_PASS_KINDS, CompactKeys, compact_bytes_per_page
from herald.kv.hugepages import HUGE_PAGE, advise_pages, anon_huge_bytes
from herald.kv.pinned import page_copy_runs, register_pinned, unregister_pinned

__all__ = ["CpuKVPool", "CpuPoolFullError", "page_copy_runs"]

_GIB = 1 << 30


class CpuPoolFullError(RuntimeError):
    """Not enough free pages in the CPU KV pool; nothing was allocated."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(
            f"CPU KV pool full: needs {needed} free page(s), {free} free; enlarge the pool "
            "(--cpu-kv-gb) or admit fewer/shorter requests"
        )
        self.needed, self.free = needed, free


class CpuKVPool:
    """One CPU tensor holding K/V pages of all offloaded layers, and a thread-safe page allocator.

    Args:
        num_layers: offloaded layers held (pool layer indices ``0..num_layers-1``).
        num_kv_heads, head_dim: the model's KV heads and head dimension.
        page_size: tokens per page = the diffusion block size B.
        num_pages: pages to allocate (>= 1); each page covers all layers, K and V.
        dtype: element type (bf16, what the selection kernel reads).
        pin: ``None`` = pin iff CUDA is available; ``True`` requires CUDA; ``False`` = pageable.
        first_pass: ``"int8"`` also keeps an int8 copy of K (:attr:`compact`,
            :mod:`herald.kv.compact_keys`; its bytes count in :attr:`nbytes` and
            :attr:`bytes_per_page`), ``"none"`` (default) does not.

    Raises:
        ValueError: a non-positive size. RuntimeError: ``pin=True`` without CUDA, or
        ``cudaHostRegister`` failing (the message has the CUDA error code; nothing stays
        registered). The CPU allocator's own error when the memory is not there.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
        *, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None, first_pass: str = "none",
    ) -> None:  # fmt: skip
        if first_pass not in FIRST_PASS_KINDS:
            raise ValueError(f"first_pass must be one of {FIRST_PASS_KINDS}, got {first_pass!r}")
        dims = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        for name, value in {**dims, "page_size": page_size, "num_pages": num_pages}.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise RuntimeError("CpuKVPool(pin=True) needs CUDA; pass pin=None or False")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.num_pages, self.dtype = page_size, num_pages, dtype
        shape = (num_layers, 2, num_pages, num_kv_heads, page_size, head_dim)
        t0 = time.perf_counter()
        # Pageable memory, touched once (zero_ runs on torch's intra-op threads): every page is
        # faulted in before registration, and a never-written slot reads as 0, not NaN garbage.
        # NOTE: a 2 MiB-aligned start (a huge page's, so a page's too): the registration then
        # splits (every 16 GiB) only at page boundaries, which are page-slab boundaries too, so
        # no slab spans two registrations (one DMA across two is rejected by the driver; see
        # herald.kv.pinned), and the pool starts on a huge page.
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        try:
            raw = torch.empty(numel + HUGE_PAGE // itemsize, dtype=dtype)
        except RuntimeError as e:  # the allocator's message names no flag; ours does
            gib = numel * itemsize / _GIB
            raise RuntimeError(
                f"cannot allocate a {gib:.1f} GiB CPU KV pool ({num_pages} pages): not enough "
                "memory; give a smaller pool (--cpu-kv-gb or --cpu-kv-tokens)"
            ) from e
        off = (-raw.data_ptr() % HUGE_PAGE) // itemsize
        storage = raw[off : off + numel].view(shape)
        # 4 KiB or 2 MiB pages (HERALD_HUGE_PAGES), asked for before the first touch.
        huge0 = anon_huge_bytes()
        huge = settings().huge_pages
        advised = advise_pages(storage.data_ptr(), storage.nbytes, huge=huge)
        self.huge_pages_advised = huge and advised
        self._storage: torch.Tensor | None = storage.zero_()
        huge1 = anon_huge_bytes()
        self.huge_page_bytes = None if huge0 is None or huge1 is None else max(0, huge1 - huge0)
        """Bytes of the process's memory the kernel moved onto huge pages while the pool was
        touched (the pool's, as nothing else allocates meanwhile; None: not reported)."""
        self.compact: CompactKeys | None = None  # the int8 copy of K (first_pass="int8")
        if first_pass == "int8":
            self.compact = CompactKeys(num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.alloc_seconds = time.perf_counter() - t0
        self.nbytes = self._storage.nbytes + (self.compact.nbytes if self.compact else 0)
        self.bytes_per_page = self.nbytes // num_pages  # K, V (and int8 K) of a page, all layers
        self.capacity_tokens = num_pages * page_size
        self._registered: list[int] = []  # base addresses passed to cudaHostRegister
        self.pin_seconds = 0.0
        if pin:
            t0 = time.perf_counter()
            # NOTE: registered from the allocation's start (the alignment slack included), so
            # torch sees the pool as pinned (Tensor.is_pinned checks the allocation's base
            # pointer); inner boundaries stay at the aligned start + i * 16 GiB.
            self._registered = register_pinned(raw[: off + numel])
            self.pin_seconds = time.perf_counter() - t0
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack: pops 0, 1, 2, ...
        self._pages: dict[str, list[int]] = {}

    # ---- sizing -----------------------------------------------------------------------------

    @classmethod
    def from_gib(
        cls, gib: float, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
        *, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None, first_pass: str = "none",
    ) -> CpuKVPool:  # fmt: skip
        """The largest pool of at most ``gib`` GiB (2**30 bytes, the int8 copy of K included);
        ValueError if < 1 page."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = num_layers * 2 * num_kv_heads * page_size * head_dim * itemsize
        if first_pass == "int8":
            per_page += compact_bytes_per_page(num_layers, num_kv_heads, page_size, head_dim)
        num_pages = int(gib * _GIB) // per_page
        if num_pages < 1:
            raise ValueError(f"{gib} GiB holds no page of {per_page} bytes")
        return cls(
            num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype=dtype, pin=pin,
            first_pass=first_pass,
        )  # fmt: skip

    @classmethod
    def from_tokens(
        cls, tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
        *, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None, first_pass: str = "none",
    ) -> CpuKVPool:  # fmt: skip
        """A pool of ``ceil(tokens / page_size)`` pages (capacity rounded up to whole pages)."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        num_pages = math.ceil(tokens / page_size)
        return cls(
            num_layers, num_kv_heads, head_dim, page_size, num_pages, dtype=dtype, pin=pin,
            first_pass=first_pass,
        )  # fmt: skip

    @property
    def num_free_pages(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def pages_for_tokens(self, tokens: int) -> int:
        """Pages needed to hold ``tokens`` positions (``ceil(tokens / page_size)``)."""
        return -(-tokens // self.page_size)

    def describe(self) -> str:
        """One line for the start-up log: size, capacity in tokens, allocation and pin times."""
        how = f"pinned in {len(self._registered)} chunk(s)" if self.pinned else "not pinned"
        dtype = str(self.dtype).removeprefix("torch.") + (" + int8 K" if self.compact else "")
        return (
            f"CPU KV pool: {_size(self.nbytes)} {how}, {self.num_pages} pages x "
            f"{self.page_size} tokens = {self.capacity_tokens} tokens ({self.num_layers} layers x "
            f"{self.num_kv_heads} KV heads x {self.head_dim} {dtype}); "
            f"alloc+touch {self.alloc_seconds:.2f} s, pin {self.pin_seconds:.2f} s; "
            f"{self._pages_text()}"
        )

    def _pages_text(self) -> str:
        if self.huge_page_bytes:
            return f"{_size(self.huge_page_bytes)} on 2 MiB pages"
        return "2 MiB pages asked for" if self.huge_pages_advised else "4 KiB pages"

    # ---- storage ----------------------------------------------------------------------------

    @property
    def storage(self) -> torch.Tensor:
        """The whole pool ``[num_layers, 2, num_pages, Hkv, page_size, D]``; error after close()."""
        if self._storage is None:
            raise RuntimeError("CpuKVPool is closed")
        return self._storage

    def k_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, Hkv, page_size, D]`` of K for pool layer ``layer`` (no copy).

        Each ``[page_size, D]`` slab is contiguous and K/V views have equal strides, as
        :func:`herald.offload.selection.cpu.select_topk` requires. IndexError for a layer out of
        range.
        """
        return self._kv(layer, 0)

    def v_pages(self, layer: int) -> torch.Tensor:
        """View ``[num_pages, Hkv, page_size, D]`` of V for pool layer ``layer`` (no copy)."""
        return self._kv(layer, 1)

    def _kv(self, layer: int, kv: int) -> torch.Tensor:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"pool layer {layer} outside [0, {self.num_layers})")
        return self.storage[layer, kv]

    def close(self) -> None:
        """Unregister the pinned memory (once) and drop the pool's reference to it.

        Views returned earlier stay valid CPU memory but are no longer pinned.
        """
        if self._registered:
            # NOTE: a non_blocking copy may still be reading or writing pinned pages; unregistering
            # under it is undefined, so wait for all device work first.
            torch.cuda.synchronize()
            unregister_pinned(self._registered)
        self._storage = None

    def __enter__(self) -> CpuKVPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: CUDA may already be gone
            self.close()

    # ---- page allocator (thread-safe) -------------------------------------------------------

    def _take(self, num_pages: int) -> list[int]:  # caller holds the lock
        if num_pages > len(self._free):
            raise CpuPoolFullError(num_pages, len(self._free))
        taken = self._free[len(self._free) - num_pages :][::-1]
        del self._free[len(self._free) - num_pages :]
        return taken

    def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """Give ``request_id`` its first ``num_pages`` (>= 1) pages; returns their ids.

        All or nothing. Raises CpuPoolFullError (pool unchanged) when too few pages are free,
        ValueError if ``request_id`` already holds pages or ``num_pages`` < 1.
        """
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        with self._lock:
            if request_id in self._pages:
                raise ValueError(f"request {request_id!r} already holds CPU KV pages")
            self._pages[request_id] = taken = self._take(num_pages)
            return list(taken)

    def extend(self, request_id: str, num_pages: int) -> list[int]:
        """Append ``num_pages`` (>= 0) pages to ``request_id``'s pages; returns the new ids.

        All or nothing. Raises CpuPoolFullError (pool unchanged), KeyError for an unknown id.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        with self._lock:
            owned = self._owned(request_id)
            taken = self._take(num_pages)
            owned.extend(taken)
            return taken

    def free(self, request_id: str) -> None:
        """Return all of ``request_id``'s pages. KeyError if it holds none (a double free is a bug
        in the caller; use ``request_id in pool`` to check first)."""
        with self._lock:
            self._free.extend(reversed(self._owned(request_id)))
            del self._pages[request_id]

    def _owned(self, request_id: str) -> list[int]:  # caller holds the lock
        try:
            return self._pages[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no CPU KV pages") from None

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._pages

    def pages(self, request_id: str) -> list[int]:
        """A copy of ``request_id``'s page ids in block order; KeyError for an unknown id."""
        with self._lock:
            return list(self._owned(request_id))

    def can_allocate(self, num_pages: int) -> bool:
        with self._lock:
            return num_pages <= len(self._free)

    def page_table(self, request_ids: list[str], max_pages: int | None = None) -> torch.Tensor:
        """``[len(request_ids), max_pages]`` int32 CPU page table for the selection kernel.

        Row r lists request r's pages in block order; columns past them repeat its first page (a
        valid id: the kernel reads only the first ``ceil(S / page_size)`` entries). ``max_pages``
        defaults to the most pages any of them holds. Raises KeyError for an unknown id,
        ValueError if a request holds more than ``max_pages`` pages.
        """
        with self._lock:
            rows = [list(self._owned(r)) for r in request_ids]
        width = max((len(p) for p in rows), default=1) if max_pages is None else max_pages
        table = torch.empty(len(rows), width, dtype=torch.int32)
        for r, (rid, ids) in enumerate(zip(request_ids, rows, strict=True)):
            if len(ids) > width:
                raise ValueError(f"request {rid!r} holds {len(ids)} pages > max_pages={width}")
            table[r] = torch.tensor(ids + [ids[0]] * (width - len(ids)), dtype=torch.int32)
        return table

    # ---- moving KV --------------------------------------------------------------------------

    def _page(self, request_id: str, block_index: int) -> int:
        with self._lock:
            owned = self._owned(request_id)
            if not 0 <= block_index < len(owned):
                raise IndexError(
                    f"block {block_index} of request {request_id!r}: it holds {len(owned)} pages"
                )
            return owned[block_index]

    def write_block(
        self, layer: int, request_id: str, block_index: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Copy one block's K and V ``[Hkv, n, D]`` (n <= page_size, slots ``[0, n)``; dtype of
        the pool; CPU or CUDA) into page ``block_index`` of ``request_id`` at pool ``layer``.

        Raises KeyError (unknown id), IndexError (no such page), ValueError/TypeError (shape,
        dtype).
        """
        shape = (self.num_kv_heads, k.shape[1] if k.dim() == 3 else -1, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != shape or not 1 <= shape[1] <= self.page_size:
                raise ValueError(
                    f"{name} must be [Hkv={self.num_kv_heads}, n<={self.page_size}, "
                    f"D={self.head_dim}] like k, got {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise TypeError(f"{name} must be {self.dtype}, got {t.dtype}")
        page = self._page(request_id, block_index)
        n = shape[1]
        # NOTE: from CUDA into the pinned pool this is an async D2H copy on the current stream
        # (a full block is one contiguous copy; a partial one goes through torch's blocking
        # staging). The caller must record an event after it and make every reader of this page
        # (selection kernel, gather) wait on it, and must neither free the request's pages nor
        # overwrite the GPU source before the copy completes.
        non_blocking = k.is_cuda and self.pinned
        self.k_pages(layer)[page, :, :n].copy_(k, non_blocking=non_blocking)
        self.v_pages(layer)[page, :, :n].copy_(v, non_blocking=non_blocking)
        if self.compact is not None:  # the int8 copy of K follows (after the copy landed)
            if non_blocking:
                torch.cuda.current_stream(k.device).synchronize()
            self.compact.update(self.storage, [page])

    def copy_pages(
        self, layer: int, kv: int, page_ids: Sequence[int], out: torch.Tensor
    ) -> torch.Tensor:
        """Copy whole pages of pool ``layer`` (``kv`` 0: K, 1: V) into ``out`` and return it.

        Args:
            page_ids: pool page ids (a request's :meth:`pages` or a prefix of them).
            out: contiguous ``[len(page_ids), Hkv, page_size, D]`` of the pool's dtype, on any
                device; ``out[j]`` receives page ``page_ids[j]``.

        One copy per run of consecutive ids (the allocator hands out ascending ids, so a
        request's pages are usually a few runs): no CPU gather. Into CUDA from the pinned pool
        the copies are asynchronous DMAs on the current stream at PCIe speed (MAGE's per-block
        full-KV fetch, docs/ARCHITECTURE.md). NOTE: the caller must neither write these pages nor
        free them before that stream has passed the copies. A run is split where it would span
        two pinned registrations (the driver rejects one copy across two, see
        :mod:`herald.kv.pinned`), and a page that itself spans two is copied in pieces.

        Raises ValueError (``kv``, ``out``'s shape, dtype or layout), TypeError (a ``layer`` or
        page id that is not an integer), IndexError (a page id or ``layer`` out of range).
        """
        if type(kv) is not int or kv not in (0, 1):
            raise ValueError(f"kv must be 0 (K) or 1 (V), got {kv!r}")
        if type(layer) is not int:
            raise TypeError(f"layer must be an int, got {layer!r}")
        try:
            page_ids = [operator.index(p) for p in page_ids]
        except TypeError:
            raise TypeError(f"page ids must be integers, got {list(page_ids)[:4]!r}...") from None
        src = self._kv(layer, kv)
        shape = (len(page_ids), self.num_kv_heads, self.page_size, self.head_dim)
        if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            layout = "" if out.is_contiguous() else "non-contiguous "
            raise ValueError(
                f"out must be a contiguous {self.dtype} tensor of shape {list(shape)}, got a "
                f"{layout}{out.dtype} tensor of shape {list(out.shape)}"
            )
        bad = [p for p in page_ids if not 0 <= p < self.num_pages]
        if bad:
            raise IndexError(f"page id {bad[0]} outside [0, {self.num_pages})")
        page_bytes = src[0].nbytes
        base = src.data_ptr()
        limit = self.num_pages * page_bytes
        inner = [a - base for a in self._registered if 0 < a - base < limit]
        non_blocking = out.is_cuda and self.pinned
        item = src.element_size()
        for j, first, count, cuts in page_copy_runs(page_ids, page_bytes, inner):
            dst, pages = out[j : j + count], src[first : first + count]
            if not cuts:
                dst.copy_(pages, non_blocking=non_blocking)
                continue
            # one page cut by registrations: one copy per piece (each within one registration)
            edges = [0, *(c // item for c in cuts), page_bytes // item]
            flat_dst, flat_src = dst.view(-1), pages.reshape(-1)
            for a, b in itertools.pairwise(edges):
                flat_dst[a:b].copy_(flat_src[a:b], non_blocking=non_blocking)
        return out

    def read_tokens(
        self, layer: int, request_id: str, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[start, end)`` of ``request_id`` at pool ``layer``, as new
        contiguous CPU tensors ``[Hkv, end - start, D]`` (tests and debugging; not a fast path).

        Raises KeyError (unknown id), IndexError (range outside the request's pages).
        """
        ids = self.pages(request_id)
        if not 0 <= start <= end <= len(ids) * self.page_size:
            raise IndexError(
                f"[{start}, {end}) outside request {request_id!r}'s "
                f"{len(ids) * self.page_size} positions"
            )
        pos = torch.arange(start, end)
        page = torch.tensor(ids, dtype=torch.long)[pos // self.page_size]
        slot = pos % self.page_size
        k = self.k_pages(layer)[page, :, slot].transpose(0, 1).contiguous()  # [n, Hkv, D] -> ...
        v = self.v_pages(layer)[page, :, slot].transpose(0, 1).contiguous()
        return k, v


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB, or in MiB below one GiB (a small pool does not read as 0.00 GiB)."""
    if nbytes >= _GIB:
        return f"{nbytes / _GIB:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
