"""The bounded load test runs end to end at a small size and writes its JSON and README."""

from __future__ import annotations

import json

from herald.bench.serve_load import main


def test_serve_load_small(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--requests", "4", "--concurrency", "2"]
    assert main([*argv, "--max-tokens", "16", "--steps", "1", "--deadline", "60"]) == 0
    summary = json.loads((tmp_path / "serve.json").read_text())
    assert summary["completed"] == 4 and summary["generated_tokens"] > 0
    assert summary["latency_s"]["p50"] > 0
    assert "tokens/s" in (tmp_path / "README.md").read_text()
