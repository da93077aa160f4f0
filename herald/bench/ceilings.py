"""Throughput ceilings (the Fig. 5 analog of HERALD §III-B): machine probes and the formulas.

Each ceiling is "decoded tokens per second if this one resource were the only cost", for blocks
of B tokens decoded in T denoising steps, a prefix of S tokens and a budget of
k = ceil(budget x S) selected rows per KV head and offloaded layer (:func:`budget_rows`):

- **per-step fetch** (MAGE / AR-style offloading: the k selected rows of every offloaded layer
  cross PCIe at every denoising step): ``B / (T x k x bytes_per_token / pcie)``. The batch
  cancels: every request moves its own rows.
- **per-block fetch** (HERALD: once per block): ``B / (k x bytes_per_token / pcie)``.
- **CPU selection**, measured: ``batch x B / t_select_block`` where ``t_select_block`` is the
  selection kernel (+ the gather of the selected rows) over all offloaded layers at that batch;
  and its DRAM-speed ideal ``B x dram / (S x bytes_read_per_token)`` (the kernel streams K, and V
  too in the ``full`` output mode, once per block).
- **GPU forward**, measured: ``batch x B / (T x t_forward)`` with ``t_forward`` the median plain
  denoising forward at that batch (the commit forward, one more per block, is left out as in the
  paper's Fig. 5, so a measured throughput always sits below it).

``bytes_per_token`` = offloaded layers x 2 (K and V) x KV heads x head_dim x 2 bytes (bf16).
The probes measure PCIe host-to-device bandwidth (pinned, large copies) and DRAM read bandwidth
(all threads) in the same run as the throughput points.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

BF16_BYTES = 2
NAMES = {  # the report's names
    "per_step_fetch": "per-step fetch (budget)",
    "per_block_fetch": "per-block fetch (budget)",
    "full_kv_per_block_fetch": "per-block fetch (full KV)",
    "cpu_selection": "CPU selection (kernel, measured)",
    "cpu_selection_dram": "CPU selection at DRAM speed (estimate)",
    "gpu_forward": "GPU forward (measured)",
}


@dataclass(frozen=True)
class KVGeometry:
    """The per-token KV layout of a model's offloaded layers."""

    num_layers: int
    """Offloaded layers (the model's layers minus the dense ones kept on the GPU)."""
    num_kv_heads: int
    head_dim: int
    itemsize: int = BF16_BYTES

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all offloaded layers, in bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def selection_bytes_per_token(self, output_mode: str) -> int:
        """Bytes the selection kernel streams per prefix token and block: K for scoring, and V
        too when the ``full`` output mode computes attention over every position."""
        return self.bytes_per_token // (1 if output_mode == "full" else 2)


def budget_rows(budget: float, prefix: int) -> int:
    """k = ceil(budget x prefix), at most the prefix: the rows selected per KV head and
    offloaded layer at a budget (a fraction of the prefix), as the engines select them."""
    return min(prefix, math.ceil(budget * prefix))


def per_step_fetch_ceiling(
    block_size: int, steps: int, k_rows: int, geom: KVGeometry, pcie_gbs: float
) -> float:
    """tokens/s when the k selected rows are fetched over PCIe at every denoising step."""
    seconds_per_step = k_rows * geom.bytes_per_token / (pcie_gbs * 1e9)
    return block_size / (steps * seconds_per_step)


def per_block_fetch_ceiling(
    block_size: int, k_rows: int, geom: KVGeometry, pcie_gbs: float
) -> float:
    """tokens/s when the k selected rows are fetched once per block."""
    return block_size / (k_rows * geom.bytes_per_token / (pcie_gbs * 1e9))


def selection_ceiling(batch: int, block_size: int, seconds_per_block: float) -> float:
    """tokens/s when one selection pass (all layers, the whole batch) runs per block."""
    return batch * block_size / seconds_per_block


def selection_dram_ceiling(
    block_size: int, prefix: int, geom: KVGeometry, output_mode: str, dram_gbs: float
) -> float:
    """tokens/s when selection streams the prefix KV once per block at DRAM read speed."""
    return block_size * dram_gbs * 1e9 / (prefix * geom.selection_bytes_per_token(output_mode))


def forward_ceiling(batch: int, block_size: int, steps: int, forward_seconds: float) -> float:
    """tokens/s when T denoising forwards of ``forward_seconds`` each make one block."""
    return batch * block_size / (steps * forward_seconds)


def point_ceilings(
    rec: dict[str, Any], pcie_gbs: float | None, dram_gbs: float | None
) -> dict[str, float]:
    """Every ceiling computable for one measured point record (keys as in the report's tables).

    Fetch ceilings use the point's budget (offloading modes) and the full KV (``full_kv_*``);
    CPU selection needs the point's kernel timing; GPU forward its median forward.
    """
    geom = KVGeometry(**rec["kv_geometry"])
    b, t, s = rec["block_size"], rec["steps"], rec["context"]
    out: dict[str, float] = {}
    if pcie_gbs:
        out["full_kv_per_step_fetch"] = per_step_fetch_ceiling(b, t, s, geom, pcie_gbs)
        out["full_kv_per_block_fetch"] = per_block_fetch_ceiling(b, s, geom, pcie_gbs)
        if rec.get("budget"):
            k = budget_rows(rec["budget"], s)
            out["per_step_fetch"] = per_step_fetch_ceiling(b, t, k, geom, pcie_gbs)
            out["per_block_fetch"] = per_block_fetch_ceiling(b, k, geom, pcie_gbs)
    sel = rec.get("selection_kernel")
    if sel:
        out["cpu_selection"] = selection_ceiling(rec["batch"], b, sel["block_s"])
        if dram_gbs:
            out["cpu_selection_dram"] = selection_dram_ceiling(
                b, s, geom, sel["output_mode"], dram_gbs
            )
    if rec.get("forward_median_s"):
        out["gpu_forward"] = forward_ceiling(rec["batch"], b, t, rec["forward_median_s"])
    return out


# -- probes -------------------------------------------------------------------------------------


def pcie_bandwidth(nbytes: int = 1 << 30, reps: int = 3) -> dict[str, float] | None:
    """Pinned host <-> device copy bandwidth in GB/s (1e9 B/s), best of ``reps``; None without
    CUDA. One contiguous buffer of ``nbytes`` each way."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gbs", dev, host), ("d2h_gbs", host, dev)):
        best = math.inf
        for _ in range(reps + 1):  # the first copy warms up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


def dram_bandwidth(gib: float) -> dict[str, float]:
    """DRAM read bandwidth in GB/s over a ``gib``-sized array (all threads and one thread), the
    selection-kernel benchmark's probe (:func:`herald.bench.kernel.dram_bandwidth`)."""
    from herald.bench.kernel import dram_bandwidth as probe
    from herald.env import settings, usable_cpus

    threads = settings().selection_threads or usable_cpus()
    old = torch.get_num_threads()
    try:
        return probe(math.ceil(gib * 256) / 256, threads)  # whole 4 MiB units (float32 view)
    finally:
        torch.set_num_threads(old)
