"""Plots of the throughput report (:mod:`herald.bench.throughput_report`), matplotlib Agg;
each function returns False, writing nothing, where matplotlib is not installed
(:func:`herald.bench.plotting.pyplot`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from herald.bench.ceilings import NAMES as CEILING_NAMES
from herald.bench.plotting import pyplot
from herald.bench.throughput_plan import VARIANTS
from herald.bench.throughput_plan import ctx_label as _ctx

Ceilings = Callable[[dict[str, Any]], dict[str, float]]


def plot_fig12(
    ceilings: Ceilings, series: dict[str, dict[int, dict[str, Any]]], path: Path, title: str
) -> bool:
    """Throughput vs batch per mode, with the ceilings that can bind HERALD (per-block fetch,
    CPU selection, GPU forward; and the per-step fetch it avoids by fetching once per block),
    MAGE (full-KV fetch), InfiniGen (per-block fetch of its budget)
    and Dense (GPU forward), each at the measured points of its mode."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for v, recs in series.items():
        ok = [recs[b] for b in sorted(recs) if recs[b]["status"] == "ok"]
        if ok:
            ax.plot(
                [r["batch"] for r in ok],
                [r["decode_tokens_per_s"] for r in ok],
                "o-",
                label=VARIANTS[v].label,
            )
    # Each ceiling is drawn per point (PCIe and DRAM are probed per run, so a sweep measured in
    # several runs has several values), for the mode it can bind.
    for v, drawn in (
        ("herald", (("per_step_fetch", "b-."), ("per_block_fetch", "c--"),
                    ("cpu_selection_dram", "m:"), ("cpu_selection", "m^:"),
                    ("gpu_forward", "gs:"))),
        ("mage", (("full_kv_per_block_fetch", "r--"),)),
        ("infinigen", (("per_block_fetch", "y--"),)),
    ):  # fmt: skip
        ok = [r for _, r in sorted(series.get(v, {}).items()) if r["status"] == "ok"]
        cs = [(r["batch"], ceilings(r)) for r in ok]
        for key, style in drawn:
            pts = [(x, c[key]) for x, c in cs if key in c]
            if pts:
                name = VARIANTS[v].label if v != "herald" else "HERALD"
                ax.plot(*zip(*pts, strict=True), style, label=f"{CEILING_NAMES[key]} ({name})")
    den = [r for _, r in sorted(series.get("dense", {}).items()) if r["status"] == "ok"]
    if den:
        ax.plot(
            [r["batch"] for r in den],
            [ceilings(r)["gpu_forward"] for r in den],
            "ks:",
            label="GPU forward (Dense)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Fig. 12 analog: {title}, T = 20")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bars(bars: dict[int, list[tuple[str, float]]], path: Path) -> bool:
    plt = pyplot()
    if plt is None or not bars:
        return False
    fig, axes = plt.subplots(1, len(bars), figsize=(5 * len(bars), 4.5), squeeze=False)
    for ax, (ctx, items) in zip(axes[0], sorted(bars.items()), strict=True):
        ax.bar(range(len(items)), [v for _, v in items], color="tab:blue")
        for i, (_, v) in enumerate(items):
            ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(
            range(len(items)),
            [n.replace(" (", "\n(") for n, _ in items],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.set_title(f"{_ctx(ctx)}: peak / MAGE-Offload (GPU selection)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_fig14(data: dict[int, list[tuple[int, Any, Any, Any, Any]]], path: Path) -> bool:
    plt = pyplot()
    if plt is None or not data:
        return False
    fig, axes = plt.subplots(len(data), 2, figsize=(10, 3.6 * len(data)), squeeze=False)
    for row, (ctx, items) in zip(axes, sorted(data.items()), strict=True):
        t = [x[0] for x in items]
        for idx, name in ((1, "Dense"), (2, "HERALD")):
            pts = [(a, x[idx]) for a, x in zip(t, items, strict=True) if x[idx]]
            if pts:
                row[0].plot(*zip(*pts, strict=True), "o-", label=name)
        for idx, name in ((3, "main stream"), (4, "retrieval stream")):
            pts = [(a, x[idx]) for a, x in zip(t, items, strict=True) if x[idx] is not None]
            if pts:
                row[1].plot(*zip(*pts, strict=True), "o-", label=name)
        row[0].set(xlabel="T", ylabel="decode tokens/s", title=f"{_ctx(ctx)} throughput")
        row[1].set(xlabel="T", ylabel="s per block", title=f"{_ctx(ctx)} HERALD per-block latency")
        for ax in row:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
