"""The bounded load test runs end to end at a small size and writes its JSON and README."""

from __future__ import annotations

import json

from herald.bench.serve_load import main


def test_serve_load_small(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--requests", "4", "--concurrency", "2"]
    small = ["--max-tokens", "16", "--steps", "1", "--deadline", "300"]  # a bound, not a pace
    assert main([*argv, *small]) == 0
    summary = json.loads((tmp_path / "serve.json").read_text())
    assert summary["completed"] == 4 and summary["generated_tokens"] > 0
    assert summary["latency_s"]["p50"] > 0
    assert main([*argv, *small, "--mode", "herald"]) == 0
    offload = json.loads((tmp_path / "serve-herald.json").read_text())
    assert offload["completed"] == 4 and offload["kv_budget"] == 0.05
    readme = (tmp_path / "README.md").read_text()
    assert "tokens/s" in readme and "| dense | 1.0 |" in readme and "| herald | 0.05 |" in readme
