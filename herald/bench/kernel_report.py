"""README.md and kernel.png of the selection-kernel benchmark (:mod:`herald.bench.kernel`).

Separate so that the report can be regenerated from a kernel.json where matplotlib (the ``plot``
extra) is installed (``python -m herald.bench.kernel --report DIR``), e.g. when the benchmark
machine lacks it: there the README is written and the plot skipped, with one line saying so.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from herald.bench import plotting

SHAPES = {"llada2-mini": (4, 4, 128), "sdar-8b": (8, 4, 128)}  # KV heads, G, head_dim
PAGE = 32
BUDGET = 0.05
TARGET_BW_FRAC, TARGET_SPEEDUP = 0.85, 8.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_report(res: dict[str, Any], out: Path) -> None:
    """README.md (tables, targets) and kernel.png from the results dict."""
    s, m, dram = res["summary"], res["machine"], res["dram"]
    status = lambda ok: "**met**" if ok else "**missed**"  # noqa: E731
    bwt, qs, vn = s["bandwidth"], s["query_speedup"], s["vs_naive"]
    one = res.get("extras", {}).get("one_thread", {})
    lines = [
        "# Selection kernel benchmark (HERALD §IV-B4)",
        "",
        f"`{res['command']}` on {res['date']}"
        + (" (**smoke run: tiny sizes**)" if res["smoke"] else ""),
        "",
        f"Machine: {m.get('cpu_model', '?')}, {m.get('cpu_count')} CPUs, {m.get('threads_used')} threads used, "
        f"{m.get('mem_total_gib', '?')} GiB; flags: {' '.join(m.get('cpu_flags', []))}. "
        f"Kernel: {m['kernel'].get('backend')} / {m['kernel'].get('isa')} ({m['kernel'].get('origin')}), "
        f"prefetch {m['kernel'].get('prefetch')}; torch {m.get('torch')}, Python {m.get('python')}.",
        "",
        "Workload: one layer, a batch whose K is ~"
        f"{res['config']['k_gib']:.2f} GiB, page {PAGE}, budget {BUDGET:.0%}, G = 4, D = 128; "
        "bytes = K (selected mode) or K + V (full mode); DRAM = best of torch sum and the native "
        "read probe over a large bf16 array, all threads.",
        "",
        "## DRAM read bandwidth (GB/s)",
        "",
        "| probe | all threads | 1 thread |",
        "| --- | --- | --- |",
    ]
    for probe in ("torch_sum", "native_probe"):
        if f"{probe}_all_gbs" in dram:
            lines.append(
                f"| {probe} | {dram[f'{probe}_all_gbs']:.1f} | {dram[f'{probe}_1_gbs']:.1f} |"
            )
    worst_bw = min(bwt["runs"], key=lambda b: b["frac_dram"], default=None)
    lines += [
        "",
        "## Targets",
        "",
        "| target | result | status |",
        "| --- | --- | --- |",
        f"| n_q = {qs['to']} streams >= {TARGET_BW_FRAC:.0%} of DRAM read bandwidth | worst "
        f"{100 * bwt['min_frac']:.1f}%"
        + (f" ({worst_bw['shape']}, S={worst_bw['S']}, {worst_bw['mode']})" if worst_bw else "")
        + f" | {status(bwt['met'])} |",
        f"| {qs['from']} -> {qs['to']} queries speeds the kernel up >= {TARGET_SPEEDUP:.0f}x | worst "
        f"{qs['min']:.1f}x | {status(qs['met'])} |",
        f"| fused beats naive PyTorch at every point | worst {vn['min']:.2f}x | {status(vn['met'])} |",
        "",
    ]
    if not bwt["met"] and one:
        lines.append(
            f"Bandwidth: one thread runs n_q = 1 selection at {one['gbs']:.1f} GB/s against "
            f"{dram['reference_1_gbs']:.1f} GB/s one-thread DRAM reads "
            f"({100 * one.get('frac_dram_1thread', 0):.0f}%): where that is well below 100%, the "
            "per-core compute (bf16 widening, FMAs, the per-page softmax statistics, top-k) does not "
            "fully hide under the memory stream; see the prefetch sweep below."
        )
    if not qs["met"]:
        lines.append(
            f"Query speed-up: at n_q = {qs['from']} the kernel is compute-bound ("
            + ", ".join(f"{x['gflops_at_max_nq']:.0f}" for x in qs["runs"])
            + " GFLOP/s across the configurations), at n_q = 1 memory-bound; the ratio is bounded by "
            "compute time at 32 queries over memory time at 1, so a more efficient 32-query path "
            "lowers it. The paper's 8x comes from a machine with a different compute/bandwidth ratio."
        )
    lines += ["", "## Throughput", ""]
    for shape in SHAPES:
        for seq in sorted({r["S"] for r in res["runs"]}):
            rows = [r for r in res["runs"] if r["shape"] == shape and r["S"] == seq]
            if not rows:
                continue
            fr = next(r for r in rows)
            lines += [
                f"### {shape}, S = {seq} ({fr['n_req']} requests, {fr['items']} (request, KV head) items)",
                "",
                "| mode | n_q | fused ms | fused GB/s | % DRAM | naive ms | fused / naive |",
                "| --- | --- | --- | --- | --- | --- | --- |",
            ]
            for mode in ("selected", "full"):
                for r in sorted(
                    (r for r in rows if r["mode"] == mode and r["path"] == "fused"),
                    key=lambda r: r["n_q"],
                ):
                    nv = next(
                        (
                            x
                            for x in rows
                            if x["path"] == "naive" and x["mode"] == mode and x["n_q"] == r["n_q"]
                        ),
                        None,
                    )
                    nms = f"{nv['best_s'] * 1e3:.1f}" if nv else "-"
                    sp = f"{nv['best_s'] / r['best_s']:.2f}x" if nv else "-"
                    lines.append(
                        f"| {mode} | {r['n_q']} | {r['best_s'] * 1e3:.2f} | {r['gbs']:.1f} | "
                        f"{100 * r['frac_dram']:.1f} | {nms} | {sp} |"
                    )
            lines.append("")
    lines += [
        "## Speed-up from n_q = 32 to n_q = 1 (fused)",
        "",
        "| shape | S | mode | speed-up | GFLOP/s at n_q max |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {x['shape']} | {x['S']} | {x['mode']} | {x['speedup']:.1f}x | {x['gflops_at_max_nq']:.0f} |"
        for x in qs["runs"]
    ]
    ex = res.get("extras", {})
    if ex:
        lines += [
            "",
            "## Extras (LLaDA2.0-mini shapes, largest S)",
            "",
            "Prefetch (n_q = 1, selected):",
            "",
            "| HERALD_SELECTION_PREFETCH | GB/s | % DRAM |",
            "| --- | --- | --- |",
        ]
        lines += [
            f"| {k} | {v['gbs']:.1f} | {100 * v['frac_dram']:.1f} |"
            for k, v in ex["prefetch"].items()
        ]
        lines += [
            "",
            "ISA variants (HERALD_SELECTION_ISA):",
            "",
            "| isa | n_q | mode | ms | GB/s |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {x['isa']} | {x['n_q']} | {x['mode']} | {x['best_s'] * 1e3:.2f} | {x['gbs']:.1f} |"
            for x in ex["isa"]
        ]
        lines += [
            "",
            f"One thread, n_q = 1, selected: {one['gbs']:.2f} GB/s. Gather of the selected K+V rows: "
            f"{ex['gather']['bytes'] / 2**20:.0f} MiB in {ex['gather']['best_s'] * 1e3:.2f} ms ({ex['gather']['gbs']:.1f} GB/s).",
        ]
    lines += [
        "",
        "## Correctness checks (float64 reference, before timing)",
        "",
        "| path | mode | ok | rel err | mass ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in res["checks"]:
        lines.append(
            f"| {c['path']} | {c['mode']} | {c['ok']} | {c.get('rel_err', float('nan')):.1e} | {c.get('mass_ratio', float('nan')):.6f} |"
        )
    lines += ["", KNOWN_LIMITS, "", "Raw numbers: `kernel.json`; plot: `kernel.png`.", ""]
    (out / "README.md").write_text("\n".join(lines))
    plot_throughput(res, out / "kernel.png")


def plot_throughput(res: dict[str, Any], png: Path) -> None:
    """kernel.png: selection throughput vs n_q per shape and prefix, fused and naive, both
    output modes, with each mode's DRAM bound; skipped (one line says so) without matplotlib."""
    plt = plotting.pyplot()
    if plt is None:
        plotting.skipped("kernel report (no kernel.png)")
        return
    dram = res["dram"]
    seqs = sorted({r["S"] for r in res["runs"]})
    fig, axes = plt.subplots(
        len(SHAPES), len(seqs), figsize=(5.5 * len(seqs), 4.2 * len(SHAPES)), squeeze=False
    )
    for i, shape in enumerate(SHAPES):
        for j, seq in enumerate(seqs):
            ax = axes[i][j]
            for mode, color in (("selected", "tab:blue"), ("full", "tab:orange")):
                for path, style in (("fused", "-"), ("naive", "--")):
                    pts = sorted(
                        (r["n_q"], r["mtok_per_s"])
                        for r in res["runs"]
                        if (r["shape"], r["S"], r["mode"], r["path"]) == (shape, seq, mode, path)
                    )
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            style,
                            color=color,
                            marker="o",
                            label=f"{path} {mode}",
                        )
                bound = (
                    dram["reference_gbs"]
                    * 1e3
                    / (SHAPES[shape][2] * 2 * (2 if mode == "full" else 1))
                )
                ax.axhline(bound, color=color, linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{shape}, S = {seq}")
            ax.set_xlabel("queries per selection (n_q)")
            ax.set_ylabel("M (token, KV head) / s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Selection throughput (dotted: DRAM bound per mode; dashed: naive PyTorch)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


KNOWN_LIMITS = """## Reading these numbers

- Run-to-run spread is about 10% at n_q = 1: the same point (llada2-mini, S = 32768, selected)
  appears three times in one run (throughput table, prefetch sweep, ISA comparison) at 76.9,
  69.4 and 76.5 GB/s. That spread is as large as the gap to the 85% target, so a point near the
  line is not a clear pass or miss; the worst n_q = 1 points (75-80%) are a miss.
- What limits n_q = 1: one thread streams 7.2 GB/s of K through the kernel against 12.7 GB/s of
  plain reads, so per-core work (bf16 widening, FMAs, the per-page softmax statistics, top-k) is
  not fully hidden; with 16 threads the kernel needs ~6 GB/s a core, close to what a core does.
  The prefetch sweep put `t1:1` (prefetch into L2, one page ahead) 4 points above the default
  `t0:1`; measure again before changing the default.
- n_q = 32 is compute-bound in fp32 FMAs (~6 GB/s); AMX tiles (the CPU has them) are the next
  step there, which would also shrink the 32 -> 1 ratio."""
