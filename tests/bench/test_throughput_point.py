"""One throughput point: the dense engine's rehearsal pass."""

from __future__ import annotations

import json

from herald.bench import throughput, throughput_point

FAST = ["--device", "cpu", "--steps", "3", "--warmup-blocks", "1", "--timed-blocks", "1",
        "--dram-probe-gib", "0.004", "--selection-threads", "2"]  # fmt: skip


def test_a_dense_point_times_a_second_pass_over_the_same_shapes(tmp_path, monkeypatch):
    # The dense engine's key length grows per block, so a first pass pays one-time attention
    # plans for each length; the timed pass decodes the same lengths again, fresh requests.
    real, passes = throughput_point.run_blocks, []

    def spy(engine, reqs, ps, steps):
        out = real(engine, reqs, ps, steps)
        passes.append(([id(r) for r in reqs], [len(r.prompt_ids) for r in reqs], out))
        return out

    monkeypatch.setattr(throughput_point, "run_blocks", spy)
    argv = ["--model", "tiny-sdar", "--context", "256", "--mode", "dense,herald",
            "--batches", "2", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    (ids1, lens1, first), (ids2, lens2, timed), (_, _, herald) = passes
    assert lens1 == lens2 == [256, 256] and not set(ids1) & set(ids2)
    lines = (tmp_path / throughput.JSONL_NAME).read_text().splitlines()
    dense, offload = [r for r in map(json.loads, lines) if r["kind"] == "point"]
    assert dense["variant"] == "dense" and "rehearsal" not in offload
    assert dense["rehearsal"]["decode_tokens_per_s"] == first["decode_tokens_per_s"]
    assert dense["decode_tokens_per_s"] == timed["decode_tokens_per_s"]
    # the timed pass's own counts: one block of B tokens per request, one synthetic prefill
    assert dense["generated_tokens"] == 2 * dense["block_size"]
    assert dense["prefill_tokens"] == 2 * 256
