"""The throughput benchmark's command line: flags checked before any work, the settings a
resumed point must share (a folder holds one set), and what a dry run says about a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import user_error

from herald.bench import throughput
from herald.bench import throughput_plan as plan
from herald.bench.throughput_records import (
    is_offload_record,
    load_records,
    record_setting,
    run_setting,
    run_settings,
    setting_differs,
)
from herald.bench.throughput_run import Runner

RESULTS = Path(__file__).resolve().parents[2] / "results" / "throughput"
SWEEP = ["--model", "tiny-sdar", "--context", "256", "--mode", "dense,herald", "--batches", "1"]


@pytest.fixture
def no_work(monkeypatch):
    """Probes and model builds fail the test: a bad flag must stop the command before them."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command got past its checks")

    monkeypatch.setattr(Runner, "header", refuse)
    monkeypatch.setattr(Runner, "ensure_model", refuse)


def _write(out: Path, records: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / throughput.JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))


def _run_record(run_id: str = "r1", **settings) -> dict:
    # the settings a run records (those of the committed results), overridden by ``settings``
    base = {"warmup_blocks": 1, "timed_blocks": 2, "slow_block_s": 15.0,
            "offload_cuda_graph": True, "kv_pad": 512, "dense_kv_pad": 0, "real_prefill": False,
            "cpu_kv_gb": None, "dram_reserve_gb": 16.0, "time_limit_s": 300.0}  # fmt: skip
    return {"kind": "run", "run_id": run_id, "settings": {**base, **settings}}


def _point(variant: str, batch: int = 1, run_id: str = "r1", **fields) -> dict:
    """A point of the tiny-sdar 256 sweep of ``variant`` (T = 20) as the runner records it
    (default settings); ``fields`` override or add fields."""
    var = plan.VARIANTS[variant]
    rec = {"kind": "point", "run_id": run_id, "model": "tiny-sdar", "context": 256,
           "variant": variant, "mode": var.mode, "budget": var.default_budget,
           "gpu_cap_gb": None, "steps": 20, "batch": batch, "status": "ok", "device": "cpu",
           "block_size": 32, "warmup_blocks": 1, "prefill": "synthetic", "timed_blocks": 2,
           "kv_pad": 512 if var.offload else 0, "decode_tokens_per_s": 100.0}  # fmt: skip
    if var.offload:
        rec |= {"offload_cuda_graph": True, "selection_threads": 14}
    if var.rehearses:
        rec["rehearsal"] = {"decode_tokens_per_s": 90.0}
    return {**rec, **fields}


def _runner(out: Path, *flags: str) -> Runner:
    args = throughput.build_parser().parse_args(
        [*SWEEP, "--device", "cpu", "--out", str(out), *flags]
    )
    sweeps = throughput.custom_sweeps(args)
    return Runner(args, sweeps, sweeps)


def _pending(run: Runner) -> dict[str, list[int]]:
    return {s.variant: run.plan_sweep(s)[1] for s in run.sweeps}


# -- flags checked up front -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--context", "16"], "--context must be >= 1 and at least one block (--block-size 32)"),
        (["--context", "8", "--block-size", "16"], "at least one block (--block-size 16), got 8"),
        (["--gpu-memory-gb", "40"], "--gpu-memory-gb caps GPU memory: it needs --device cuda"),
        (["--block-size", "7"], "--block-size must be a power of two in [1, 1024]"),
        (["--block-size", "0"], "--block-size must be a power of two"),
        (["--block-size", "-32"], "--block-size must be a power of two"),
        (["--block-size", "2048"], "--block-size must be a power of two in [1, 1024]"),
        (["--cpu-kv-gb", "0"], "--cpu-kv-gb must be positive"),
        (["--cpu-kv-gb", "-2"], "--cpu-kv-gb must be positive"),
        (["--dram-probe-gib", "0"], "--dram-probe-gib must be positive"),
        # 1 KiB: a tiny-sdar page (2 offloaded layers x K,V x 2 heads x 32 tokens x 32 x bf16)
        # is 16 KiB
        (
            ["--cpu-kv-gb", str(1024 / 2**30)],
            "--cpu-kv-gb 9.53674e-07 is too small for even "
            "one page of tiny-sdar's CPU KV pool (32 tokens: 1.53e-05 GiB)",
        ),  # fmt: skip
        (["--selection-threads", "0"], "--selection-threads must be >= 1"),
        (["--warmup-blocks", "0"], "--warmup-blocks and --timed-blocks must be >= 1"),
        (["--timed-blocks", "0"], "--warmup-blocks and --timed-blocks must be >= 1"),
        (["--slow-block-s", "-1"], "--slow-block-s must be >= 0"),
        (["--dram-reserve-gb", "-1"], "--dram-reserve-gb must be >= 0"),
        (["--kv-pad", "-1"], "--kv-pad must be an integer in [0, 65536]"),
        (["--dense-kv-pad", "70000"], "--dense-kv-pad must be an integer in [0, 65536]"),
        (["--device", "gpu"], "--device must be cpu or cuda"),
    ],
)
def test_bad_flags_fail_in_one_line_before_any_work(tmp_path, capsys, no_work, flags, says):
    argv = [*SWEEP, "--device", "cpu", "--out", str(tmp_path), *flags]
    assert throughput.main(argv) == 2
    assert says in user_error(capsys.readouterr().err)
    assert not (tmp_path / throughput.JSONL_NAME).exists()


def test_the_cpu_pool_check_counts_offloading_sweeps_only(tmp_path, capsys, no_work):
    tiny = ["--cpu-kv-gb", str(1024 / 2**30), "--out", str(tmp_path), "--dry-run"]
    dense = ["--model", "tiny-sdar", "--context", "256", "--mode", "dense", "--batches", "1"]
    assert throughput.main([*dense, "--device", "cpu", *tiny]) == 0  # a dense run has no pool
    # one page exactly is enough for the check (the point then ends on DRAM: a result)
    page = str(16384 / 2**30)
    argv = [*SWEEP, "--device", "cpu", "--cpu-kv-gb", page, "--out", str(tmp_path), "--dry-run"]
    assert throughput.main(argv) == 0
    # a plan's full-size models are checked from their configs, without building them
    argv = ["--plan", "smoke", "--cpu-kv-gb", "0.001", "--dry-run", "--out", str(tmp_path)]
    assert throughput.main(argv) == 2
    assert "one page of llada2-mini's CPU KV pool" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--context", "16", "--block-size", "16"],  # one block is enough
        ["--context", "100"],  # rounded up to whole blocks by the engines
        ["--block-size", "4"],
        ["--gpu-memory-gb", "40", "--device", "cuda"],  # a GPU dry run works without a GPU
    ],
)
def test_good_flags_pass_the_checks(tmp_path, capsys, no_work, flags):
    argv = [*SWEEP, "--device", "cpu", "--out", str(tmp_path), "--dry-run", *flags]
    assert throughput.main(argv) == 0
    assert "2 sweeps selected, 2 points pending" in capsys.readouterr().out


def test_without_batches_only_the_reports_models_and_contexts_have_a_list(
    tmp_path, capsys, no_work
):
    """--batches' help says which sweeps have a default list; another sweep is refused, naming
    the ones that have one."""
    full = ["--model", "llada2-mini", "--context", "32768", "--mode", "dense", "--dry-run"]
    assert throughput.main([*full, "--device", "cuda", "--out", str(tmp_path)]) == 0
    assert "dense no cap T=20: batches [8, 16, 24, 32, 40, 48, 64, 80]" in capsys.readouterr().out
    tiny = ["--model", "tiny-sdar", "--context", "256", "--device", "cpu"]
    assert throughput.main([*tiny, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no default batch list for tiny-sdar at 256 (only llada2-mini or sdar-8b-chat at " in err
    assert "16384 or 32768 tokens have one); give --batches" in err
    text = " ".join(throughput.build_parser().format_help().split())
    assert (
        "batch sizes, measured in order until one does not fit (default: the report's list for "
        "the mode, for llada2-mini or sdar-8b-chat at 16384 or 32768 tokens only; other models "
        "and contexts need --batches)" in text
    )


# -- the settings a resumed point must share ------------------------------------------------------


def test_points_with_the_runs_settings_count_as_done(tmp_path):
    _write(tmp_path, [_run_record(), _point("dense"), _point("herald")])
    run = _runner(tmp_path)
    assert _pending(run) == {"dense": [], "herald": []}
    assert run.conflicts() == []


@pytest.mark.parametrize(
    ("flags", "pending", "clash"),
    [
        (["--block-size", "16"], ["dense", "herald"], "--block-size 32 (this run: 16)"),
        (["--warmup-blocks", "2"], ["dense", "herald"], "--warmup-blocks 1 (this run: 2)"),
        (["--timed-blocks", "3"], ["dense", "herald"], "--timed-blocks 2 (this run: 3)"),
        (["--slow-block-s", "5"], ["dense", "herald"], "--slow-block-s 15 (this run: 5)"),
        (["--real-prefill"], ["dense", "herald"], "--real-prefill off (this run: on)"),
        (["--cpu-kv-gb", "4"], ["herald"], "--cpu-kv-gb unset (this run: 4)"),
        (["--selection-threads", "3"], ["herald"], "--selection-threads 14 (this run: 3)"),
        (["--kv-pad", "0"], ["herald"], "--kv-pad 512 (this run: 0)"),
        (["--dense-kv-pad", "512"], ["dense"], "--dense-kv-pad 0 (this run: 512)"),
        (["--no-offload-cuda-graph"], ["herald"], "--offload-cuda-graph on (this run: off)"),
    ],
)
def test_points_measured_with_other_settings_are_not_done(tmp_path, flags, pending, clash):
    _write(tmp_path, [_run_record(), _point("dense"), _point("herald")])
    run = _runner(tmp_path, *flags)
    assert _pending(run) == {v: [1] if v in pending else [] for v in ("dense", "herald")}
    assert run.conflicts() == [clash]


def test_settings_that_do_not_change_a_point_are_not_compared(tmp_path):
    _write(tmp_path, [_run_record(), _point("dense"), _point("herald")])
    flags = ["--dram-reserve-gb", "2", "--time-limit-s", "10", "--dram-probe-gib", "0.1",
             "--selection-threads", "14"]  # fmt: skip
    run = _runner(tmp_path, *flags)
    assert _pending(run) == {"dense": [], "herald": []} and run.conflicts() == []


def test_records_from_before_a_setting_was_recorded_resume_with_the_defaults(tmp_path):
    """Points that lack a setting were measured at its default: a point without a run record
    (timed_blocks, slow_block_s and cpu_kv_gb come from it), one without block_size / prefill,
    a failed point (no timed_blocks, no selection_threads), and a point that timed one block
    after a slow warm-up (its own timed_blocks is what it timed, not the flag)."""
    bare = {k: v for k, v in _point("dense").items() if k not in ("block_size", "prefill")}
    records = [
        {**bare, "run_id": "gone"},
        _point("dense", 2),
        _point("herald", 1, timed_blocks=1),
        {k: v for k, v in _point("herald", 2, status="dram").items()
         if k not in ("timed_blocks", "selection_threads", "decode_tokens_per_s")},
    ]  # fmt: skip
    _write(tmp_path, [_run_record(), *records])
    run = _runner(tmp_path, "--batches", "1,2")
    assert _pending(run) == {"dense": [], "herald": []} and run.conflicts() == []
    # another thread count remeasures the measured point; the DRAM end holds at any count
    run = _runner(tmp_path, "--batches", "1,2", "--selection-threads", "3")
    assert _pending(run) == {"dense": [], "herald": [1]}
    # the defaults stand for the missing fields: a record is not taken for any value
    run = _runner(tmp_path, "--batches", "1,2", "--block-size", "16")
    assert _pending(run) == {"dense": [1, 2], "herald": [1, 2]}


@pytest.mark.skipif(not RESULTS.is_dir(), reason="no committed results")
def test_the_committed_results_match_the_default_settings():
    """Every committed GPU point counts as done for a default GPU run: the flags resumed on the
    device keep resuming it."""
    args = throughput.build_parser().parse_args(["--plan", "all", "--device", "cuda"])
    records = load_records(RESULTS)
    runs = run_settings(records)
    points = [r for r in records if r.get("kind") == "point"]
    assert points
    for r in points:
        want = run_setting(args, is_offload_record(r))
        assert setting_differs(record_setting(r, runs), want) == [], r


# -- the command line on a folder -----------------------------------------------------------------


def test_a_run_with_other_settings_refuses_the_folder(tmp_path, capsys, no_work):
    recs = [_run_record(), _point("dense"), _point("herald")]
    _write(tmp_path, recs)
    argv = [*SWEEP, "--device", "cpu", "--out", str(tmp_path)]
    assert throughput.main([*argv, "--block-size", "16", "--kv-pad", "0"]) == 2
    err = user_error(capsys.readouterr().err)
    assert "holds points measured with other settings: --block-size 32 (this run: 16); " in err
    assert "--kv-pad 512 (this run: 0)" in err and "give another --out" in err
    # a dry run lists what the settings would measure, and says a run would refuse
    assert throughput.main([*argv, "--block-size", "16", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 sweeps selected, 2 points pending" in out
    assert "note: " in out and "a run with these settings refuses this --out" in out
    # the folder's own settings: nothing to do (and no header written)
    assert throughput.main(argv) == 0
    assert "2 sweeps selected, 0 points pending" in capsys.readouterr().out
    assert load_records(tmp_path) == recs


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_dry_run_says_when_the_folder_holds_another_devices_points(tmp_path, capsys, device):
    """A CPU dry run of the GPU results lists every point as pending (they count as done only
    for their device): it says so and how to see the GPU run's plan."""
    other = "cuda" if device == "cpu" else "cpu"
    _write(tmp_path, [_run_record(), _point("dense", device=other)])
    argv = [*SWEEP, "--device", device, "--out", str(tmp_path), "--dry-run"]
    assert throughput.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 sweeps selected, 2 points pending" in out
    assert (
        f"note: {tmp_path} holds {other} points, which count as done only for their device; "
        f"this dry run plans for {device}: add --device {other} to see what a {other} run "
        "would measure"
    ) in out
    # the same folder for the device of its points: no note
    assert throughput.main([*argv[:-1], "--device", other, "--dry-run"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_a_measured_folder_refuses_a_block_size_it_was_not_measured_at(tmp_path, capsys):
    """End to end: tiny points measured at B = 32, resumed with B = 16 (once '0 points pending'
    and nothing measured)."""
    fast = ["--device", "cpu", "--steps", "3", "--timed-blocks", "1", "--dram-probe-gib",
            "0.004", "--selection-threads", "2", "--dram-reserve-gb", "0",
            "--out", str(tmp_path)]  # fmt: skip
    assert throughput.main([*SWEEP, *fast]) == 0
    assert len([r for r in load_records(tmp_path) if r["kind"] == "point"]) == 2
    capsys.readouterr()
    assert throughput.main([*SWEEP, *fast]) == 0
    assert "0 points pending" in capsys.readouterr().out
    assert throughput.main([*SWEEP, *fast, "--block-size", "16"]) == 2
    assert "--block-size 32 (this run: 16)" in capsys.readouterr().err
    assert len([r for r in load_records(tmp_path) if r["kind"] == "point"]) == 2


def test_the_probes_line_says_n_a_for_pcie_without_a_gpu():
    from herald.bench.throughput_run import probes_line

    dram = {"reference_gbs": 12.34}
    assert probes_line({"pcie": None, "dram": dram}) == (
        "PCIe n/a (no CUDA GPU); DRAM read 12.3 GB/s"
    )
    pcie = {"h2d_gbs": 50.04, "d2h_gbs": 49.96}
    assert probes_line({"pcie": pcie, "dram": dram}) == (
        "PCIe H2D 50.0 GB/s, D2H 50.0 GB/s; DRAM read 12.3 GB/s"
    )


def test_the_help_tells_the_sweep_flags_from_the_filters():
    """--model/--context/--mode name the sweeps to run; --models/--contexts/--modes filter."""
    text = " ".join(throughput.build_parser().format_help().split())
    assert "--model, --context and --mode name the sweeps to run; --models, --contexts and " in text
    assert "keep only the selected sweeps (of --plan, or of --model, --context, --mode)" in text
    for flag, says in (
        ("--model MODEL", "the model to sweep"),
        ("--context TOKENS [TOKENS ...]", "the context length(s) to sweep"),
        ("--mode VARIANT [VARIANT ...]", "the variant(s) to sweep"),
        ("--models MODEL [MODEL ...]", "filter: run only the selected sweeps of these models"),
        ("--contexts TOKENS [TOKENS ...]", "filter: run only the selected sweeps at these"),
        ("--modes VARIANT [VARIANT ...]", "filter: run only the selected sweeps of these variants"),
    ):
        assert f"{flag} {says}" in text, flag


def test_contexts_take_a_k_suffix():
    args = throughput.build_parser().parse_args(["--context", "16K", "32768", "--contexts", "2k"])
    assert args.context == [16384, 32768] and args.contexts == [2048]
