"""Ceiling formulas on known numbers, and against the paper's Fig. 5 figures."""

from __future__ import annotations

import pytest

from herald.bench import ceilings as c

LLADA_OFFLOADED = c.KVGeometry(num_layers=18, num_kv_heads=4, head_dim=128)


def test_geometry_bytes():
    assert LLADA_OFFLOADED.bytes_per_token == 18 * 2 * 4 * 128 * 2 == 36864
    assert LLADA_OFFLOADED.selection_bytes_per_token("full") == 36864  # K and V
    assert LLADA_OFFLOADED.selection_bytes_per_token("selected") == 18432  # K only
    assert c.budget_rows(0.05, 32768) == 1639  # ceil(1638.4)
    assert c.budget_rows(1.0, 100) == 100 and c.budget_rows(0.5, 3) == 2


def test_formulas_on_known_numbers():
    g = LLADA_OFFLOADED
    # 1639 rows x 36864 B = 60.4 MB per request per step; at 55 GB/s: 1.0986 ms per step
    per_step = c.per_step_fetch_ceiling(32, 20, 1639, g, 55.0)
    assert per_step == pytest.approx(32 * 55e9 / (20 * 1639 * 36864))
    assert per_step == pytest.approx(1456.4, rel=1e-4)
    assert c.per_block_fetch_ceiling(32, 1639, g, 55.0) == pytest.approx(20 * per_step)
    assert c.selection_ceiling(64, 32, 0.5) == 4096
    assert c.selection_dram_ceiling(32, 32768, g, "full", 95.0) == pytest.approx(
        32 * 95e9 / (32768 * 36864)
    )
    assert c.selection_dram_ceiling(32, 32768, g, "selected", 95.0) == pytest.approx(
        2 * c.selection_dram_ceiling(32, 32768, g, "full", 95.0)
    )
    assert c.forward_ceiling(64, 32, 20, 0.05) == 2048


def test_formulas_reproduce_the_papers_fig5():
    """The paper (LLaDA2.0-mini 32K, all 20 layers' KV, T = 20, PCIe 4 at ~27.7 GB/s): full-KV
    per-step fetch 33 tokens/s, 5% per-step 660, 5% per-block 13.2K."""
    g = c.KVGeometry(num_layers=20, num_kv_heads=4, head_dim=128)
    s, pcie = 32768, 27.7
    assert c.per_step_fetch_ceiling(32, 20, s, g, pcie) == pytest.approx(33, rel=0.02)
    k = c.budget_rows(0.05, s)
    assert c.per_step_fetch_ceiling(32, 20, k, g, pcie) == pytest.approx(660, rel=0.02)
    assert c.per_block_fetch_ceiling(32, k, g, pcie) == pytest.approx(13200, rel=0.02)


def test_point_ceilings_of_a_record():
    rec = {
        "kv_geometry": {"num_layers": 18, "num_kv_heads": 4, "head_dim": 128},
        "block_size": 32, "steps": 20, "context": 32768, "batch": 64, "budget": 0.05,
        "selection_kernel": {"block_s": 0.5, "output_mode": "full"},
        "forward_median_s": 0.05,
    }  # fmt: skip
    got = c.point_ceilings(rec, pcie_gbs=55.0, dram_gbs=95.0)
    assert set(got) == {
        "full_kv_per_step_fetch", "full_kv_per_block_fetch", "per_step_fetch",
        "per_block_fetch", "cpu_selection", "cpu_selection_dram", "gpu_forward",
    }  # fmt: skip
    assert got["per_step_fetch"] == pytest.approx(1456.4, rel=1e-4)
    assert got["cpu_selection"] == 4096 and got["gpu_forward"] == 2048
    # dense points: no budget, no kernel; without the probes only the forward ceiling is left
    dense = {**rec, "budget": None, "selection_kernel": None}
    assert set(c.point_ceilings(dense, None, None)) == {"gpu_forward"}
