"""The MoE benchmark's tile sweep: its grid and its summary (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from herald.bench.moe import _cfg_str, main, summarize_sweep, sweep_grid


def test_sweep_grid_takes_every_dimension() -> None:
    grid = sweep_grid([16, 64], [128], [64], [4], [3, 4])
    got = sorted((c.block_m, c.block_k, c.block_n, c.num_warps, c.num_stages) for c in grid)
    assert got == [
        (16, 128, 64, 4, 3),
        (16, 128, 64, 4, 4),
        (64, 128, 64, 4, 3),
        (64, 128, 64, 4, 4),
    ]
    assert len(sweep_grid([64], [64])) == 3 * 2 * 3  # the default block_n, warps and stages


def _row(gemm: str, m: int, k: int, n: int, ms: float) -> dict[str, object]:
    cfg = {"block_m": m, "block_k": k, "block_n": n, "num_warps": 4, "num_stages": 3}
    return {"tokens": 32, "gemm": gemm, "config": cfg, "ms": ms, "tbps": 1.0}


def test_summary_ranks_numerics_choices_by_both_gemms() -> None:
    rows = [
        _row("gate_up", 64, 64, 128, 0.30),
        _row("gate_up", 16, 128, 64, 0.20),
        _row("gate_up", 16, 128, 128, 0.25),
        _row("down", 64, 64, 128, 0.10),
        _row("down", 16, 128, 64, 0.15),
        {"tokens": 32, "gemm": "down", "config": {}, "error": "out of resources"},
        {"tokens": 32, "gemm": "align", "method": "sort", "block_m": 64, "ms": 0.05},
        {"tokens": 32, "gemm": "align", "method": "count", "block_m": 64, "ms": 0.03},
    ]
    lines = summarize_sweep(rows)
    assert lines[0].startswith("  best gate_up: m16 k128 n64 w4 s3 0.200 ms")
    assert lines[1] == "  gate_up best per (block_m, block_k): 16x128 0.200, 64x64 0.300"
    assert lines[3] == "  down best per (block_m, block_k): 16x128 0.150, 64x64 0.100"
    assert lines[4] == "  alignment per block_m: 64 count 0.030, 64 sort 0.050"
    # gate_up + down per (block_m, block_k), fastest first: 16x128 0.35 before 64x64 0.40
    assert lines[5] == "  both GEMMs, best per (block_m, block_k): 16x128 0.350, 64x64 0.400"
    assert _cfg_str(rows[0]["config"]) == "m64 k64 n128 w4 s3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_the_benchmark_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "32", "--sweep", "--sweep-warps", "4"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
