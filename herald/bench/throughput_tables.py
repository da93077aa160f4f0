"""The tables of the throughput report (:mod:`herald.bench.throughput_report`): the Table II,
Fig. 12, Fig. 13 and Fig. 14 analogs of HERALD §VI-C / §VI-D with their plots, what the 80 GB
cap costs against a real H100, the DRAM-bounded batches, every sweep and every point.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from herald.bench import throughput_plan as plan
from herald.bench import throughput_plots as tplots
from herald.bench.ceilings import NAMES as CEILING_NAMES
from herald.bench.throughput_data import (
    MIXED_SUFFIX,
    RELEVANT,
    Data,
    block_stat,
    cap_label,
    cell,
    lowest_ceiling,
    mean_of,
    planned_batches,
    rehearsal_mark,
    stop_reason,
    variant_label,
)
from herald.bench.throughput_plan import CAP_H100, LLADA, SDAR, VARIANTS
from herald.bench.throughput_plan import ctx_label as _ctx
from herald.bench.throughput_records import peak


def table2(d: Data, cap: float | None) -> list[str]:
    models = [m for m in d.models() if m in (LLADA, SDAR)] or d.models()
    head = "| ctx | method |" + "".join(
        f" {plan.model_name(m)}: bs | tok/s (x Dense) | paper bs / tok/s | sweep ended by |"
        for m in models
    )
    lines = [f"### {cap_label(cap)}", ""]
    if d.common_host is not None:
        lines += [
            f"Points ran on a host with {d.common_host[0]} cores and {d.common_host[1]} GiB of "
            "DRAM unless a row says otherwise.",
            "",
        ]
    lines += [head, "|" + " --- |" * (2 + 4 * len(models))]
    for ctx in d.contexts():
        for v in plan.TABLE2_VARIANTS:
            var = VARIANTS[v]
            name = var.label + (f" {var.default_budget:.1%}" if var.default_budget else "")
            row = f"| {_ctx(ctx)} | {name} |"
            for m in models:
                recs, note = d.sweep(m, ctx, v, var.default_budget, cap)
                top = peak(recs)
                dense = peak(d.sweep(m, ctx, "dense", None, cap)[0])
                ratio = (
                    f" ({top['decode_tokens_per_s'] / dense['decode_tokens_per_s']:.2f}x)"
                    if top and dense else ""
                )  # fmt: skip
                pb, pt = plan.PAPER_TABLE2.get((m, ctx, v), ("-", "-"))
                row += (
                    f" {top['batch'] if top else '-'} | {cell(top['decode_tokens_per_s'] if top else None)}{ratio}"
                    f" | {pb} / {pt} | {stop_reason(recs, planned_batches(m, ctx, v))}{f' ({note})' if note else ''}{d.machine_note(top)} |"
                )
            lines.append(row)
    return lines


_POOL_END = re.compile(r"CPU pool holds (\d+) pages \(([\d.]+) GiB\), batch (\d+) needs (\d+)")


H100_MIB = 81559
"""An H100 80GB's memory as nvidia-smi reports it (79.6 GiB): more than the 80 GB cap's 80e9
bytes (74.5 GiB)."""
H100_MARGIN_GIB = 2.0
"""What a point's allocated peak must leave of an H100's memory to be taken as fitting: the CUDA
context (~0.5 GiB; outside the cap here, inside the H100's memory) and the allocator's reserve
over what it allocates (LLaDA2.0-mini 16K dense bs 64 allocated at most 73.8 GiB and did not
fit under the 74.5 GiB cap)."""


def h100_room(d: Data) -> list[str]:
    """What the 80 GB cap's 5.1 GiB below a real H100 costs: of the 80 GB sweeps that ended in
    GPU OOM, those with a whole-GPU point that peaked under an H100's memory and beat the
    capped peak (such a point would fit on the H100 too, less its CUDA context, ~0.5 GiB), and
    HERALD / Dense at that context with that point."""
    h100 = H100_MIB / 1024
    room = h100 - H100_MARGIN_GIB
    lines = [
        f"The 80 GB cap is 80e9 bytes ({CAP_H100 * 1e9 / 2**30:.1f} GiB); an H100 80GB holds "
        f"{H100_MIB:,} MiB ({h100:.1f} GiB). Sweeps the cap ended in GPU OOM, against the same "
        f"mode on the whole GPU, where a point whose allocated peak stayed under {room:.1f} GiB "
        f"would likely fit on an H100 too ({H100_MARGIN_GIB:g} GiB left for the CUDA context and "
        "the allocator's reserve over what it allocates):",
        "",
    ]
    rows = 0
    for m in d.models():
        for ctx in d.contexts(m):
            hr = peak(d.sweep(m, ctx, "herald", 0.05, CAP_H100)[0])
            dn = peak(d.sweep(m, ctx, "dense", None, CAP_H100)[0])
            for v in plan.TABLE2_VARIANTS:
                budget = VARIANTS[v].default_budget
                capped = d.sweep(m, ctx, v, budget, CAP_H100)[0]
                if not stop_reason(capped).startswith("GPU OOM"):
                    continue
                whole, note = d.sweep(m, ctx, v, budget, None)
                known = {b: r for b, r in whole.items()
                         if r["status"] == "ok" and r.get("peak_gpu_gib") is not None}  # fmt: skip
                if note.startswith("=") or not known:
                    continue  # no whole-GPU sweep with memory peaks: nothing to say
                top = peak(capped)
                fit = peak({b: r for b, r in known.items() if r["peak_gpu_gib"] <= room})
                nxt = min(
                    (r for r in known.values() if r["peak_gpu_gib"] > room),
                    key=lambda r: r["batch"], default=None,
                )  # fmt: skip
                name = f"- {plan.model_name(m)} {_ctx(ctx)} {VARIANTS[v].label}:"
                rows += 1
                if (
                    top
                    and fit
                    and fit["batch"] > top["batch"]
                    and fit["decode_tokens_per_s"] > top["decode_tokens_per_s"]
                ):
                    lines.append(
                        f"{name} bs {fit['batch']} peaked at {fit['peak_gpu_gib']:.1f} GiB on the "
                        f"whole GPU, {fit['decode_tokens_per_s']:.0f} tok/s, against "
                        f"{top['decode_tokens_per_s']:.0f} (bs {top['batch']}) under the cap"
                    )
                    if v == "dense" and hr and dn:
                        lines.append(
                            f"  - so on an H100, HERALD / Dense at {plan.model_name(m)} {_ctx(ctx)} "
                            f"would be about {hr['decode_tokens_per_s'] / fit['decode_tokens_per_s']:.2f}x, "
                            f"not {hr['decode_tokens_per_s'] / dn['decode_tokens_per_s']:.2f}x"
                        )
                else:
                    more = (
                        f": its next batch on the whole GPU, bs {nxt['batch']}, peaked at "
                        f"{nxt['peak_gpu_gib']:.1f} GiB"
                        if nxt
                        else ""
                    )
                    lines.append(f"{name} no larger, faster batch fits in {room:.1f} GiB{more}")
    return lines if rows else []


def dram_bounds(d: Data) -> list[str]:
    """One line per (model, context) whose offloading sweeps ended on the CPU pool: how many
    requests the pool held (from the DRAM end's message: pool pages // pages per request) and
    on which host. The issue asks for the DRAM-bounded batch to be stated where a bigger host
    was not available."""
    got: dict[tuple[str, int], tuple[int, float, int, Any]] = {}
    for p in d.points:
        if plan.record_contexts(p) != plan.UNIFORM:
            continue  # the same pages as the uniform point (the longest context): no news
        m = _POOL_END.search(p.get("error") or "") if p["status"] == "dram" else None
        if not m:
            continue
        pages, gib, batch, need = int(m[1]), float(m[2]), int(m[3]), int(m[4])
        fits = pages // -(-need // batch)
        key = (p["model"], p["context"])
        if key not in got or fits < got[key][2]:
            got[key] = (pages, gib, fits, d.host.get(p.get("run_id", "")))
    if not got:
        return []
    return [
        "Sweeps ended by DRAM: the CPU pool (the DRAM free at a run's start less a reserve) "
        "bounds the batch there, not a throughput ceiling; a larger batch of an offloading mode "
        "needs more DRAM (the two-GPU machine variant has 256 GiB):",
        "",
        *(
            f"- {plan.model_name(m)} {_ctx(c)}: at most **{fits} requests** (pool {gib:.1f} GiB "
            f"= {pages} pages" + (f"; host: {h[0]} cores, {h[1]} GiB)" if h else ")")
            for (m, c), (pages, gib, fits, h) in sorted(got.items())
        ),
    ]


def fig12(d: Data, out: Path, model: str, cap: float | None, plots: list[str]) -> list[str]:
    ctx = max(d.contexts(model))  # 32K in the plan
    lines = [f"### {plan.model_name(model)}, {_ctx(ctx)}, {cap_label(cap)}", ""]
    series = {
        v: d.sweep(model, ctx, v, VARIANTS[v].default_budget, cap)[0] for v in plan.TABLE2_VARIANTS
    }
    if not any(series.values()):
        return lines + ["(no points yet)"]
    lines += ["| mode | bs | tok/s | fwd ms | per-step fetch | per-block fetch | per-block fetch, full KV | CPU selection | CPU sel. at DRAM speed (est.) | GPU forward | main s/block | retrieval s/block | stall s/block | lowest ceiling of the mode |",
              "| --- |" + " --- |" * 13]  # fmt: skip
    for v, recs in series.items():
        for bs in sorted(recs):
            r = recs[bs]
            if r["status"] != "ok":
                lines.append(f"| {v} | {bs} | {r['status']} |" + " |" * 11)
                continue
            c = d.ceilings(r)
            keys = RELEVANT.get(v, tuple(c))
            lines.append(
                f"| {v} | {bs} | {r['decode_tokens_per_s']:.0f} | {r['forward_median_s'] * 1e3:.1f} "
                f"| {cell(c.get('per_step_fetch'))} | {cell(c.get('per_block_fetch'))} | {cell(c.get('full_kv_per_block_fetch'))} "
                f"| {cell(c.get('cpu_selection'))} "
                f"| {cell(c.get('cpu_selection_dram'))} | {cell(c.get('gpu_forward'))} "
                f"| {cell(mean_of(block_stat(r, 'block_main_s')), '.2f')}{rehearsal_mark(r)} | {cell(mean_of(block_stat(r, 'block_retrieval_s')), '.2f')} "
                f"| {cell(mean_of(block_stat(r, 'block_stall_s')), '.2f')} | {CEILING_NAMES.get(lowest_ceiling(c, keys), '-')} |"
            )
    name = f"fig12_{plan.model_name(model)}_{'cap' + format(cap, 'g') if cap else 'h200'}.png"
    if tplots.plot_fig12(
        d.ceilings, series, out / name, f"{plan.model_name(model)} {_ctx(ctx)}, {cap_label(cap)}"
    ):
        plots.append(name)
        lines += ["", f"![Fig. 12 analog]({name})"]
    return lines


def fig13(d: Data, out: Path, plots: list[str]) -> list[str]:
    lines = ["| ctx | configuration (5%, 80 GB cap) | bs | peak tok/s | x previous | x MAGE (GPU sel.) | paper tok/s | sweep ended by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    bars: dict[int, list[tuple[str, float]]] = {}
    for ctx in d.contexts(LLADA):
        base = prev = None
        for v in plan.FIG13_RUNGS:
            recs, _ = d.sweep(LLADA, ctx, v, 0.05, CAP_H100)
            top = peak(recs)
            tps = top["decode_tokens_per_s"] if top else None
            if v == plan.FIG13_RUNGS[0]:  # the ratio column is against MAGE (GPU selection) only
                base = tps
            lines.append(
                f"| {_ctx(ctx)} | {VARIANTS[v].label} | {top['batch'] if top else '-'} | {cell(tps)} "
                f"| {cell(tps / prev if tps and prev else None, '.2f')} | {cell(tps / base if tps and base else None, '.2f')} "
                f"| {plan.PAPER_FIG13.get(ctx, {}).get(v, '-')} | {stop_reason(recs, planned_batches(LLADA, ctx, v))} |"
            )
            prev = tps if tps else prev
            if tps and base:  # bars are speed-ups over MAGE (GPU selection): none without it
                bars.setdefault(ctx, []).append((VARIANTS[v].label, tps / base))
    if tplots.plot_bars(bars, out / "fig13_ablation.png"):
        plots.append("fig13_ablation.png")
        lines += ["", "![Fig. 13 analog](fig13_ablation.png)"]
    return lines


def fig14(d: Data, out: Path, plots: list[str]) -> list[str]:
    # the T = 20 row is the Table II sweeps' point, often from another run than the other T
    # rows: the time column shows it (see Repeatability for how much runs differ)
    lines = ["| ctx | T | Dense bs | Dense tok/s | HERALD bs | HERALD tok/s | HERALD / Dense | main s/block | retrieval s/block | stall s/block | HERALD measured (UTC) |",
             "| --- |" + " --- |" * 10]  # fmt: skip
    data: dict[int, list[tuple[int, float | None, float | None, float | None, float | None]]] = {}
    for ctx in d.contexts(LLADA):
        for t in plan.FIG14_STEPS:
            # a T sweep has one batch: the peak batch of the T = 20 sweep (or the paper's)
            dn = _single(d, ctx, "dense", None, t)
            hr = _single(d, ctx, "herald", 0.05, t)
            if not dn and not hr:
                continue
            dt, ht = (r["decode_tokens_per_s"] if r else None for r in (dn, hr))
            main, retr = (
                mean_of(block_stat(hr, "block_main_s")),
                mean_of(block_stat(hr, "block_retrieval_s")),
            )
            lines.append(
                f"| {_ctx(ctx)} | {t} | {dn['batch'] if dn else '-'} | {cell(dt)} | {hr['batch'] if hr else '-'} "
                f"| {cell(ht)} | {cell(ht / dt if ht and dt else None, '.2f')} | {cell(main, '.2f')}{rehearsal_mark(hr)} | {cell(retr, '.2f')} "
                f"| {cell(mean_of(block_stat(hr, 'block_stall_s')), '.2f')} "
                f"| {(hr.get('time_utc') or '-')[:16] if hr else '-'} |"
            )
            data.setdefault(ctx, []).append((t, dt, ht, main, retr))
    if tplots.plot_fig14(data, out / "fig14_steps.png"):
        plots.append("fig14_steps.png")
        lines += ["", "![Fig. 14 analog](fig14_steps.png)"]
    return lines


def _single(d: Data, ctx: int, v: str, budget: float | None, t: int) -> dict[str, Any] | None:
    """The Fig. 14 point at T = t: the T = 20 sweep's peak batch, else any measured batch."""
    recs, _ = d.sweep(LLADA, ctx, v, budget, CAP_H100, t)
    ref = peak(d.sweep(LLADA, ctx, v, budget, CAP_H100, 20)[0])
    if ref and ref["batch"] in recs and recs[ref["batch"]]["status"] == "ok":
        return recs[ref["batch"]]
    return peak(recs)


def all_points(d: Data) -> list[str]:
    lines = ["<details><summary>Every measured point</summary>", "",
             "| model | ctx | variant | budget | cap | T | bs | status | tok/s | fwd ms | step0 ms | step1 ms | commit ms | main s | retrieval s | stall s | selection s/block | peak GiB | wall s |",
             "| --- |" + " --- |" * 18]  # fmt: skip
    for p in sorted(
        d.points,
        key=lambda p: (
            p["model"],
            p["context"],
            p["variant"],
            plan.record_contexts(p) != plan.UNIFORM,
            p["gpu_cap_gb"] or 1e9,
            p["steps"],
            p["batch"],
        ),
    ):
        ms = _ms_of(p)
        sel = (p.get("selection_kernel") or {}).get("block_s")
        lines.append(
            f"| {p['model_name']} | {p['context']} | {variant_label(p)} | {cell(p['budget'], '.3f') if p['budget'] else '-'} "
            f"| {p['gpu_cap_gb'] or '-'} | {p['steps']} | {p['batch']} | {p['status']} "
            f"| {cell(p.get('decode_tokens_per_s'))} | {ms('forward_median_s')} | {ms('step0_median_s')} | {ms('step1_median_s')} "
            f"| {ms('commit_median_s')} | {cell(mean_of(block_stat(p, 'block_main_s')), '.2f')}{rehearsal_mark(p)} | {cell(mean_of(block_stat(p, 'block_retrieval_s')), '.2f')} "
            f"| {cell(mean_of(block_stat(p, 'block_stall_s')), '.2f')} | {cell(sel, '.2f')} | {cell(p.get('peak_gpu_gib'), '.1f')} | {cell(p.get('wall_seconds'))} |"
        )
    return lines + ["", "</details>"]


def _ms_of(p: dict[str, Any]) -> Any:
    def ms(key: str) -> str:
        x = p.get(key) if p["status"] == "ok" else None
        return cell(x * 1e3 if x else None, ".1f")

    return ms


def sweeps_summary(d: Data) -> list[str]:
    lines = ["## Every sweep", "",
             "| model | ctx | variant | budget | cap | T | batches | peak bs | peak tok/s | sweep ended by |",
             "| --- |" + " --- |" * 9]  # fmt: skip
    for key in sorted(
        d.sweeps,
        key=lambda k: (k[0], k[1], k[2], k[6] != plan.UNIFORM, k[4] or 1e9, k[5], k[3] or 0),
    ):
        recs = d.sweeps[key]
        model, ctx, v, budget, cap, t, contexts = key
        top = peak(recs)
        name = v + (MIXED_SUFFIX if contexts == plan.MIXED else "")
        lines.append(
            f"| {plan.model_name(model)} | {ctx} | {name} | {cell(budget, '.3f') if budget else '-'} | {cap or '-'} | {t} "
            f"| {', '.join(str(b) for b in sorted(recs))} | {top['batch'] if top else '-'} "
            f"| {cell(top['decode_tokens_per_s'] if top else None)} "
            f"| {stop_reason(recs, planned_batches(model, ctx, v) if t == 20 else ())} |"
        )
    return lines


def mixed_contexts(d: Data) -> list[str]:
    """Uniform against mixed contexts (``--mixed-contexts``), point by point: the same point
    measured twice in one run, every request at the context, then each request at its own
    context; [] when no mixed point was measured."""
    mixed = sorted(
        (k for k in d.sweeps if k[6] == plan.MIXED),
        key=lambda k: (k[0], k[1], k[2], k[4] or 1e9, k[5], k[3] or 0),
    )
    if not mixed:
        return []
    lines = ["## Uniform vs mixed contexts", "",
             "Points measured twice in one run, one after the other: every request at the context (uniform: one KV length), then request i of n at its own context, round(i x span / (n - 1)) blocks shorter, span = context // 2 // block size (mixed: from the context down to about half of it, each row its own KV length, as served requests; same engine, T and pool).", "",
             "| model | ctx | variant | budget | cap | T | bs | mixed mean / min ctx | uniform tok/s | mixed tok/s | mixed / uniform | uniform fwd ms | mixed fwd ms | uniform main s/block | mixed main s/block |",
             "| --- |" + " --- |" * 14]  # fmt: skip
    for key in mixed:
        model, ctx, v, budget, cap, t, _ = key
        uniform = d.sweeps.get((*key[:6], plan.UNIFORM), {})
        for bs, m in sorted(d.sweeps[key].items()):
            u = uniform.get(bs)
            um, mm = (r if r and r["status"] == "ok" else None for r in (u, m))
            ut, mt = (r["decode_tokens_per_s"] if r else None for r in (um, mm))
            uf, mf = (r["forward_median_s"] * 1e3 if r else None for r in (um, mm))
            lines.append(
                f"| {plan.model_name(model)} | {ctx} | {v} | {cell(budget, '.3f') if budget else '-'} | {cap or '-'} | {t} | {bs} "
                f"| {cell(m.get('mean_context'))} / {m.get('min_context', '-')} "
                f"| {cell(ut) if um or not u else u['status']} | {cell(mt) if mm else m['status']} "
                f"| {cell(mt / ut if mt and ut else None, '.2f')} | {cell(uf, '.1f')} | {cell(mf, '.1f')} "
                f"| {cell(mean_of(block_stat(um, 'block_main_s')), '.2f')} | {cell(mean_of(block_stat(mm, 'block_main_s')), '.2f')} |"
            )
    return lines
