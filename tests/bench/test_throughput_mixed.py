"""``--mixed-contexts``: every point measured twice, uniform then with each request at its own
context; the mixed points' records and their own rows in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from herald.bench import throughput, throughput_point
from herald.bench.throughput_plan import CAP_H100, K32, LLADA, mixed_context_lengths
from herald.bench.throughput_report import write_report

# --dram-reserve-gb 0: the CPU pool and the DRAM check must not depend on how much memory the
# machine has free (a loaded 2-core box had less than the 16 GiB default reserve)
FAST = ["--device", "cpu", "--steps", "3", "--warmup-blocks", "1", "--timed-blocks", "1",
        "--dram-probe-gib", "0.004", "--selection-threads", "2",
        "--dram-reserve-gb", "0"]  # fmt: skip


def _points(out: Path) -> list[dict]:
    lines = (out / throughput.JSONL_NAME).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "point"]


@pytest.mark.parametrize(
    ("context", "batch", "block"),
    [(512, 2, 32), (512, 3, 32), (32768, 80, 32), (16384, 7, 32), (256, 16, 4), (100, 5, 4),
     (32, 4, 32), (64, 3, 32), (512, 1, 32)],
)  # fmt: skip
def test_mixed_lengths_are_whole_blocks_spread_over_half_the_context(context, batch, block):
    got = mixed_context_lengths(context, batch, block)
    assert got == mixed_context_lengths(context, batch, block)  # deterministic
    assert len(got) == batch and got[0] == max(got) == context
    assert min(got) >= context / 2
    assert all((context - n) % block == 0 for n in got)  # whole blocks shorter than the context
    assert got == sorted(got, reverse=True)
    steps = {(a - b) // block for a, b in zip(got, got[1:], strict=False)}
    assert len(steps) <= 2 and max(steps, default=0) - min(steps, default=0) <= 1  # evenly
    if batch > 1 and context // 2 >= block:  # the last request is as short as whole blocks allow
        assert min(got) - context / 2 < block


def test_mixed_lengths_examples():
    assert mixed_context_lengths(512, 1, 32) == [512]
    assert mixed_context_lengths(512, 2, 32) == [512, 256]
    assert mixed_context_lengths(512, 3, 32) == [512, 384, 256]
    assert mixed_context_lengths(512, 5, 32) == [512, 448, 384, 320, 256]
    assert mixed_context_lengths(32, 3, 32) == [32, 32, 32]  # one block: nothing to take off


def test_each_point_is_measured_uniform_then_mixed(tmp_path, monkeypatch):
    """A folder of uniform points (from before the flag) gets its mixed twins, batch by batch
    after the uniform point; the mixed requests' prompts have their own lengths, everything else
    is the uniform point's."""
    real, passes = throughput_point.run_blocks, []

    def spy(engine, reqs, ps, steps):
        passes.append([len(r.prompt_ids) for r in reqs])
        return real(engine, reqs, ps, steps)

    monkeypatch.setattr(throughput_point, "run_blocks", spy)
    base = ["--model", "tiny-sdar", "--context", "256", "--mode", "dense,herald",
            "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main([*base, "--batches", "2"]) == 0
    old = _points(tmp_path)
    assert [p["variant"] for p in old] == ["dense", "herald"]
    assert not any("contexts" in p for p in old)  # uniform records look as they always did
    passes.clear()
    assert throughput.main([*base, "--batches", "1,2", "--mixed-contexts"]) == 0
    new = _points(tmp_path)[2:]
    assert [(p["variant"], p.get("contexts", "uniform"), p["batch"]) for p in new] == [
        ("dense", "uniform", 1), ("dense", "mixed", 1), ("dense", "mixed", 2),
        ("herald", "uniform", 1), ("herald", "mixed", 1), ("herald", "mixed", 2),
    ]  # fmt: skip
    # dense and HERALD rehearse: two passes over the same prompts per point
    assert passes == [[256], [256], [256], [256], [256, 128], [256, 128]] * 2
    for p in new:
        assert p["status"] == "ok" and p["context"] == 256 and p["steps"] == 3
        assert p["generated_tokens"] == p["batch"] * p["block_size"]
        if p.get("contexts") == "mixed":
            lens = mixed_context_lengths(256, p["batch"], p["block_size"])
            assert p["mean_context"] == sum(lens) / p["batch"]
            assert p["min_context"] == min(lens) == (256 if p["batch"] == 1 else 128)
            assert p["prefill_tokens"] == sum(lens)
        else:
            assert "mean_context" not in p and p["prefill_tokens"] == p["batch"] * 256
    mixed_herald = [p for p in new if p["variant"] == "herald" and p.get("contexts")]
    assert all(p["selection_kernel"]["block_s"] > 0 for p in mixed_herald)
    # every point of both kinds is done now; without the flag, the mixed ones are not asked for
    passes.clear()
    assert throughput.main([*base, "--batches", "1,2", "--mixed-contexts"]) == 0
    assert throughput.main([*base, "--batches", "1,2"]) == 0
    assert passes == [] and len(_points(tmp_path)) == 8
    readme = (tmp_path / "README.md").read_text()
    sweeps = readme.split("## Every sweep")[1].split("\n## ")[0]
    assert "| tiny-sdar | 256 | dense | - | - | 3 | 1, 2 |" in sweeps
    assert "| tiny-sdar | 256 | dense (mixed) | - | - | 3 | 1, 2 |" in sweeps
    assert "| tiny-sdar | 256 | herald (mixed) | 0.050 | - | 3 | 1, 2 |" in sweeps
    table = readme.split("## Uniform vs mixed contexts")[1].split("\n## ")[0]
    assert "| tiny-sdar | 256 | herald | 0.050 | - | 3 | 2 | 192 / 128 |" in table
    assert "| tiny-sdar | 256 | dense | - | - | 3 | 1 | 256 / 256 |" in table
    assert "| tiny-sdar | 256 | herald (mixed) | 0.050 | - | 3 | 2 | ok |" in readme


def test_a_mixed_point_that_does_not_fit_ends_its_own_sweep(tmp_path, monkeypatch):
    real = throughput_point.build_engine

    def flaky(ps, sweep, batch):
        if sweep.contexts == "mixed" and batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(ps, sweep, batch)

    monkeypatch.setattr(throughput_point, "build_engine", flaky)
    argv = ["--model", "tiny-sdar", "--context", "128", "--mode", "dense", "--batches", "1,2,3",
            "--mixed-contexts", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    got = [(p.get("contexts", "uniform"), p["batch"], p["status"]) for p in _points(tmp_path)]
    assert got == [("uniform", 1, "ok"), ("mixed", 1, "ok"), ("uniform", 2, "ok"),
                   ("mixed", 2, "oom"), ("uniform", 3, "ok")]  # fmt: skip
    oom = _points(tmp_path)[3]
    assert oom["contexts"] == "mixed" and oom["min_context"] == 64 and oom["mean_context"] == 96
    readme = (tmp_path / "README.md").read_text()
    assert "| tiny-sdar | 128 | dense (mixed) | - | - | 3 | 1, 2 |" in readme
    assert "| 3 | 2 | 96 / 64 |" in readme and "| oom |" in readme


def test_the_report_keeps_mixed_points_out_of_the_uniform_tables(tmp_path):
    """Mixed points of the Table II sweeps, faster than the uniform ones: every table but the
    sweeps, the points and their own section renders as without them."""
    from test_throughput_report import _point, write_fixture

    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    for out in (plain, mixed):
        out.mkdir()
        write_fixture(out)
    with (mixed / throughput.JSONL_NAME).open("a") as f:
        for v, budget, batch in (("dense", None, 16), ("herald", 0.05, 64)):
            rec = _point(LLADA, K32, v, budget, batch, 9999.0, cap=CAP_H100)
            rec.update(contexts="mixed", mean_context=24576.0, min_context=16384,
                       rehearsal={"decode_tokens_per_s": 9000.0})  # fmt: skip
            f.write(json.dumps(rec) + "\n")
    a, b = (write_report(out).read_text() for out in (plain, mixed))
    assert "mixed" not in a
    head_a, head_b = (t.split("## Every sweep")[0] for t in (a, b))
    assert head_a == head_b and "9999" not in head_b
    table = b.split("## Uniform vs mixed contexts")[1].split("\n## ")[0]
    rows = [r for r in table.splitlines() if r.startswith(f"| {LLADA} |")]
    assert rows == [
        f"| {LLADA} | {K32} | dense | - | 80.0 | 20 | 16 | 24576 / 16384 | 1100 | 9999 | 9.09 "
        f"| {16 * 32 / 1100 / 21 * 1e3:.1f} | {16 * 32 / 9999 / 21 * 1e3:.1f} | - | - |",
        f"| {LLADA} | {K32} | herald | 0.050 | 80.0 | 20 | 64 | 24576 / 16384 | 2500 | 9999 "
        f"| 4.00 | {64 * 32 / 2500 / 21 * 1e3:.1f} | {64 * 32 / 9999 / 21 * 1e3:.1f} "
        f"| {64 * 32 / 2500:.2f} | {64 * 32 / 9999:.2f} |",
    ]
    assert f"| {LLADA} | {K32} | herald (mixed) | 0.050 | 80.0 | 20 | 64 |" in b
    # the mixed sweeps are rows of their own, after the uniform sweep of the same variant
    sweeps = b.split("## Every sweep")[1]
    assert sweeps.index("| herald | 0.050 | 80.0 | 20 |") < sweeps.index("| herald (mixed) |")


def test_mixed_twins_plan_like_their_uniform_sweeps(tmp_path):
    """A mixed twin has the plan's batches, waits for the same references, measures a peak
    sweep at the uniform sweep's peak batch and is done only by mixed records."""
    from dataclasses import replace

    from test_throughput_plan import _point as plan_point
    from test_throughput_plan import runner_of_the_whole_plan

    run, by = runner_of_the_whole_plan(tmp_path, "--mixed-contexts")
    t20 = by[("table2", K32, "herald", 20, CAP_H100)]
    t8 = by[("fig14", K32, "herald", 8, CAP_H100)]
    m20, m8 = run.twins(t20)[1], run.twins(t8)[1]
    assert run.twins(t20) == [t20, replace(t20, contexts="mixed")] and m20.key != t20.key
    assert "mixed contexts" in m20.label and "mixed" not in t20.label
    assert run.plan_sweep(m8) == ("defer", [])  # the uniform T = 20 peak decides its batch
    assert run.plan_sweep(m20) == ("run", list(t20.batches))
    tps = {16: 900.0, 32: 1500.0, 48: 1800.0}
    run.records += [plan_point(t20, b, tps=t) for b, t in tps.items()]
    run.records.append(plan_point(t20, 64, "dram"))
    assert run.plan_sweep(t20) == ("done", [])
    assert run.plan_sweep(m20) == ("run", list(t20.batches))  # uniform records do not count
    assert run.plan_sweep(m8) == ("run", [48])
    # the mixed sweep peaks at another batch (16) than the uniform one (48)
    mixed = [{**plan_point(t20, b, tps=2000.0 if b == 16 else 100.0), "contexts": "mixed"}
             for b in tps]  # fmt: skip
    run.records += [*mixed, {**plan_point(t20, 64, "dram"), "contexts": "mixed"}]
    assert run.plan_sweep(m20) == ("done", [])
    assert run.plan_sweep(m8) == ("run", [48])  # still the uniform peak, not the mixed one
