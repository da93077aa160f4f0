"""The throughput report (tables, targets, plots) rebuilt from a JSONL fixture alone."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from herald.bench import throughput
from herald.bench.throughput_plan import CAP_H100, FIG13_RUNGS, FIG14_STEPS, K16, K32, LLADA, SDAR

GEOM = {LLADA: (18, 4, 128), SDAR: (34, 8, 128)}
# (model, context, variant) -> {batch: tokens/s or a failure status}
TABLE2 = {
    (LLADA, K32, "dense"): {8: 700.0, 16: 1100.0, 24: 1250.0, 32: "oom"},
    (LLADA, K32, "herald"): {16: 900.0, 32: 1700.0, 48: 2300.0, 64: 2500.0, 80: "dram"},
    (LLADA, K32, "mage"): {16: 300.0, 32: 380.0, 56: 390.0, 80: 385.0, 96: "dram"},
    (LLADA, K32, "infinigen"): {16: 250.0, 32: 260.0, 48: "oom"},
    (LLADA, K16, "dense"): {16: 1400.0, 32: 1900.0, 48: "oom"},
    (LLADA, K16, "herald"): {32: 1800.0, 64: 3000.0, 96: 3400.0, 128: "dram"},
    (LLADA, K16, "mage"): {16: 600.0, 32: 700.0},  # 64 to 160 still pending
    (LLADA, K16, "infinigen"): {16: 500.0, 32: 3500.0, 64: "dram"},  # above HERALD: missed
    (SDAR, K32, "dense"): {4: 300.0, 8: 450.0, 12: "oom"},
    (SDAR, K32, "herald"): {8: 400.0, 16: 700.0, 24: "dram"},
    (SDAR, K32, "mage"): {8: 100.0},  # 16 to 32 pending, measured on a bigger host
    (SDAR, K16, "herald"): {16: 500.0, 32: "dram"},
    (SDAR, K16, "mage"): {16: 300.0, 32: "dram"},  # bs 32's DRAM end from a smaller host
    (SDAR, K16, "infinigen"): {16: "oom"},  # not one batch fits
}
BUDGET = {"dense": None, "herald": 0.05, "mage": 0.025, "infinigen": 0.2}
BIG_HOST = {"kind": "run", "run_id": "r2", "command": "python -m herald.bench.throughput",
            "plan": "all", "part": None,
            "machine": {"date_utc": "2026-12-01T01:00:00+00:00", "gpu": "NVIDIA H200",
                        "cpu_model": "Xeon", "cpu_count": 32, "mem_total_gib": 251.8,
                        "torch": "2.11.0"},
            "settings": {"warmup_blocks": 1, "timed_blocks": 2, "time_limit_s": 95.0}}  # fmt: skip


def _point(model, ctx, variant, budget, batch, value, steps=20, cap=CAP_H100):
    rec = {
        "kind": "point", "run_id": "r1", "model": model, "model_name": model, "context": ctx,
        "variant": variant, "mode": variant, "budget": budget, "gpu_cap_gb": cap,
        "steps": steps, "block_size": 32, "batch": batch, "device": "cuda",
        "offload_cuda_graph": False, "prefill": "synthetic", "wall_seconds": 12.0,
        "kv_geometry": dict(zip(("num_layers", "num_kv_heads", "head_dim"), GEOM[model],
                                strict=True)),
    }  # fmt: skip
    if isinstance(value, str):
        return {**rec, "status": value, "error": f"{value}: did not fit"}
    fwd = batch * 32 / (value * (steps + 1))
    rec.update(status="ok", decode_tokens_per_s=value, decode_seconds=1.0,
               generated_tokens=int(value), forward_median_s=fwd, step0_median_s=fwd,
               step1_median_s=fwd, commit_median_s=fwd, peak_gpu_gib=50.0)  # fmt: skip
    if variant != "dense":
        block = batch * 32 / value
        rec.update(block_main_s=[block, block], block_retrieval_s=[0.8 * block, 0.8 * block],
                   block_stall_s=[0.0, 0.0])  # fmt: skip
        if variant.startswith("herald"):
            parts = {"query_to_host": 0.01, "kernel": 0.6 * block, "gather_copy": 0.1 * block}
            rec["block_retrieval_parts_s"] = [parts, parts]
        if variant.startswith("herald") or variant.startswith("mage-cpu"):
            rec["selection_kernel"] = {"n_q": 1, "output_mode": "full", "block_s": 0.9 * block,
                                       "layer_select_s": 0.01, "layer_gather_s": 0.001,
                                       "num_layers": 18, "k_rows": 1639}  # fmt: skip
    return rec


def write_fixture(out: Path) -> None:
    recs: list[dict] = [
        {"kind": "run", "run_id": "r1", "command": "python -m herald.bench.throughput --plan all",
         "plan": "all", "part": None,
         "machine": {"date_utc": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200",
                     "cpu_model": "Xeon", "cpu_count": 16, "mem_total_gib": 125.0,
                     "torch": "2.11.0"},
         "settings": {"warmup_blocks": 1, "timed_blocks": 2, "time_limit_s": 380.0}},
        {"kind": "machine", "run_id": "r1", "pcie": {"h2d_gbs": 55.0, "d2h_gbs": 54.0},
         "dram": {"reference_gbs": 95.0}},
    ]  # fmt: skip
    for (m, ctx, v), pts in TABLE2.items():
        recs += [_point(m, ctx, v, BUDGET[v], b, x) for b, x in pts.items()]
    recs.append(BIG_HOST)
    for r in recs:
        if r.get("model") == SDAR and r.get("variant") == "mage":
            r["run_id"] = "r2"
        # SDAR 16K MAGE: measured on the big host, a DRAM end found on the small one
        if (r.get("model"), r.get("context"), r.get("variant")) == (SDAR, K16, "mage"):
            r["run_id"] = "r2" if r["status"] == "ok" else "r1"
    for ctx in (K16, K32):
        for i, v in enumerate(FIG13_RUNGS):
            if v != "herald":
                recs += [_point(LLADA, ctx, v, 0.05, b, 400.0 * (i + 1) + b) for b in (16, 32)]
        for t in FIG14_STEPS:
            if t != 20:
                recs.append(_point(LLADA, ctx, "dense", None, 24 if ctx == K32 else 32, 60.0 * t))
                recs[-1]["steps"] = t
                recs.append(_point(LLADA, ctx, "herald", 0.05, 64 if ctx == K32 else 96, 100.0 * t))
                recs[-1]["steps"] = t
    # a superseded record: the later line for the same point wins
    recs.insert(3, {**_point(LLADA, K32, "herald", 0.05, 64, 10.0)})
    lines = [json.dumps(r) for r in recs] + ['{"kind": "point", "trunc']  # a killed write
    (out / throughput.JSONL_NAME).write_text("\n".join(lines) + "\n")


def test_report_from_fixture(tmp_path, capsys):
    write_fixture(tmp_path)
    stale = tmp_path / "fig12_retired-model_cap80.png"  # a plot the data no longer gives
    stale.write_bytes(b"old")
    jsonl = tmp_path / throughput.JSONL_NAME
    msg = "DramBoundError: CPU pool holds 1000 pages (4.0 GiB), batch 80 needs 1040"
    lines = jsonl.read_text().splitlines()
    ends = [i for i, x in enumerate(lines) if '"batch": 80,' in x and "dram: did not fit" in x]
    assert len(ends) == 1  # LLaDA 32K HERALD's DRAM end: now with the engine's message
    lines[ends[0]] = lines[ends[0]].replace("dram: did not fit", msg)
    jsonl.write_text("\n".join(lines) + "\n")
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    # the DRAM-bounded batch is stated: 1000 pages // 13 pages per request
    assert (
        "- llada2-mini 32K: at most **76 requests** (pool 4.0 GiB = 1000 pages; host: 16 "
        "cores, 125 GiB)" in md
    )
    # Table II: peaks, ratios against Dense, the paper's numbers, why each sweep ended
    assert "| 32K | HERALD 5.0% | 64 | 2500 (2.00x) | 80 / 2665 | DRAM at bs 80 |" in md
    assert "| 32K | Dense | 24 | 1250 (1.00x) | 16 / 1168 | GPU OOM at bs 32 |" in md
    assert "= 80 GB run" in md  # uncapped offloading rows fall back to the 80 GB sweep
    # targets: the 2.28x target missed, with the limiting ceiling and the batch bound named
    assert "HERALD / Dense = 2500 / 1250 = **2.00x** (target >= 2.28x): **missed**" in md
    assert "limiting ceiling: **" in md and "lift:" in md
    # HERALD 32K bs 64 at 2500 tok/s: 0.82 s per block, 0.6 of it the kernel
    parts = "(CPU kernel 0.49 s, gather + copies 0.08 s, query to host 0.01 s)"
    assert f"stream is the longer {parts}" in md
    assert "batch bound: bs 80 did not fit in DRAM" in md
    assert "HERALD 3400 vs infinigen 3500 tok/s: **missed**" in md
    assert "HERALD 2500 vs mage 390 tok/s: **met**" in md
    assert "whole GPU: HERALD 2500 (= 80 GB run) vs mage 390 tok/s: **met**" in md
    # a sweep with planned batches still pending decides nothing yet
    assert "HERALD 3400 vs mage 700 tok/s: **pending (sweep incomplete)**" in md
    assert "HERALD 700 vs mage 100 tok/s: **pending (sweep incomplete)**" in md
    assert "sdar-8b-chat 32K, 80 GB cap: HERALD 700 vs infinigen: **not measured**" in md
    no_fit = "HERALD 500 vs infinigen: no batch fits (GPU OOM at bs 16): **met**"
    assert f"sdar-8b-chat 16K, 80 GB cap: {no_fit}" in md
    row = "| 16K | MAGE-Offload (GPU selection) 2.5% | 32 | 700 (0.37x) | 96 / 749 |"
    assert f"{row} **incomplete**: bs 64, 96, 128, 160 pending |" in md
    # a point from another host shape says so; the `selected` output mode has its own target line
    assert "**incomplete**: bs 16, 24, 32 pending (on 32 cores, 252 GiB) |" in md
    # a DRAM end found on a smaller host does not end a sweep measured on a bigger one
    aside = "**incomplete**: bs 32, 48, 64 pending (bs 32: DRAM on 16 cores, 125 GiB)"
    assert f"| 16 | 300 | 64 / 230 | {aside} (on 32 cores, 252 GiB) |" in md
    assert "HERALD 500 vs mage 300 tok/s: **pending (sweep incomplete)**" in md
    assert "| sdar-8b-chat | 16384 | mage | 0.025 | 80.0 | 20 | 32 | dram |" in md  # still listed
    assert "HERALD (`selected` kernel output, our step beyond the paper) / Dense = " in md
    # Fig. 12 table: ceilings at each HERALD batch (per-step fetch at 5%, 32K, 55 GB/s: 1456)
    assert "| herald | 48 | 2300 |" in md and "| 1456 |" in md
    # Fig. 13 ladder and Fig. 14 T sweep
    assert "| 32K | MAGE-Offload (GPU selection) | 32 | 432 | - | 1.00 |" in md
    assert "| 32K | HERALD | 64 | 2500 |" in md
    assert "| 32K | 8 | 24 | 480 | 64 | 800 | 1.67 |" in md
    assert "| 32K | 20 | 24 | 1250 | 64 | 2500 | 2.00 |" in md
    assert "python -m herald.bench.throughput --plan all` | - | NVIDIA H200" in md  # provenance
    # the fixture's dense points carry no `rehearsal`: timed on their first pass, and said so
    assert "**Points measured before their mode rehearsed (" in md
    # runs that differ only in their time limit share one settings line
    assert "Settings (every run): timed_blocks = 2, warmup_blocks = 1" in md
    assert "Every measured point" in md and "skipping a malformed line" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib missing: plots not checked")
    assert not stale.exists()
    for name in ("fig12_llada2-mini_cap80.png", "fig12_sdar-8b-chat_cap80.png",
                 "fig13_ablation.png", "fig14_steps.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 1000, name
        assert f"]({name})" in md


def test_report_compares_points_measured_again(tmp_path):
    """``superseded/remeasured*.jsonl`` points that the current points measure again are compared
    (other superseded files, points superseded by a fix, are not)."""
    write_fixture(tmp_path)
    sup = tmp_path / "superseded"
    sup.mkdir()
    again = [
        _point(LLADA, K32, "dense", None, 8, 500.0),  # now 700: +40%
        _point(LLADA, K32, "dense", None, 16, 1000.0),  # now 1100: +10%, not listed
        _point(LLADA, K32, "dense", None, 40, 900.0),  # never measured now: no pair
        _point(LLADA, K32, "dense", None, 24, 1000.0, cap=None),  # other cap: no pair
        {**_point(LLADA, K32, "herald", 0.05, 16, 100.0), "device": "cpu"},  # CPU: ignored
        {**_point(LLADA, K32, "herald", 0.05, 32, 100.0), "decode_tokens_per_s": 0.0},  # ignored
        _point(LLADA, K32, "dense", None, 32, 1300.0),  # now "oom": listed as not fitting
        {**_point(SDAR, K32, "dense", None, 4, 400.0), "run_id": "r2"},  # now 300, another host
    ]
    (sup / "remeasured_in_one_run.jsonl").write_text("\n".join(json.dumps(r) for r in again))
    fixed = [_point(LLADA, K32, "dense", None, 24, 100.0)]  # superseded by a fix: ignored
    (sup / "some_fix.jsonl").write_text(json.dumps(fixed[0]))
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    # a pair from two hosts is the host's difference too: listed apart, not counted as noise
    assert (
        "1 configurations of `superseded/remeasured_in_one_run.jsonl` were measured again on "
        "another host" in md
    )
    assert "| 32 cores, 252 GiB | 16 cores, 125 GiB | dense | 1 | -25.0% | -25.0% to -25.0% |" in md
    assert (
        "2 configurations of `superseded/remeasured_in_one_run.jsonl` were measured again by "
        "the runs above on the same host" in md
    )
    assert "differ by 25.0% (median of the absolute differences), 2 by 10% or more" in md
    assert "| dense | 2 | +25.0% | 25.0% | +40.0% |" in md  # per mode
    assert "Configurations that differ by 20% or more:" in md
    assert "| llada2-mini | 32K | dense | 80.0 | 20 | 32 | 1300 | oom | same |" in md
    assert "1 configuration(s) that ran before did not fit when measured again:" in md
    assert "| llada2-mini | 32K | dense | 80.0 | 20 | 8 | 500 | 700 | +40.0% |" in md
    assert "| 16 | 1000 | 1100 |" not in md  # under 20%: counted, not listed


def test_report_refuses_a_folder_without_points(tmp_path, capsys):
    assert throughput.main(["--report", str(tmp_path / "missing")]) == 2
    assert "no such results folder" in capsys.readouterr().err
    (tmp_path / "superseded").mkdir()  # only superseded points: nothing to report
    (tmp_path / "superseded" / "old.jsonl").write_text(
        json.dumps(_point(LLADA, K32, "dense", None, 8, 1.0))
    )
    assert throughput.main(["--report", str(tmp_path)]) == 2
    assert "no measured point" in capsys.readouterr().err
    assert not (tmp_path / "README.md").exists()


def _append(out: Path, recs: list[dict]) -> None:
    with (out / throughput.JSONL_NAME).open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def test_a_target_met_by_less_than_the_noise_says_so(tmp_path):
    write_fixture(tmp_path)
    _append(tmp_path, [
        _point(SDAR, K32, "dense", None, 4, 330.0, cap=None),  # 300 under the cap: +10% noise
        _point(SDAR, K16, "mage", 0.025, 24, 470.0),  # HERALD's 500 is 6.4% above it
    ])  # fmt: skip
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert (
        "- sdar-8b-chat 16K, 80 GB cap: HERALD 500 vs mage 470 tok/s: **pending (sweep "
        "incomplete)** (by 6.4%, less than the 10.0% median difference between two "
        "measurements in one run (two runs differ more) of one configuration" in md
    )
    assert "HERALD 2500 vs mage 390 tok/s: **met**\n" in md  # far above the noise: no note


def test_the_noise_that_targets_use_is_the_two_run_one(tmp_path):
    # Pairs from one run (minutes apart) agree more closely than pairs from two runs, and the
    # modes of a table come from different runs: the two-run median is the one to beat.
    write_fixture(tmp_path)
    _append(tmp_path, [
        _point(SDAR, K32, "dense", None, 4, 303.0, cap=None),  # one run (r1): +1%
        _point(LLADA, K32, "dense", None, 8, 707.0, cap=None),  # one run: +1%
        {**_point(LLADA, K32, "dense", None, 16, 1188.0, cap=None), "run_id": "r2"},  # +8%
        _point(SDAR, K16, "mage", 0.025, 24, 470.0),  # HERALD's 500 is 6.4% above it
    ])  # fmt: skip
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert "1 pairs come from two runs, hours apart: 8.0% (median), up to 8.0%" in md
    assert "2 from one run, minutes apart: 1.0% (median)" in md
    assert "(by 6.4%, less than the 8.0% median difference between two runs'" in md


def test_a_comparison_without_a_herald_number_is_not_dropped(tmp_path):
    write_fixture(tmp_path)
    lines = (tmp_path / throughput.JSONL_NAME).read_text().splitlines()
    keep = [x for x in lines if not ('"variant": "herald"' in x and '"model": "sdar-8b-chat"' in x
                                     and '"context": 32768' in x)]  # fmt: skip
    (tmp_path / throughput.JSONL_NAME).write_text("\n".join(keep) + "\n")
    _append(tmp_path, [_point(SDAR, K32, "herald", 0.05, 8, "dram")])  # not one batch fits
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    head = "- sdar-8b-chat 32K, 80 GB cap: HERALD no batch fits (DRAM at bs 8) vs"
    assert f"{head} mage 100 tok/s: **missed**" in md
    assert f"{head} infinigen not measured: **not decided**" in md


def test_the_cap_against_a_real_h100(tmp_path):
    # Dense LLaDA 32K ran out of GPU memory at bs 32 under the 74.5 GiB cap; on the whole GPU
    # bs 32 peaked at 77 GiB (it would fit in an H100's 79.6 GiB, 2 GiB kept) and bs 40 at 90.
    write_fixture(tmp_path)
    _append(tmp_path, [
        {**_point(LLADA, K32, "dense", None, 32, 1400.0, cap=None), "peak_gpu_gib": 77.0},
        {**_point(LLADA, K32, "dense", None, 40, 1500.0, cap=None), "peak_gpu_gib": 90.0},
        {**_point(LLADA, K32, "infinigen", 0.2, 48, 270.0, cap=None), "peak_gpu_gib": 81.0},
    ])  # fmt: skip
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert "an H100 80GB holds 81,559 MiB (79.6 GiB)" in md
    assert (
        "- llada2-mini 32K Dense: bs 32 peaked at 77.0 GiB on the whole GPU, 1400 tok/s, "
        "against 1250 (bs 24) under the cap" in md
    )
    assert "so on an H100, HERALD / Dense at llada2-mini 32K would be about 1.79x, not 2.00x" in md
    assert (
        "- llada2-mini 32K InfiniGen (once per block): no larger, faster batch fits in 77.6 GiB: "
        "its next batch on the whole GPU, bs 48, peaked at 81.0 GiB" in md
    )


def test_a_measured_ceiling_names_its_spread(tmp_path):
    # The selection kernel's time does not depend on T: the Fig. 14 points at HERALD's peak
    # batch time it again, and the limiting-ceiling line gives their range.
    write_fixture(tmp_path)
    jsonl = tmp_path / throughput.JSONL_NAME
    recs = []
    for line in jsonl.read_text().splitlines()[:-1]:  # the last line is the truncated one
        r = json.loads(line)
        if (r.get("variant"), r.get("context"), r.get("batch")) == ("herald", K32, 64):
            # 64 x 32 tokens per block over 1.17-1.5 s of kernel: 1755-1365 tok/s, below the
            # GPU forward ceiling, so CPU selection limits HERALD's peak (T = 20: 1.2 s)
            r["selection_kernel"]["block_s"] = (
                1.0 + abs(r["steps"] - 20) / 24 + 0.2 * (r["steps"] == 20)
            )
        recs.append(r)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert "limiting ceiling: **CPU selection (kernel, measured) = 1707 tok/s** at bs 64" in md
    assert (
        "that ceiling is one timing of the kernel: 6 points of this configuration at bs 64 "
        "(T = 8, 12, 16, 20, 24, 32) timed it at 1365-1755 tok/s (29% apart)" in md
    )


def test_hosts_whose_dram_differs_by_a_boot_wobble_are_one():
    from herald.bench.throughput_data import hosts

    def run(rid, cores, gib):
        return {"run_id": rid, "machine": {"cpu_count": cores, "mem_total_gib": gib}}

    got = hosts([run("a", 16, 125.6), run("b", 16, 125.4), run("c", 32, 251.8), run("d", 16, None)])
    assert got == {"a": (16, 125), "b": (16, 125), "c": (32, 252), "d": (16, None)}


def test_block_stats_of_the_rehearsal_pass_are_marked(tmp_path):
    # Points whose timed pass's per-block stream times were not recorded show their rehearsal
    # pass's, marked, with the note saying so; their throughput stays the timed pass's.
    write_fixture(tmp_path)
    jsonl = tmp_path / throughput.JSONL_NAME
    recs = [json.loads(x) for x in jsonl.read_text().splitlines()[:-1]]
    for r in recs:
        if (r.get("variant"), r.get("context"), r.get("batch"), r.get("steps")) == (
            "herald",
            K32,
            48,
            20,
        ):
            moved = {k: r.pop(k) for k in ("block_main_s", "block_retrieval_s", "block_stall_s")}
            r["rehearsal"] = {"decode_tokens_per_s": 1800.0, **moved}
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert "† per-block stream times of the point's rehearsal pass" in md
    # 48 x 32 tokens / 2300 tok/s = 0.67 s per block, retrieval 0.8 of it (the fixture's)
    assert "| herald | 48 | 2300 |" in md and "| 0.67† | 0.53 | 0.00 |" in md
    # the note, the Fig. 12 rows (80 GB cap; whole GPU = the 80 GB run) and the every-point row
    assert md.count("†") == 4


def test_report_without_matplotlib_writes_its_tables_and_says_so(tmp_path, monkeypatch, capsys):
    """matplotlib is the ``plot`` extra: without it the README and its tables are written, no
    plot is, and one line on stderr says that the plots were skipped and how to get them."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    write_fixture(tmp_path)
    assert throughput.main(["--report", str(tmp_path)]) == 0
    md = (tmp_path / "README.md").read_text()
    assert "## Table II analog" in md and "| 32K | HERALD 5.0% | 64 | 2500 (2.00x) |" in md
    assert "## Fig. 12 analog" in md and "| herald | 48 | 2300 |" in md
    assert "no plots: matplotlib is not installed here; pip install 'herald[plot]'" in md
    assert not list(tmp_path.glob("*.png")) and "![Fig." not in md
    err = capsys.readouterr().err.splitlines()
    skipped = [line for line in err if "plots skipped" in line]
    assert skipped == [
        "throughput report: plots skipped (matplotlib is not installed); for plots: "
        "pip install 'herald[plot]' (from a checkout: pip install -e '.[plot]')"
    ]
