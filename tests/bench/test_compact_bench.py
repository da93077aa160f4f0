"""herald.bench.compact at tiny sizes: the JSON it writes (synthetic and real-record modes)."""

from __future__ import annotations

import json

import pytest
import torch

from herald.bench import compact as bench
from herald.offload.selection.compact_cpu import best_isa

pytestmark = pytest.mark.skipif(best_isa() is None, reason="native library unavailable")


def test_synthetic_writes_points(tmp_path) -> None:
    out = tmp_path / "s.json"
    bench.main(
        ["synthetic", "--contexts", "512", "--requests", "2", "--groups", "1", "4",
         "--q-scales", "2", "--repeat", "1", "--out", str(out)]
    )  # fmt: skip
    points = json.loads(out.read_text())["points"]
    assert len(points) == 2 and {p["group"] for p in points} == {1, 4}
    for p in points:
        assert 0 < p["candidate_fraction_mean"] <= p["candidate_fraction_max"] <= 1
        assert p["bytes_per_request_block_compact_pass"] < p["bytes_per_request_block_exact"]


def test_real_mode_on_a_record(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    rec = {
        "keys": {i: torch.randn(2, 256, 64, generator=g).bfloat16() for i in range(3)},
        "queries": {i: torch.randn(32, 8, 64, generator=g).bfloat16() for i in range(3)},
        "prefix": 256, "block": 32, "files": {}, "tokens": 256, "seconds": 0.0,
    }  # fmt: skip
    path = tmp_path / "r.pt"
    torch.save(rec, path)
    out = tmp_path / "r.json"
    bench.main(["real", str(path), "--num-dense", "1", "--out", str(out)])
    items = json.loads(out.read_text())["items"]
    assert len(items) == 2 * 2 * 3  # layers 1, 2 x 2 heads x (representative, block, native)
    assert all(0 < it["candidate_fraction"] < 1 for it in items)
