"""The throughput benchmark's sweeps on tiny presets on the CPU: records, failures, resume, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import user_error

from herald.bench import throughput, throughput_point
from herald.bench.throughput_point import classify_failure
from herald.kv.cpu_pool import CpuPoolFullError

# Fast settings: one warm-up block, one timed block, T = 3, tiny DRAM probe.
# --dram-reserve-gb 0: the CPU pool and the DRAM check must not depend on how much memory the
# machine has free (a loaded 2-core box had less than the 16 GiB default reserve)
FAST = ["--device", "cpu", "--steps", "3", "--warmup-blocks", "1", "--timed-blocks", "1",
        "--dram-probe-gib", "0.004", "--selection-threads", "2",
        "--dram-reserve-gb", "0"]  # fmt: skip
POINT_FIELDS = {
    "kind", "run_id", "model", "context", "variant", "mode", "budget", "gpu_cap_gb", "steps",
    "block_size", "batch", "status", "decode_tokens_per_s", "decode_seconds", "generated_tokens",
    "forward_median_s", "step_seconds", "prefill_seconds", "kv_geometry", "wall_seconds",
    "device", "prefill",
}  # fmt: skip


def _records(out: Path, kind: str = "point") -> list[dict]:
    lines = (out / throughput.JSONL_NAME).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize(("preset", "context"), [("tiny-llada2", 256), ("tiny-sdar", 512)])
def test_sweep_writes_points_for_dense_and_herald(tmp_path, preset, context):
    argv = ["--model", preset, "--context", str(context), "--mode", "dense,herald",
            "--batches", "1,2", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    pts = _records(tmp_path)
    assert [(p["variant"], p["batch"]) for p in pts] == [
        ("dense", 1), ("dense", 2), ("herald", 1), ("herald", 2)
    ]  # fmt: skip
    for p in pts:
        assert set(p) >= POINT_FIELDS, POINT_FIELDS - set(p)
        assert p["status"] == "ok" and p["context"] == context and p["steps"] == 3
        # one timed block: every request generated its B tokens, T + 1 forwards (commit)
        assert p["generated_tokens"] == p["batch"] * p["block_size"]
        assert p["steps_per_block"] == [4]
        assert p["decode_tokens_per_s"] == pytest.approx(
            p["generated_tokens"] / p["decode_seconds"]
        )
        assert p["prefill"] == "synthetic" and p["prefill_tokens"] == p["batch"] * context
    herald = [p for p in pts if p["variant"] == "herald"]
    for p in herald:
        assert p["budget"] == 0.05 and len(p["block_retrieval_s"]) == 1
        sel = p["selection_kernel"]
        assert sel["n_q"] == 1 and sel["block_s"] > 0 and sel["num_layers"] == 2
        (parts,) = p["block_retrieval_parts_s"]
        assert set(parts) == {"query_to_host", "kernel", "gather_copy"} and parts["kernel"] > 0
    assert _records(tmp_path, "run")[0]["command"]
    machine = _records(tmp_path, "machine")[0]
    assert machine["pcie"] is None and machine["dram"]["reference_gbs"] > 0
    assert "Every sweep" in (tmp_path / "README.md").read_text()


def test_injected_oom_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real = throughput_point.build_engine

    def flaky(ps, sweep, batch):
        if batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(ps, sweep, batch)

    monkeypatch.setattr(throughput_point, "build_engine", flaky)
    argv = ["--model", "tiny-llada2", "--context", "256", "--mode", "dense,herald",
            "--batches", "1,2,3", "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    got = [(p["variant"], p["batch"], p["status"]) for p in _records(tmp_path)]
    # batch 3 is not tried: the sweep ended at its first out-of-memory point
    assert got == [("dense", 1, "ok"), ("dense", 2, "oom"), ("herald", 1, "ok"),
                   ("herald", 2, "oom")]  # fmt: skip
    assert "OutOfMemoryError" in _records(tmp_path)[1]["error"]
    readme = (tmp_path / "README.md").read_text()
    assert "GPU OOM at bs 2" in readme
    # a rerun has nothing left to do: failures count as measured
    monkeypatch.setattr(throughput_point, "build_engine", real)
    assert throughput.main(argv) == 0
    assert len(_records(tmp_path)) == 4


def test_dense_sweep_narrows_its_oom_end(tmp_path, monkeypatch):
    """The dense baseline runs at (nearly) the largest batch that fits: an OOM end more than 8
    batches past the last fit is bisected (here the GPU holds batches below 12)."""
    real = throughput_point.build_engine

    def small_gpu(ps, sweep, batch):
        if batch >= 12:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(ps, sweep, batch)

    monkeypatch.setattr(throughput_point, "build_engine", small_gpu)
    argv = ["--model", "tiny-sdar", "--context", "64", "--mode", "dense", "--batches", "1,33",
            "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    got = [(p["batch"], p["status"]) for p in _records(tmp_path)]
    assert got == [(1, "ok"), (33, "oom"), (17, "oom"), (9, "ok")]
    assert "GPU OOM at bs 17" in (tmp_path / "README.md").read_text()
    assert throughput.main(argv) == 0  # resumed: 9 and 17 are 8 apart, nothing left
    assert len(_records(tmp_path)) == 4


def test_refine_batch_rules():
    from herald.bench.throughput_records import refine_batch

    def recs(**kw):
        return {int(b[1:]): {"status": st} for b, st in kw.items()}

    assert refine_batch(recs(b48="ok", b64="oom")) == 56
    assert refine_batch(recs(b48="ok", b56="ok", b64="oom")) is None  # 8 apart: close enough
    assert refine_batch(recs(b128="ok", b160="oom")) == 144
    assert refine_batch(recs(b16="ok", b32="dram")) is None  # only GPU OOM ends are narrowed
    assert refine_batch(recs(b16="oom")) is None  # nothing fit: nothing to narrow towards


def test_cpu_pool_bound_is_recorded_as_dram(tmp_path):
    # 13 pages of 16 KiB: one request of 256 + 96 tokens takes 12 (11 blocks + scratch)
    argv = ["--model", "tiny-llada2", "--context", "256", "--mode", "herald", "--batches", "1,2",
            "--cpu-kv-gb", str(13 * 16384 / 2**30), "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    got = [(p["batch"], p["status"]) for p in _records(tmp_path)]
    assert got == [(1, "ok"), (2, "dram")]
    assert "CPU pool holds 13 pages" in _records(tmp_path)[1]["error"]


@pytest.mark.parametrize(
    "variant",
    [
        "infinigen",
        "mage",
        "mage-cpu",
        "mage-cpu-rep",
        "herald",
        "herald-selected",
        "herald-int8-gpu",
    ],
)
def test_staging_estimate_bounds_what_the_engine_pins(tmp_path, monkeypatch, variant):
    # The DRAM check refuses a point whose pinned staging does not fit. It once charged every
    # mode the representative query's per-layer buffers (L' times InfiniGen's one layer), which
    # ended InfiniGen's sweeps on DRAM that was there. The estimate must bound the engine's
    # buffers after a decoded block, within 2x (the gathered rows' k_max is not known up front).
    real, seen = throughput_point.run_blocks, []

    def measure(engine, reqs, ps, steps):
        out = real(engine, reqs, ps, steps)
        bufs = engine.pinned_staging()
        pinned = sum(st.numel * st.buf.element_size() for st in bufs)
        cfg, n, seq = engine.offload, engine.max_batch_size, engine.max_seq_len
        est = throughput_point._staging_bytes(cfg, ps.config, n, seq, ps.kv_pad)
        est = est * engine.cpu_pool.dtype.itemsize // 2  # the estimate assumes bf16
        seen.append((pinned, est))
        return out

    monkeypatch.setattr(throughput_point, "run_blocks", measure)
    argv = ["--model", "tiny-llada2", "--context", "2048", "--mode", variant, "--batches", "2",
            "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 0
    assert len(seen) in (1, 2)  # HERALD's points rehearse: one pass more
    for pinned, est in seen:
        assert pinned <= est <= 2 * pinned, (pinned, est)


def test_time_limit_stops_and_a_rerun_resumes(tmp_path, capsys):
    argv = ["--model", "tiny-sdar", "--context", "256", "--mode", "herald", "--batches", "1",
            "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main([*argv, "--time-limit-s", "0"]) == 0
    assert _records(tmp_path) == [] and "time limit" in capsys.readouterr().out
    assert throughput.main(argv) == 0
    assert len(_records(tmp_path)) == 1
    assert throughput.main(argv) == 0  # resumed: nothing pending
    assert len(_records(tmp_path)) == 1
    assert "0 points pending" in capsys.readouterr().out


def test_failure_classes():
    assert classify_failure(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    wrapped = RuntimeError("retrieval stream failed")
    wrapped.__cause__ = torch.OutOfMemoryError("x")
    assert classify_failure(wrapped) == "oom"
    assert classify_failure(CpuPoolFullError(10, 2)) == "dram"
    assert classify_failure(RuntimeError("cudaHostRegister of 4 GiB failed")) == "dram"
    assert classify_failure(ValueError("shape mismatch")) == "error"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cli_dry_run_lists_the_plan(tmp_path, capsys, device):
    """--device cuda --dry-run works without a GPU: it lists what the GPU machine would measure
    (recorded points count as done only for the device they were measured on)."""
    from herald.cli import main

    rc = main(["bench", "throughput", "--plan", "smoke", "--dry-run", "--device", device,
               "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 sweeps selected, 4 points pending" in out
    assert "llada2-mini 16K herald 5.0% 80 GB T=20: batches [32, 64]" in out
    assert not (tmp_path / throughput.JSONL_NAME).exists()


def test_custom_sweep_needs_a_model(capsys):
    assert throughput.main(["--device", "cpu", "--context", "256"]) == 2
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--batches", "0"], "--batches must be >= 1"),
        (["--batches", "-2"], "--batches must be >= 1"),
        (["--context", "0"], "--context must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--kv-budget", "0"], "--kv-budget is a fraction"),
        (["--kv-budget", "1.5"], "--kv-budget is a fraction"),
        (["--gpu-memory-gb", "-5"], "--gpu-memory-gb must be positive"),
        (["--model", "nosuch"], "neither a checkpoint directory nor a preset"),
    ],
)
def test_bad_sweep_values_fail_in_one_line_before_any_work(tmp_path, capsys, flags, says):
    base = {"--model": "tiny-sdar", "--context": "256", "--batches": "1"}
    for k, v in zip(flags[::2], flags[1::2], strict=True):
        base[k] = v
    argv = [x for kv in base.items() for x in kv]
    assert throughput.main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert says in user_error(capsys.readouterr().err)
    assert not (tmp_path / throughput.JSONL_NAME).exists()  # nothing probed or recorded


def test_a_cpu_run_does_not_mix_into_gpu_results(tmp_path, capsys):
    rec = {"kind": "point", "device": "cuda", "model": "tiny-sdar", "batch": 1, "status": "ok"}
    (tmp_path / throughput.JSONL_NAME).write_text(json.dumps(rec) + "\n")
    argv = ["--model", "tiny-sdar", "--context", "64", "--mode", "dense", "--batches", "1"]
    assert throughput.main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "holds cuda points" in capsys.readouterr().err
    assert len((tmp_path / throughput.JSONL_NAME).read_text().splitlines()) == 1


def test_filters_that_select_nothing_are_an_error(tmp_path, capsys):
    argv = ["--plan", "all", "--models", "nosuch", "--dry-run", "--out", str(tmp_path)]
    assert throughput.main(argv) == 2
    assert "select no sweep" in capsys.readouterr().err


def test_a_point_that_errors_makes_the_exit_code_1(tmp_path, monkeypatch):
    def broken(ps, sweep, batch):
        raise ValueError("shape mismatch")

    monkeypatch.setattr(throughput_point, "build_engine", broken)
    argv = ["--model", "tiny-sdar", "--context", "256", "--mode", "dense", "--batches", "1",
            "--out", str(tmp_path), *FAST]  # fmt: skip
    assert throughput.main(argv) == 1
    assert [p["status"] for p in _records(tmp_path)] == ["error"]


def test_failed_engine_constructor_leaves_no_thread_and_no_pinned_memory(monkeypatch):
    """A policy that fails while it is built (here InfiniGen's proxy, after the hand-off staging
    was pinned) leaves no retrieval thread and unregisters what was pinned."""
    import threading

    from herald.bench.throughput_plan import VARIANTS
    from herald.config import EngineConfig
    from herald.kv import pinned
    from herald.models.registry import build_model, get_preset
    from herald.offload import engine as offload
    from herald.offload.policies import infinigen

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    closed = []
    real_close = pinned.PinnedStaging.close
    monkeypatch.setattr(infinigen, "proxy_channels", oom)
    monkeypatch.setattr(
        pinned.PinnedStaging, "close", lambda st: (closed.append(st), real_close(st))
    )
    config = get_preset("tiny-llada2")
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=0)
    before = sum(t.name == "herald-retrieval" for t in threading.enumerate())
    cfg = EngineConfig(
        max_batch_size=2, max_seq_len=256, offload=VARIANTS["infinigen"].offload_config(0.2, 2)
    )
    with pytest.raises(torch.OutOfMemoryError):
        offload.OffloadEngine(model, config, cfg)
    assert sum(t.name == "herald-retrieval" for t in threading.enumerate()) == before
    assert len(closed) == 1  # the hand-off's staging


def test_code_version_names_the_source():
    import re

    from herald.bench.common import code_version

    a, b = code_version(), code_version()
    assert a == b and re.fullmatch(r"[0-9a-f]{16}", a["source_sha256"])
    if "git" in a:  # a clone knows its commit; a copied tree (the device machine) does not
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", a["git"])
