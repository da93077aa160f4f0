"""Plots of the evaluation report (:mod:`herald.eval.report`), matplotlib Agg. Where matplotlib
(the ``plot`` extra) is not installed nothing is drawn: one line on stderr and a README note say
how to install it and redraw (``herald eval --report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from herald.bench import plotting
from herald.eval.metrics import HEADLINE
from herald.eval.recall import FIG7_BARS, FIG9_VARIANTS, VARIANTS
from herald.eval.runner import OFFLOAD_MODES

COLORS = {"mage": "tab:blue", "infinigen": "tab:orange", "herald": "tab:green"}


def _budget_ticks(ax: Any, values: list[float]) -> None:
    """Label a log-x axis at the budgets themselves (1, 2.5, 5, ...), not at powers of ten."""
    if values:
        ax.set_xticks(values)
        ax.set_xticklabels([f"{v:g}" for v in values], fontsize=7)
        ax.minorticks_off()


def write_plots(out: Path, table: dict[str, Any], analysis: dict[str, Any] | None) -> list[str]:
    """``accuracy_<context>.png`` per context, ``fig7.png`` and ``fig9.png`` (with analysis).
    Returns notes for the README (the files drawn, or why none)."""
    plt = plotting.pyplot()
    if plt is None:
        plotting.skipped("eval report")
        return [
            f"matplotlib is not installed here: no plots ({plotting.INSTALL_HINT}, then run "
            "`herald eval --report --out DIR`)."
        ]
    drawn = []
    for ctx in table["contexts"]:
        drawn.append(_plot_accuracy(plt, out, table, ctx))
    if analysis is not None and analysis["summary"]["num_pairs"]:
        _plot_fig7(plt, out, analysis["summary"])
        _plot_fig9(plt, out, analysis)
        drawn += ["fig7.png", "fig9.png"]
    return ["Plots: " + ", ".join(f"`{n}`" for n in drawn) + "."] if drawn else []


def _plot_accuracy(plt: Any, out: Path, table: dict[str, Any], ctx: int) -> str:
    """``accuracy_<ctx>.png``: each task's headline score vs budget per mode, dense and the
    control as lines; returns the file name."""
    rows = table["rows"][str(ctx)]
    fig, axes = plt.subplots(1, len(table["tasks"]), figsize=(5 * len(table["tasks"]), 3.6))
    axes = axes if len(table["tasks"]) > 1 else [axes]
    for ax, task in zip(axes, table["tasks"], strict=True):
        for mode in OFFLOAD_MODES:
            pts = sorted(
                (r["budget"], r["tasks"][task]["score"])
                for r in rows.values()
                if r["mode"] == mode and task in r["tasks"]
            )
            if pts:
                ax.plot(
                    [100 * b for b, _ in pts],
                    [s for _, s in pts],
                    "o-",
                    label=mode,
                    color=COLORS[mode],
                )
        for label, style in (("dense", "k--"), ("control", "k:")):
            if label in rows and task in rows[label]["tasks"]:
                ax.axhline(
                    rows[label]["tasks"][task]["score"],
                    linestyle=style[1:],
                    color="k",
                    label=label,
                )
        ax.set_xscale("log")
        _budget_ticks(ax, sorted({100 * r["budget"] for r in rows.values() if r["budget"]}))
        ax.set_xlabel("KV budget (%)")
        ax.set_ylabel(f"{task} {HEADLINE[task].upper()} (x100)")
        ax.set_title(f"{task}, {ctx}-token context")
        ax.legend(fontsize=7)
    fig.tight_layout()
    name = f"accuracy_{ctx}.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def _plot_fig7(plt: Any, out: Path, s: dict[str, Any]) -> None:
    """``fig7.png``: the recall of block n omitted / drafted / completed per bucket of the
    omitted recall, and over every (pair, layer)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    # the buckets, then every (pair, layer) unbucketed (not conditioned on the omitted bar)
    groups = [b for b in s["fig7"] if b["count"]] + [s["fig7_all"]]
    width = 0.27
    for k, (v, label) in enumerate(FIG7_BARS):
        ax.bar(
            [i + (k - 1) * width for i in range(len(groups))],
            [g[v] for g in groups],
            width,
            label=label,
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(
        [
            (f"[{g['bucket'][0]:.1f},{g['bucket'][1]:.1f})" if "bucket" in g else "all")
            + f"\nn={g['count']}"
            for g in groups
        ],
        fontsize=7,
    )
    ax.set_xlabel("recall with block n omitted")
    ax.set_ylabel("top-k recall vs per-step oracle")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    ax.set_title("Fig. 7 analog")
    fig.tight_layout()
    fig.savefig(out / "fig7.png", dpi=120)
    plt.close(fig)


def _plot_fig9(plt: Any, out: Path, analysis: dict[str, Any]) -> None:
    """``fig9.png``: each variant's recall vs selection budget, MAGE at the oracle budget as
    the reference line."""
    s = analysis["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ob = f"{analysis['config']['oracle_budget']:g}"
    for v in FIG9_VARIANTS:
        if v in s["mean"]:
            pts = sorted((float(x), y) for x, y in s["mean"][v].items())
            ax.plot(
                [100 * x for x, _ in pts],
                [y for _, y in pts],
                "o-",
                label=VARIANTS[v],
                markersize=3,
            )
    base = s["mean"].get("block_completed", {}).get(ob)
    if base is not None:
        ax.axhline(base, color="k", linestyle="--", label=f"MAGE at {100 * float(ob):g}%")
    ax.set_xscale("log")
    _budget_ticks(ax, [100 * float(x) for x in s["mean"].get("rep_draft", {})])
    ax.set_xlabel("selection budget (%)")
    ax.set_ylabel("recall vs per-step oracle")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=6)
    ax.set_title(f"Fig. 9 analog (oracle k at {100 * float(ob):g}%)")
    fig.tight_layout()
    fig.savefig(out / "fig9.png", dpi=120)
    plt.close(fig)
