"""The selected rows fetched by the GPU straight from the pinned CPU pool (zero-copy).

HERALD's retrieval stream must bring each offloaded layer's selected K/V rows into the idle
sparse pool (HERALD §IV-B3). The CPU path (``HERALD_FETCH=cpu``; the default without CUDA or
Triton) has the selection kernel copy them into pinned staging, then one host-to-device copy per
tensor: the CPU reads every selected row and writes it again, time the selection threads then
lack (at LLaDA2.0-mini 32K, batch 80, 5% budget: 268 MB read and written per layer).

Here (``HERALD_FETCH=gpu``, and the default ``auto`` on CUDA with Triton) the CPU only selects.
Measured at that point on an H100 host, alternately in two calls: 2,505-2,664 tok/s against
1,949-2,530 with the CPU path, the block's stall 0.07-0.15 s against 0.16-0.38 s
(results/offload/gpu_fetch/). The pool's pages are page-locked with
``cudaHostRegister``, which on a machine with unified addressing also maps them into the GPU's
address space, so a GPU kernel can read them over PCIe with ordinary loads: :func:`fetch_rows`
takes the selected positions (``[n, Hkv, k_max]`` int32, copied to the GPU), translates each
through the request's page table and copies its K and V rows into pool rows ``[0, k_r)``, and
writes zeros into rows ``[k_r, m)`` (``m`` the largest ``k_r``), as the CPU path's copy and
masked fill leave them. It runs on a fixed number of programs (:data:`PROGRAMS`) that loop over
the work, so it keeps enough reads in flight to fill PCIe without taking the SMs the main
stream's forward needs.

On the CPU (the Triton interpreter) the same kernel runs on plain CPU tensors: the tests check
it there against :func:`reference_rows`.
"""

from __future__ import annotations

import torch

from herald.layers.moe_triton import interpreting, triton_available

ROWS = 32  # selected rows per program iteration
PROGRAMS = 48  # programs in the grid: each loops over tiles of ROWS rows of one (request, head)
NUM_WARPS = 4


def gpu_fetch_available(device: torch.device) -> bool:
    """The kernel can run: Triton present and a CUDA device (or the interpreter)."""
    return triton_available() and (device.type == "cuda" or interpreting())


def fetch_rows(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    indices: torch.Tensor,
    num_selected: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    rows: int,
) -> None:
    """Selected rows of one layer -> rows ``[0, k_r)`` of each request's pool slot; zeros in
    ``[k_r, rows)``.

    Args:
        k_pages, v_pages: ``[num_pages, Hkv, page_size, D]`` bf16/fp16 of one pool layer, page-
            locked and device-mapped on CUDA (:func:`herald.kv.pinned.register_pinned`), each
            ``[page_size, D]`` slab contiguous, equal strides.
        page_table: ``[n, max_pages]`` int32 on the kernel's device; position ``s`` of request
            ``r`` is row ``s % page_size`` of page ``page_table[r, s // page_size]``.
        indices: ``[n, Hkv, k_max]`` int32 on the device, the selected positions
            (:func:`herald.offload.selection.cpu.select_topk`'s; entries ``>= num_selected[r]``
            are not read).
        num_selected: ``[n]`` int32 on the device, each in ``[0, rows]``.
        k_dst, v_dst: ``[slots >= n, Hkv, capacity >= rows, D]`` on the device, equal strides,
            last dimension contiguous: the idle pool's buffers of this layer.
        rows: ``m``, the largest ``num_selected`` (rows written per request and head).

    Asynchronous on the current CUDA stream. The caller keeps the CPU pages unchanged and the
    device tensors alive until the stream has passed this call.

    Raises:
        ValueError: shapes, strides or dtypes that do not fit, or ``D`` not a power of two.
    """
    n, hkv, k_max = indices.shape
    _, hkv_p, page, d = k_pages.shape
    if (
        hkv_p != hkv
        or v_pages.shape != k_pages.shape
        or v_pages.stride() != k_pages.stride()
        or k_pages.stride(3) != 1
        or k_pages.stride(2) != d
        or d & (d - 1)
        or page_table.shape[0] != n
        or num_selected.shape != (n,)
        or k_dst.shape != v_dst.shape
        or k_dst.stride() != v_dst.stride()
        or k_dst.stride(3) != 1
        or k_dst.shape[0] < n
        or k_dst.shape[1] != hkv
        or k_dst.shape[3] != d
        or not 0 <= rows <= min(k_max, k_dst.shape[2])
        or k_dst.dtype != k_pages.dtype
        or not (page_table.dtype == indices.dtype == num_selected.dtype == torch.int32)
    ):
        raise ValueError(
            f"fetch_rows: pages {tuple(k_pages.shape)} strides {k_pages.stride()}, indices "
            f"{tuple(indices.shape)}, table {tuple(page_table.shape)}, pool "
            f"{tuple(k_dst.shape)} {k_dst.dtype}, rows {rows}"
        )
    tiles = -(-rows // ROWS)
    total = n * hkv * tiles
    if total == 0:
        return
    from herald.offload import _gpu_fetch_kernel as kern

    indices, page_table, num_selected = (
        indices.contiguous(),
        page_table.contiguous(),
        num_selected.contiguous(),
    )
    kern.fetch_rows[(min(total, PROGRAMS),)](
        k_pages, v_pages, page_table, indices, num_selected, k_dst, v_dst,
        total, tiles, rows,
        k_pages.stride(0), k_pages.stride(1), page_table.stride(0), indices.stride(0),
        indices.stride(1), k_dst.stride(0), k_dst.stride(1), k_dst.stride(2),
        HKV=hkv, PAGE=page, D=d, ROWS=ROWS, num_warps=NUM_WARPS,
    )  # fmt: skip


def reference_rows(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    indices: torch.Tensor,
    num_selected: torch.Tensor,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`fetch_rows` writes, in PyTorch on the CPU: ``[n, Hkv, rows, D]`` K and V
    (gathered rows, then zeros)."""
    n, hkv, _ = indices.shape
    page, d = k_pages.shape[2], k_pages.shape[3]
    k = torch.zeros(n, hkv, rows, d, dtype=k_pages.dtype)
    v = torch.zeros_like(k)
    for r in range(n):
        for h in range(hkv):
            for j in range(int(num_selected[r])):
                s = int(indices[r, h, j])
                p = int(page_table[r, s // page])
                k[r, h, j] = k_pages[p, h, s % page]
                v[r, h, j] = v_pages[p, h, s % page]
    return k, v
