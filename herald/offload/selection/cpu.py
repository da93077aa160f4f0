"""CPU KV selection: fused exact attention + top-k per KV head, and the gather of the selected rows.

The retrieval stream's CPU step (HERALD §IV-B4). For each request of a batch and each KV head it
scans the request's prefix K (and V in ``full`` mode) in the CPU full KV pool once, keeps the
scores in a per-thread buffer, ranks positions by the softmax-normalised importance summed over the
G query heads of the group and the n_q queries (:mod:`herald.offload.selection.topk`), and returns
the top-k positions with the attention output. An optional per-request tail (the draft block of
the lookahead) is attended to but excluded from the ranking: the sparse pool holds it anyway.
:func:`gather_selected` copies the selected K/V rows of one layer into one contiguous (pinned)
staging buffer laid out as the GPU sparse pool expects, for one async copy; ``select_topk``'s
``gather_out`` does the same inside the selection (the retrieval stream's path).

Backends: the native C++ library (herald/csrc via :mod:`herald.offload.selection._kernel`;
AVX-512 kernels where the CPU has AVX-512 BF16, else a portable path) or, if it cannot be built or
loaded, the PyTorch implementation in :mod:`herald.offload.selection.ref` (one warning). The
native kernel threads over (request, KV head) items, or over tiles of S when items are fewer than
threads; its threads sleep between calls. The ``HERALD_SELECTION_*`` switches (backend, ISA,
threads, schedule, prefetch) are parsed once by :mod:`herald.env`.
"""

from __future__ import annotations

import ctypes
import math
import warnings

import torch

from herald.env import selection_threads, settings
from herald.offload.selection import _kernel
from herald.offload.selection.ref import (
    NonFiniteScoreError,
    SelectionResult,
    SelectionShapes,
    check_gather_inputs,
    check_selection_inputs,
    gather_selected_torch,
    select_topk_torch,
)

__all__ = [
    "NonFiniteScoreError",
    "SelectionResult",
    "gather_selected",
    "kernel_info",
    "scatter_blocks",
    "select_topk",
]

_ISA = {"auto": 0, "avx512": 1, "portable": 2, "avx512bf16": 3}
_SCHEDULE = {"auto": 0, "items": 1, "tiles": 2}
_PREFETCH_HINT = {"none": 0, "t0": 1, "t1": 2, "nta": 3}
_warned = False


def _native() -> _kernel.NativeLibrary | None:
    """The native library per ``HERALD_SELECTION_BACKEND``, or None to use PyTorch."""
    global _warned
    backend = settings().selection_backend
    if backend == "torch":
        return None
    lib = _kernel.load_native()
    if lib is None:
        if backend == "native":
            raise RuntimeError(
                f"HERALD_SELECTION_BACKEND=native but the selection library is unavailable: "
                f"{_kernel.unavailable_reason()}"
            )
        if not _warned:
            _warned = True
            warnings.warn(
                "herald: native CPU selection kernel unavailable "
                f"({_kernel.unavailable_reason()}); using the much slower PyTorch implementation",
                RuntimeWarning,
                stacklevel=3,
            )
    return lib


def select_topk(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget_tokens: torch.Tensor,
    *,
    tail_lens: torch.Tensor | None = None,
    output_mode: str = "full",
    return_importance: bool = False,
    num_threads: int | None = None,
    gather_out: torch.Tensor | None = None,
) -> SelectionResult:
    """Exact attention over each request's prefix and the top-k positions per KV head.

    Args (all CPU tensors; HERALD §IV-B4):
        q: [n_req, n_q, num_heads, head_dim] bf16, any strides. n_q = 1 (representative query)
            up to the block size. Query head ``h * G + g`` belongs to KV head ``h``
            (G = num_heads // num_kv_heads).
        k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim] bf16, one layer of the
            CPU full KV pool; each [page_size, head_dim] slab contiguous, same strides for both.
        page_table: [n_req, max_pages] int32 page ids. Logical position s of request r is slot
            ``s % page_size`` of page ``page_table[r, s // page_size]``; only the first
            ``ceil(seq_lens[r] / page_size)`` entries are read (a draft block is one more page).
        seq_lens: [n_req] int32, S >= 1 tokens (the last page may be partial).
        budget_tokens: [n_req] int32 >= 1, k per KV head; k >= S - tail selects every ranked
            position.
        tail_lens: [n_req] int32 in [0, S], or None (all 0). The last ``tail_lens[r]`` positions
            ``[S - tail, S)`` are the always-included tail (HERALD's draft lookahead: block n's
            draft KV after the committed prefix; the sparse pool holds it): keys of the attention
            and of the softmax like any position, but never ranked nor in ``indices``.
        output_mode: ``"full"``: exact softmax attention over all S keys (reads K and V).
            ``"selected"``: softmax attention restricted to the selected rows plus the tail
            rows, i.e. what the sparse attention computes (reads K, and V only at those rows).
        return_importance: also return the importance vectors.
        num_threads: worker threads (default :func:`herald.env.selection_threads`).
        gather_out: None, or :func:`gather_selected`'s ``out``, filled by this call itself.

    Importance of position s for KV head h: ``sum_{q,g} exp(score[q,g,s] - m[q,g]) / l[q,g]`` over
    the n_q queries and the G query heads of the group, score = q.k * head_dim**-0.5, m and l the
    softmax max and normaliser over all S positions (the tail included). Top-k by importance over
    the ranked positions ``[0, S - tail)`` only; ties go to the smaller position. The tail costs no
    extra pass over K. The native path computes in float32 (bf16 products accumulated in float32).

    Returns:
        :class:`SelectionResult`: indices [n_req, num_kv_heads, k_max] int32 ascending, -1 padded
        (k_max = max(1, max_r num_selected[r])); num_selected [n_req] int32 =
        min(budget, S - tail), 0 when all S positions are tail (indices then all -1);
        attn_output [n_req, n_q, num_heads, head_dim] float32; importance
        [n_req, num_kv_heads, max S] float32 over all S positions, tail included (0 past S),
        or None.

    Raises:
        TypeError / ValueError: wrong type, dtype, device, shape, stride, page id, size or tail
            length (the message names the argument). NonFiniteScoreError (a ValueError):
            NaN/inf in q or K.
        RuntimeError: HERALD_SELECTION_BACKEND=native and the library is unavailable.
    """
    lib = _native()
    # the native kernel validates page ids itself (cheaper than torch ops here)
    sh = check_selection_inputs(
        q, k_pages, v_pages, page_table, seq_lens, budget_tokens, output_mode, lib is None,
        tail_lens=tail_lens, gather_out=gather_out,
    )  # fmt: skip
    n = selection_threads(num_threads)
    if lib is None:
        with _torch_threads(n):
            return select_topk_torch(
                q, k_pages, v_pages, page_table, seq_lens, budget_tokens, tail_lens=tail_lens,
                output_mode=output_mode, return_importance=return_importance,
                compute_dtype=torch.float32, gather_out=gather_out,
            )  # fmt: skip
    tensors = dict(
        q=q.contiguous(), k_pages=k_pages, v_pages=v_pages, page_table=page_table.contiguous(),
        seq_lens=seq_lens.contiguous(), budget=budget_tokens.contiguous(),
        **({"gather_out": gather_out} if gather_out is not None else {}),
    )  # fmt: skip
    tail = tail_lens.contiguous() if tail_lens is not None else None
    return _select_native(lib, sh, output_mode, n, tensors, return_importance, tail)


def _select_native(
    lib: _kernel.NativeLibrary,
    sh: SelectionShapes,
    output_mode: str,
    n: int,
    tensors: dict[str, torch.Tensor],
    return_importance: bool,
    tail_lens: torch.Tensor | None,
) -> SelectionResult:
    """The native call on validated, contiguous inputs (``tensors``: q, pages, table, lengths,
    budgets and, if given, gather_out, by the argument struct's names)."""
    indices = torch.empty(sh.n_req, sh.num_kv_heads, sh.k_max, dtype=torch.int32)
    num_selected = torch.empty(sh.n_req, dtype=torch.int32)
    out = torch.empty(sh.n_req, sh.n_q, sh.num_heads, sh.head_dim, dtype=torch.float32)
    imp = None
    if return_importance:
        imp = torch.empty(sh.n_req, sh.num_kv_heads, sh.s_max, dtype=torch.float32)
    tensors = {**tensors, "indices": indices, "num_selected": num_selected, "attn_output": out}
    args = _select_args(sh, output_mode, n, tensors["k_pages"], tensors, imp, tail_lens)
    _kernel.check(lib, lib.lib.herald_select_topk(ctypes.byref(args)), "select_topk")
    return SelectionResult(indices, num_selected, out, imp)


def _select_args(
    sh: SelectionShapes,
    output_mode: str,
    num_threads: int,
    k_pages: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    importance: torch.Tensor | None,
    tail_lens: torch.Tensor | None,
) -> _kernel.SelectArgs:
    """The native call's argument struct (sizes, switches from :mod:`herald.env`, pointers)."""
    env = settings()
    isa = env.selection_isa
    return _kernel.SelectArgs(
        n_req=sh.n_req, n_q=sh.n_q, num_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads,
        head_dim=sh.head_dim, page_size=sh.page_size, max_pages=sh.max_pages, k_max=sh.k_max,
        s_max=sh.s_max, output_mode=0 if output_mode == "full" else 1, isa=_ISA[isa],
        num_threads=num_threads, schedule=_SCHEDULE[env.selection_schedule],
        prefetch_hint=_PREFETCH_HINT[env.prefetch_hint], prefetch_distance=env.prefetch_distance,
        num_pages=sh.num_pages, page_stride=k_pages.stride(0), head_stride=k_pages.stride(1),
        scale=sh.head_dim**-0.5, **{name: t.data_ptr() for name, t in tensors.items()},
        importance=importance.data_ptr() if importance is not None else None,
        tail_lens=tail_lens.data_ptr() if tail_lens is not None else None,
    )  # fmt: skip


def gather_selected(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    indices: torch.Tensor,
    num_selected: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Copy the selected K and V rows of one layer into the staging layout of the GPU sparse pool.

    Args (CPU tensors; HERALD §IV-B4):
        k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim] bf16 (as select_topk).
        page_table: [n_req, max_pages] int32.
        indices: [n_req, num_kv_heads, k_max] int32 logical positions (SelectionResult.indices).
        num_selected: [n_req] int32, each in [0, k_max].
        out: contiguous [2, n_req, num_kv_heads, k_max, head_dim] bf16, typically pinned; a new
            (unpinned) tensor if None.

    Returns ``out``: out[0] the K rows, out[1] the V rows; row j of (r, h) is logical position
    indices[r, h, j]. Rows j >= num_selected[r] are left untouched (not zeroed).
    A ``select_topk`` tail is not among ``indices``: the caller places those rows itself.
    NOTE: ``out`` is written by CPU threads before this returns; the caller must not reuse a
    staging buffer while an async H2D copy from it may still be running (wait on its event).

    Raises TypeError / ValueError on bad types, shapes or out-of-range indices / page ids.
    """
    n_req, hkv, k_max, d = check_gather_inputs(
        k_pages, v_pages, page_table, indices, num_selected, out
    )
    n = selection_threads(num_threads)
    lib = _native()
    if lib is None:
        return gather_selected_torch(k_pages, v_pages, page_table, indices, num_selected, out)
    if out is None:
        out = torch.empty(2, n_req, hkv, k_max, d, dtype=torch.bfloat16)
    page_table, indices = page_table.contiguous(), indices.contiguous()
    num_selected = num_selected.contiguous()
    args = _kernel.GatherArgs(
        n_req=n_req, num_kv_heads=hkv, head_dim=d, page_size=k_pages.shape[2],
        max_pages=page_table.shape[1], k_max=k_max, num_threads=n,
        isa=_ISA[settings().selection_isa], num_pages=k_pages.shape[0],
        page_stride=k_pages.stride(0), head_stride=k_pages.stride(1),
        k_pages=k_pages.data_ptr(), v_pages=v_pages.data_ptr(), page_table=page_table.data_ptr(),
        indices=indices.data_ptr(), num_selected=num_selected.data_ptr(), out=out.data_ptr(),
    )  # fmt: skip
    _kernel.check(lib, lib.lib.herald_gather_selected(ctypes.byref(args)), "gather_selected")
    return out


def scatter_blocks(
    dst: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    src: torch.Tensor,
    *,
    num_threads: int | None = None,
) -> None:
    """``dst.index_copy_(dim, index, src)`` on the selection kernel's threads: the CPU pool's
    block hand-off (``dst`` the pool storage, ``dim`` its page dimension).

    Args: ``dst`` and ``src`` contiguous CPU tensors of one dtype whose shapes differ only at
    ``dim``, where ``src`` has ``len(index)``; ``index`` int64 ``[n]`` in ``[0, dst.shape[dim])``,
    no repeats. NOTE: the native path sleeps in the kernel's own thread pool instead of waking
    PyTorch's OpenMP threads, which keep spinning after a parallel ``index_copy_`` returns, on
    the cores a selection starting next (or running on the retrieval thread) needs; its
    non-temporal stores skip reading the destination pages first. Calls queue behind a
    selection in progress (one kernel call at a time). Raises TypeError / ValueError on bad
    arguments (the PyTorch fallback: its own errors).
    """
    lib = _native()
    if lib is None:
        dst.index_copy_(dim, index, src)
        return
    for name, t in (("dst", dst), ("src", src), ("index", index)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous CPU tensor")
    shape = list(src.shape)
    if index.dtype != torch.int64 or index.dim() != 1 or not 0 <= dim < dst.dim():
        raise ValueError(f"index must be int64 [n] and dim in [0, {dst.dim()}), got dim {dim}")
    if src.dtype != dst.dtype or src.dim() != dst.dim() or shape[dim] != index.shape[0]:
        raise ValueError(f"src {src.dtype} {shape} does not fit dst {dst.dtype} {list(dst.shape)}")
    if shape[:dim] != list(dst.shape[:dim]) or shape[dim + 1 :] != list(dst.shape[dim + 1 :]):
        raise ValueError(f"src {shape} and dst {list(dst.shape)} differ outside dim {dim}")
    args = _kernel.ScatterArgs(
        outer=math.prod(shape[:dim]), n=shape[dim], num_dst=dst.shape[dim],
        num_threads=selection_threads(num_threads), isa=_ISA[settings().selection_isa],
        block_bytes=math.prod(shape[dim + 1 :]) * src.element_size(), src=src.data_ptr(),
        dst=dst.data_ptr(), index=index.data_ptr(),
    )  # fmt: skip
    _kernel.check(lib, lib.lib.herald_scatter_blocks(ctypes.byref(args)), "scatter_blocks")


class _torch_threads:
    """Run a block with torch.get_num_threads() == n (the fallback honours num_threads)."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


def kernel_info() -> dict[str, object]:
    """Which backend and ISA a call would use now, and where the library came from."""
    env = settings()
    lib = None if env.selection_backend == "torch" else _kernel.load_native()
    isa = env.selection_isa
    return {
        "backend": "native" if lib is not None else "torch",
        "library": lib.path if lib else None,
        "origin": lib.origin if lib else None,
        "cpu_avx512bf16": lib.has_avx512bf16 if lib else None,
        "isa": (isa if isa != "auto" else "avx512") if lib and lib.has_avx512bf16 else "portable",
        "unavailable_reason": _kernel.unavailable_reason() or None,
        "num_threads": selection_threads(),
        "prefetch": env.prefetch,
    }
