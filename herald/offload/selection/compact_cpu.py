"""The compact first pass of the CPU selection, native: ``select_topk`` over the int8 copy of K.

:func:`select_topk_compact` takes ``select_topk``'s arguments plus the pool layer's int8 pages
and scales (:class:`~herald.kv.compact_keys.CompactKeys`) and returns exactly what
``select_topk`` returns: the C++ pass (herald/csrc/compact*.cpp; spec and proofs in
:mod:`herald.offload.selection.compact`) reads the int8 keys, re-reads in bf16 only the
candidates of a certified candidate set and the tail, and certifies the top-k; when any (request,
KV head) of the call is not certified, the call runs the exact kernel instead
(``stats.fallback``). So the indices always equal the exact kernel's; a certified call's attention
output is the exact softmax over the selected rows and the tail, computed from the re-read rows
(equal to the exact kernel's up to float32 rounding). ``output_mode="full"`` always runs the exact
kernel (it needs all of K and V).

:func:`quantize_pages` writes the int8 copy of pool pages (native, else the PyTorch quantizer:
the same bits); :func:`update_compact` is the hook the pool's writers call after writing K.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from herald.env import selection_threads, settings
from herald.kv.compact_keys import quantize_keys
from herald.kv.cpu_pool import CpuKVPool
from herald.offload.selection import _kernel, compact
from herald.offload.selection.cpu import gather_selected, select_topk
from herald.offload.selection.ref import SelectionResult, check_selection_inputs

ABI_VERSION = 1  # HERALD_COMPACT_ABI_VERSION in herald/csrc/herald_compact.h
_ISA = {"auto": 0, "avx512": 1, "portable": 2, "avx2": 3}
_p = ctypes.c_void_p


class QuantizeArgs(ctypes.Structure):
    """Mirror of ``herald_quantize_args``."""

    _fields_ = [
        *[(n, ctypes.c_int32) for n in ("num_layers", "num_kv_heads", "page_size", "head_dim")],
        ("n", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        *[(n, ctypes.c_int64) for n in ("num_pages", "k_layer_stride", "k_page_stride")],
        ("k_head_stride", ctypes.c_int64),
        *[(n, _p) for n in ("k", "pages", "q8", "scales")],
    ]


class CompactArgs(ctypes.Structure):
    """Mirror of ``herald_compact_args``."""

    _fields_ = [
        *[
            (n, ctypes.c_int32)
            for n in (
                "n_req",
                "n_q",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "page_size",
                "max_pages",
                "k_max",
                "s_max",
                "num_threads",
                "isa",
                "check_bounds",
            )
        ],  # fmt: skip
        ("radius_scale", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(n, ctypes.c_int64) for n in ("num_pages", "page_stride", "head_stride")],
        *[
            (n, _p)
            for n in (
                "q",
                "k_pages",
                "v_pages",
                "q8_pages",
                "scale_pages",
                "page_table",
                "seq_lens",
                "budget",
                "tail_lens",
                "indices",
                "num_selected",
                "attn_output",
                "status",
                "num_candidates",
                "candidates",
            )
        ],  # fmt: skip
    ]


_declared: set[int] = set()


def _lib() -> Any:
    """The native library with this module's entry points declared, or None."""
    native = _kernel.load_native()
    if native is None:
        return None
    lib = native.lib
    if id(lib) not in _declared:
        lib.herald_compact_abi_version.restype = ctypes.c_int32
        if lib.herald_compact_abi_version() != ABI_VERSION:
            return None
        lib.herald_compact_best_isa.restype = ctypes.c_int32
        lib.herald_quantize_keys.restype = ctypes.c_int32
        lib.herald_quantize_keys.argtypes = [ctypes.POINTER(QuantizeArgs)]
        lib.herald_compact_select.restype = ctypes.c_int32
        lib.herald_compact_select.argtypes = [ctypes.POINTER(CompactArgs)]
        lib.herald_compact_exp_error.restype = ctypes.c_double
        lib.herald_compact_exp_error.argtypes = [
            ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_double)
        ]  # fmt: skip
        _declared.add(id(lib))
    return lib


def _check(rc: int, what: str) -> None:
    native = _kernel.load_native()
    assert native is not None
    _kernel.check(native, rc, what)


def quantize_pages(
    k_layers: torch.Tensor,
    pages: torch.Tensor,
    q8: torch.Tensor,
    scales: torch.Tensor,
    *,
    num_threads: int | None = None,
) -> None:
    """Quantize pages ``pages`` (int64 ids) of K ``k_layers [L, num_pages, Hkv, P, D]`` bf16
    (each ``[P, D]`` slab contiguous) into ``q8 [L, num_pages, Hkv, P, D]`` int8 and
    ``scales [L, num_pages, Hkv, P]`` float32 (contiguous), every layer."""
    lib = _lib()
    if lib is None or not q8.is_contiguous() or not scales.is_contiguous():
        qk, s = quantize_keys(k_layers[:, pages])
        q8[:, pages], scales[:, pages] = qk, s
        return
    layers, num_pages, hkv, p, d = k_layers.shape
    idx = pages.to(torch.int64).contiguous()
    args = QuantizeArgs(
        num_layers=layers, num_kv_heads=hkv, page_size=p, head_dim=d, n=idx.numel(),
        num_threads=selection_threads(num_threads), num_pages=num_pages,
        k_layer_stride=k_layers.stride(0), k_page_stride=k_layers.stride(1),
        k_head_stride=k_layers.stride(2), k=k_layers.data_ptr(), pages=idx.data_ptr(),
        q8=q8.data_ptr(), scales=scales.data_ptr(),
    )  # fmt: skip
    _check(lib.herald_quantize_keys(ctypes.byref(args)), "quantize_keys")


def update_compact(
    pool: CpuKVPool, pages: list[int] | torch.Tensor, num_threads: int | None = None
) -> None:
    """After K of pool pages ``pages`` was written (every layer): refresh their int8 copy, if
    the pool keeps one (``first_pass="int8"``); a no-op otherwise."""
    if pool.compact is None:
        return
    idx = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
    if idx.numel():
        c = pool.compact
        quantize_pages(pool.storage[:, 0], idx, c.q8, c.scales, num_threads=num_threads)


def compact_args(pool: CpuKVPool, layer: int) -> dict[str, Any]:
    """``select_topk_compact``'s extra arguments for pool layer ``layer``; {} when the pool keeps
    no int8 copy (the caller then runs ``select_topk``)."""
    if pool.compact is None:
        return {}
    return {
        "k8_pages": pool.compact.k8_pages(layer),
        "scale_pages": pool.compact.scale_pages(layer),
    }


def select_topk_compact(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget_tokens: torch.Tensor,
    *,
    k8_pages: torch.Tensor,
    scale_pages: torch.Tensor,
    tail_lens: torch.Tensor | None = None,
    output_mode: str = "selected",
    num_threads: int | None = None,
    gather_out: torch.Tensor | None = None,
    stats_out: list[compact.CompactStats] | None = None,
    check_bounds: bool = True,
    radius_scale: float = 1.0,
    isa: str | None = None,
    candidates_out: torch.Tensor | None = None,
) -> SelectionResult:
    """``select_topk`` (same arguments and result; no importance) through the compact pass.

    ``k8_pages [num_pages, Hkv, P, D]`` int8 and ``scale_pages [num_pages, Hkv, P]`` float32:
    the int8 copy of ``k_pages`` (contiguous pool layer views). ``stats_out``: a list the call's
    :class:`~herald.offload.selection.compact.CompactStats` is appended to. ``candidates_out``:
    ``[n_req, Hkv, max S]`` uint8, receives the candidate masks (measurement). ``isa``: "auto",
    "avx512", "avx2" or "portable" (default: "portable" when ``HERALD_SELECTION_ISA`` says so,
    else "auto"). ``check_bounds`` and ``radius_scale`` are for tests only (a loosened bound
    must be caught).
    """
    exact_args = (q, k_pages, v_pages, page_table, seq_lens, budget_tokens)
    sh = check_selection_inputs(*exact_args, output_mode, False, tail_lens=tail_lens,
                                gather_out=gather_out)  # fmt: skip

    def exact() -> SelectionResult:
        return select_topk(*exact_args, tail_lens=tail_lens, output_mode=output_mode,
                           num_threads=num_threads, gather_out=gather_out)  # fmt: skip

    lib = _lib()
    shape = (sh.n_req, sh.num_kv_heads)
    if (
        output_mode != "selected"
        or sh.head_dim > compact.MAX_HEAD_DIM
        or sh.n_q * sh.group_size > 1024
    ):
        unsupported = torch.full(shape, compact.UNSUPPORTED, dtype=torch.int32)
        _record(stats_out, torch.zeros(shape, dtype=torch.int32), unsupported)
        return exact()
    res: SelectionResult | None
    if lib is None:  # the PyTorch reference (slow) decides; the exact call stays the kernel's
        res, st = compact.select_topk_compact_torch(
            q,
            k_pages,
            v_pages,
            k8_pages,
            scale_pages,
            page_table,
            seq_lens,
            budget_tokens,
            tail_lens=tail_lens,
        )
        ncand, status = st.num_candidates, st.status
    else:
        res, ncand, status = _native(
            lib, sh, exact_args, k8_pages, scale_pages, tail_lens, num_threads,
            (check_bounds, radius_scale, isa), candidates_out,
        )  # fmt: skip
    _record(stats_out, ncand, status)
    if res is None or bool((status != compact.CERTIFIED).any()):
        return exact()
    if gather_out is not None:
        gather_selected(k_pages, v_pages, page_table, res.indices, res.num_selected, gather_out,
                        num_threads=num_threads)  # fmt: skip
    return res


def _record(
    stats_out: list[compact.CompactStats] | None, ncand: torch.Tensor, status: torch.Tensor
) -> None:
    if stats_out is not None:
        fallback = bool((status != compact.CERTIFIED).any())
        stats_out.append(compact.CompactStats(ncand, status, fallback))


def _native(
    lib: Any,
    sh: Any,
    exact_args: tuple[torch.Tensor, ...],
    k8_pages: torch.Tensor,
    scale_pages: torch.Tensor,
    tail_lens: torch.Tensor | None,
    num_threads: int | None,
    debug: tuple[bool, float, str | None],
    candidates_out: torch.Tensor | None,
) -> tuple[SelectionResult, torch.Tensor, torch.Tensor]:
    """The native call on validated inputs: (result, num_candidates, status)."""
    q, k_pages, v_pages, page_table, seq_lens, budget = exact_args
    hkv, p, d = sh.num_kv_heads, sh.page_size, sh.head_dim
    want8 = (k_pages.shape[0], hkv, p, d)
    if (
        k8_pages.dtype != torch.int8
        or tuple(k8_pages.shape) != want8
        or not k8_pages.is_contiguous()
    ):
        raise ValueError(f"k8_pages must be contiguous int8 {list(want8)}")
    if (scale_pages.dtype != torch.float32 or tuple(scale_pages.shape) != want8[:3]
            or not scale_pages.is_contiguous()):  # fmt: skip
        raise ValueError(f"scale_pages must be contiguous float32 {list(want8[:3])}")
    if candidates_out is not None and (
        candidates_out.dtype != torch.uint8
        or tuple(candidates_out.shape) != (sh.n_req, hkv, sh.s_max)
    ):
        raise ValueError(f"candidates_out must be uint8 {[sh.n_req, hkv, sh.s_max]}")
    indices = torch.empty(sh.n_req, hkv, sh.k_max, dtype=torch.int32)
    num = torch.empty(sh.n_req, dtype=torch.int32)
    out = torch.empty(sh.n_req, sh.n_q, sh.num_heads, d, dtype=torch.float32)
    status = torch.empty(sh.n_req, hkv, dtype=torch.int32)
    ncand = torch.empty(sh.n_req, hkv, dtype=torch.int32)
    t = dict(q=q.contiguous(), page_table=page_table.contiguous(), seq_lens=seq_lens.contiguous(),
             budget=budget.contiguous())  # fmt: skip
    tail = tail_lens.contiguous() if tail_lens is not None else None
    check_bounds, radius_scale, isa = debug
    if isa is None:
        isa = "portable" if settings().selection_isa == "portable" else "auto"
    args = CompactArgs(
        n_req=sh.n_req, n_q=sh.n_q, num_heads=sh.num_heads, num_kv_heads=hkv, head_dim=d,
        page_size=p, max_pages=sh.max_pages, k_max=sh.k_max, s_max=sh.s_max,
        num_threads=selection_threads(num_threads), isa=_ISA[isa],
        check_bounds=int(check_bounds), radius_scale=radius_scale,
        scale=float(torch.tensor(d**-0.5, dtype=torch.float32)), num_pages=k_pages.shape[0],
        page_stride=k_pages.stride(0), head_stride=k_pages.stride(1), q=t["q"].data_ptr(),
        k_pages=k_pages.data_ptr(), v_pages=v_pages.data_ptr(), q8_pages=k8_pages.data_ptr(),
        scale_pages=scale_pages.data_ptr(), page_table=t["page_table"].data_ptr(),
        seq_lens=t["seq_lens"].data_ptr(), budget=t["budget"].data_ptr(),
        tail_lens=tail.data_ptr() if tail is not None else None, indices=indices.data_ptr(),
        num_selected=num.data_ptr(), attn_output=out.data_ptr(), status=status.data_ptr(),
        num_candidates=ncand.data_ptr(),
        candidates=candidates_out.data_ptr() if candidates_out is not None else None,
    )  # fmt: skip
    _check(lib.herald_compact_select(ctypes.byref(args)), "compact_select")
    return SelectionResult(indices, num, out), ncand, status


def compact_pass(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget_tokens: torch.Tensor,
    *,
    k8_pages: torch.Tensor,
    scale_pages: torch.Tensor,
    tail_lens: torch.Tensor | None = None,
    num_threads: int | None = None,
    isa: str | None = None,
    candidates_out: torch.Tensor | None = None,
) -> tuple[SelectionResult, compact.CompactStats]:
    """The native pass alone, without the exact fallback (measurement): its result, defined for
    the (request, KV head) items whose status is CERTIFIED, and its stats. RuntimeError without
    the native library."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("native selection library unavailable")
    exact_args = (q, k_pages, v_pages, page_table, seq_lens, budget_tokens)
    sh = check_selection_inputs(*exact_args, "selected", False, tail_lens=tail_lens)
    res, ncand, status = _native(
        lib, sh, exact_args, k8_pages, scale_pages, tail_lens, num_threads, (True, 1.0, isa),
        candidates_out,
    )  # fmt: skip
    return res, compact.CompactStats(ncand, status, bool((status != compact.CERTIFIED).any()))


def exp_bound_error(isa: str = "auto", stride: int = 1) -> tuple[float, float]:
    """(largest relative error of the native pass's exp, largest wrong-side excess of its
    bounds: must be < 0) over every ``stride``-th float32 in [-104, 0]."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("native selection library unavailable")
    side = ctypes.c_double()
    err = lib.herald_compact_exp_error(_ISA[isa], stride, ctypes.byref(side))
    return float(err), float(side.value)


def best_isa() -> str | None:
    """The kernels ``isa="auto"`` runs here ("avx512", "avx2", "portable"), None without the
    native library."""
    lib = _lib()
    return None if lib is None else {v: k for k, v in _ISA.items()}[lib.herald_compact_best_isa()]
