"""Plans: merged sweeps, parts, filters, and the runner's peak / reuse resolution."""

from __future__ import annotations

import pytest

from herald.bench import throughput
from herald.bench import throughput_plan as plan
from herald.bench.throughput_plan import CAP_H100, K16, K32, LLADA, SDAR
from herald.bench.throughput_run import Runner


def test_all_plan_merges_shared_sweeps():
    sweeps = plan.build_plan("all")
    keys = [s.key for s in sweeps]
    assert len(keys) == len(set(keys))
    # Table II's HERALD (5%, 80 GB, T = 20) is also Fig. 13's top rung and Fig. 14's T = 20
    her = [s for s in sweeps if s.key == plan.sweep_key(LLADA, K32, "herald", 0.05, CAP_H100, 20)]
    assert len(her) == 1 and her[0].figure == "table2"
    # Fig. 13's MAGE runs at 5% (the paper's ablation), Table II's at 2.5%: two sweeps
    mage = [s for s in sweeps if (s.model, s.context, s.variant) == (LLADA, K32, "mage")]
    assert sorted(s.budget for s in mage if s.gpu_cap_gb) == [0.025, 0.05]
    fig14 = [s for s in sweeps if s.figure == "fig14"]
    assert {s.steps for s in fig14} == {8, 12, 16, 24, 32} and all(not s.batches for s in fig14)
    # grouped by model: LLaDA2.0-mini first, then SDAR-8B-Chat
    models = [s.model for s in sweeps]
    assert models == sorted(models, key=[LLADA, SDAR].index)
    uncapped = [s for s in sweeps if s.gpu_cap_gb is None and s.variant != "dense"]
    assert uncapped and all(s.reuse_cap_gb == CAP_H100 for s in uncapped)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_parts_cover_the_plan_once(n):
    sweeps = plan.build_plan("all")
    parts = [plan.split_parts(sweeps, i, n) for i in range(1, n + 1)]
    assert [s for p in parts for s in p] == sweeps
    assert all(parts)


def test_filters_and_part_parsing():
    sweeps = plan.build_plan("table2")
    got = plan.filter_sweeps(sweeps, models=[SDAR], contexts=[K16], caps=[None])
    assert {(s.model, s.context, s.gpu_cap_gb) for s in got} == {(SDAR, K16, None)}
    assert len(plan.filter_sweeps(sweeps, variants=["herald"], caps=[CAP_H100])) == 4
    assert plan.parse_part("2/5") == (2, 5)
    for bad in ("3", "0/2", "3/2", "a/b"):
        with pytest.raises(ValueError):
            plan.parse_part(bad)


def _point(sweep, batch, status="ok", tps=100.0):
    # the default settings a resumed record must share: graphs and kv_pad 512 when offloading,
    # kv_pad 0 for dense
    setting = (
        {"offload_cuda_graph": True, "kv_pad": 512}
        if plan.VARIANTS[sweep.variant].offload
        else {"kv_pad": 0}
    )
    if plan.VARIANTS[sweep.variant].rehearses and status == "ok":
        setting["rehearsal"] = {"decode_tokens_per_s": tps}
    return {"kind": "point", "model": sweep.model, "context": sweep.context,
            "variant": sweep.variant, "budget": sweep.budget, "gpu_cap_gb": sweep.gpu_cap_gb,
            "steps": sweep.steps, "batch": batch, "status": status, "device": "cpu",
            "decode_tokens_per_s": tps, **setting}  # fmt: skip


def runner_of_the_whole_plan(tmp_path, *flags):
    """A Runner of ``--plan all`` (CPU, ``flags`` added) and its LLaDA2.0-mini sweeps by
    (figure, context, variant, steps, GPU cap)."""
    args = throughput.build_parser().parse_args(
        ["--plan", "all", "--device", "cpu", "--out", str(tmp_path), *flags]
    )
    sweeps = plan.build_plan("all")
    by = {(s.figure, s.context, s.variant, s.steps, s.gpu_cap_gb): s for s in sweeps
          if s.model == LLADA}  # fmt: skip
    return Runner(args, sweeps, sweeps), by


def test_runner_resolves_peaks_and_reuses_uncapped_sweeps(tmp_path):
    run, by = runner_of_the_whole_plan(tmp_path)
    t20 = by[("table2", K32, "herald", 20, CAP_H100)]
    t8 = by[("fig14", K32, "herald", 8, CAP_H100)]
    whole = by[("table2", K32, "herald", 20, None)]
    # nothing measured yet: the T = 8 point and the uncapped sweep wait for the 80 GB T = 20 one
    assert run.plan_sweep(t8) == ("defer", [])
    assert run.plan_sweep(whole) == ("defer", [])
    assert run.plan_sweep(t20) == ("run", list(t20.batches))
    # the 80 GB sweep done, peak at 48, ended by DRAM at 64
    tps = {16: 900.0, 32: 1500.0, 48: 1800.0}
    run.records += [_point(t20, b, tps=t) for b, t in tps.items()] + [_point(t20, 64, "dram")]
    assert run.plan_sweep(t20) == ("done", [])
    assert run.plan_sweep(t8) == ("run", [48])
    assert run.plan_sweep(whole) == ("reuse", [])
    # an out-of-memory point at the cap: the uncapped sweep must run
    run.records[-1] = _point(t20, 64, "oom")
    assert run.plan_sweep(whole) == ("run", list(whole.batches))


def test_a_smaller_hosts_dram_end_does_not_close_a_bigger_hosts_sweep():
    from herald.bench.throughput_records import point_records, sweep_status

    sweep = next(
        s
        for s in plan.build_plan("all")
        if (s.model, s.context, s.variant, s.gpu_cap_gb) == (SDAR, K32, "infinigen", None)
    )
    runs = [
        {"kind": "run", "run_id": rid, "machine": {"mem_total_gib": gib}}
        for rid, gib in (("big", 251.8), ("small", 125.9))
    ]
    pts = [{**_point(sweep, b), "run_id": "big"} for b in (8, 16, 24, 32)]
    pts.append({**_point(sweep, 40, status="dram"), "run_id": "small"})
    records = runs + pts
    # on the big host (or in the report: no host given) bs 40 and 48 are still to measure
    for here in (251.8, None):
        recs = point_records(records, sweep, here_gib=here)
        assert sorted(recs) == [8, 16, 24, 32]
        assert sweep_status(recs, sweep.batches) == ([40, 48], False)
    # on a host no bigger than the one that found the bound, it ends the sweep: 0 pending
    recs = point_records(records, sweep, here_gib=125.9)
    assert sweep_status(recs, sweep.batches) == ([], True)
    # a DRAM end on the sweep's own host still ends it
    records[-1]["run_id"] = "big"
    assert sweep_status(point_records(records, sweep), sweep.batches) == ([], True)
