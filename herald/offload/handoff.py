"""Block hand-offs between the GPU sparse pools and the CPU full KV pool, and page tables.

The main stream moves whole blocks of every offloaded layer at once: the draft group's KV and each
committed block's KV go to the CPU pool (:meth:`BlockHandoff.to_cpu`, one device-to-host copy
through pinned staging, then one host scatter into the pages), and the committed block becomes the
last completed block of the next pool (:func:`pool_blocks` reads it out of the active pool).
"""

from __future__ import annotations

import torch

from herald.kv.cpu_pool import CpuKVPool
from herald.kv.pinned import PinnedStaging, host_wait
from herald.kv.sparse_pool import GpuSparseKVPool
from herald.offload.selection.compact_cpu import update_compact
from herald.offload.selection.cpu import scatter_blocks


def pool_blocks(pool: GpuSparseKVPool, buffer: int, offsets: list[int], block: int) -> torch.Tensor:
    """Rows ``[offsets[i], offsets[i] + B)`` of slots ``0..n-1`` of every pooled layer of
    ``buffer``, K and V, as one new device tensor ``[L', 2, n, Hkv, B, D]``."""
    b, n = block, len(offsets)
    ks, vs = pool.all_k(buffer), pool.all_v(buffer)
    if all(o == offsets[0] for o in offsets):
        o = offsets[0]
        return torch.stack([ks[:, :n, :, o : o + b], vs[:, :n, :, o : o + b]], dim=1)
    return torch.stack(
        [
            torch.stack([t[:, i, :, o : o + b] for i, o in enumerate(offsets)], dim=1)
            for t in (ks, vs)
        ],
        dim=1,
    )


def page_table(tables: list[list[int]]) -> torch.Tensor:
    """Rows of page ids -> ``[n, max_len]`` int32, short rows padded with their last page (the
    selection kernel reads only the first ``ceil(S / B)`` entries of a row)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)


class BlockHandoff:
    """Writes blocks of every offloaded layer from the device into CPU pool pages.

    Owns one pinned staging buffer ``[L', 2, slots, Hkv, B, D]`` (the main stream's; nothing else
    writes it). Args: ``cpu_pool``; ``num_slots`` (rows at most per call); ``cuda``;
    ``num_threads``: the selection kernel's thread count (the host scatter runs on its threads;
    another count would rebuild its thread pool at every call).
    """

    def __init__(
        self, cpu_pool: CpuKVPool, num_slots: int, cuda: bool, num_threads: int | None = None
    ) -> None:
        p = cpu_pool
        numel = p.num_layers * 2 * num_slots * p.num_kv_heads * p.page_size * p.head_dim
        self.cpu_pool, self.cuda, self.num_threads = cpu_pool, cuda, num_threads
        self.staging = PinnedStaging(numel, p.dtype, cuda)

    def to_cpu(self, blocks: torch.Tensor, pages: list[int]) -> None:
        """Write ``blocks`` ``[L', 2, n, Hkv, B, D]`` (device) into CPU pool page ``pages[i]`` of
        every offloaded layer, for each row i. Synchronous: on return the pages hold the values
        (one device-to-host copy, then one host scatter)."""
        idx = torch.tensor(pages, dtype=torch.long)
        store = self.cpu_pool.storage
        if not self.cuda:
            host = blocks.to(store.dtype).contiguous()
        else:
            host = self.staging.take(blocks.shape)
            host.copy_(blocks, non_blocking=True)
            # NOTE: copy-before-read: the host scatter below reads the staging only after the
            # device-to-host copy completed; and since this call returns only then, the staging
            # is free for the next hand-off and every page written here is complete for any
            # reader (the selection kernel, the gathers, MAGE's host reads). Asleep, not
            # spinning (host_wait): a retrieval job may be selecting on every core meanwhile.
            host_wait(torch.cuda.current_stream(blocks.device))
        # The scatter runs on the selection kernel's threads, after any selection call in
        # progress (scatter_blocks says why not a parallel index_copy_).
        scatter_blocks(store, 2, idx, host, num_threads=self.num_threads)
        # The int8 copy of K, if the pool keeps one, follows the pages just written.
        update_compact(self.cpu_pool, idx, self.num_threads)

    def close(self) -> None:
        self.staging.close()
