"""The selection-kernel benchmark script runs end to end at tiny sizes (``--smoke``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from herald.bench import kernel


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kernel.main(["--smoke", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "kernel.json").read_text())
    assert res["smoke"] and res["dram"]["reference_gbs"] > 0
    assert all(c["ok"] is not False for c in res["checks"]), res["checks"]
    paths = {(r["path"], r["mode"]) for r in res["runs"]}
    assert paths == {(p, m) for p in ("fused", "naive") for m in ("full", "selected")}
    assert set(res["summary"]) == {"dram_reference_gbs", "bandwidth", "query_speedup", "vs_naive"}
    readme = (tmp_path / "README.md").read_text()
    assert "## Targets" in readme and "fused beats naive" in readme
    assert "DRAM" in capsys.readouterr().out
    # the report can be rebuilt from the JSON alone
    (tmp_path / "README.md").unlink()
    kernel.main(["--report", str(tmp_path)])
    assert (tmp_path / "README.md").exists()
