"""The forward benchmark's tables and plots, from ``forward.jsonl``.

``python -m herald.bench.forward_report DIR`` (or ``herald bench forward --report DIR``) writes
``DIR/forward.md`` (forward time against the floor and the targets, the kernel breakdown, prefill
tokens/s) and, where matplotlib is installed, ``DIR/forward_vs_floor.png`` (GPU records only:
the floor is a GPU's) and ``DIR/forward_breakdown.png``. A point measured more than once is
shown from its latest record; the run that measured it (code version, machine) is named under
the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from herald.bench.forward_profile import CATEGORIES
from herald.bench.plotting import pyplot, skipped

JSONL_NAME = "forward.jsonl"
REPORT_NAME = "forward.md"


def ctx_label(ctx: int) -> str:
    """16384 -> "16K"; contexts that are not whole K stay in tokens."""
    return f"{ctx // 1024}K" if ctx >= 1024 and ctx % 1024 == 0 else str(ctx)


def load(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file, each measured record with ``_run`` (its run head's code
    version and GPU or CPU) attached; a partial last line is skipped."""
    out: list[dict[str, Any]] = []
    head: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "run":
            code, machine = rec.get("code", {}), rec.get("machine", {})
            head = {
                "code": code.get("git") or code.get("source_sha256"),
                "machine": machine.get("gpu") or machine.get("cpu_model"),
                "date": machine.get("date_utc"),
            }
            continue
        out.append({**rec, "_run": head})
    return out


def latest(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The latest record of each point of ``kind`` (``forward`` or ``prefill``), in first-seen
    order."""
    keys = ("model", "mode", "context", "batch", "budget", "prompt_tokens", "device")
    by: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == kind:
            by[tuple(r.get(k) for k in keys)] = r
    return list(by.values())


def num(x: float) -> str:
    """Two decimals from 1 up, three significant digits below (a tiny model's floor)."""
    return f"{x:.2f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"


FORWARD_HEADER = ["model", "mode", "context", "batch", "tokens", "forward ms", "step ms",
                  "floor ms", "forward/floor", "target"]  # fmt: skip


def forward_row(r: dict[str, Any]) -> list[str]:
    head = [r["model"], r["mode"], ctx_label(r["context"]), str(r["batch"])]
    if r.get("status") != "ok":
        return [*head, "", r.get("status", "?").upper(), "", "", "", r.get("error", "")[:60]]
    fl = r["floor"]
    step = r.get("step_ms")
    target = ""
    if r.get("target"):
        target = f"{r['target']['text']}: {'met' if r['target']['met'] else 'missed'}"
    return [
        *head,
        str(fl["tokens"]),
        num(r["forward_ms"]),
        "" if step is None else num(step),
        f"{num(fl['floor_ms'])} ({fl['bound']}, experts {fl['experts_basis']})",
        ratio(r["forward_over_floor"]),
        target,
    ]


FLOOR_COLUMNS = ("floor ms", "forward/floor")
CPU_NOTE = (
    "CPU timings: no floor comparison (the floor is a GPU's: bytes at --hbm-tbps, FLOPs at "
    "--peak-tflops)."
)


def on_cpu(records: list[dict[str, Any]]) -> bool:
    """Whether every record was measured on the CPU, where the GPU floor says nothing (records
    without a device are the GPU's: they predate the field)."""
    return bool(records) and all(r.get("device") == "cpu" for r in records)


def forward_table(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The forward table's header and rows, without the floor columns (:data:`FLOOR_COLUMNS`)
    when every record was measured on the CPU."""
    header, rows = FORWARD_HEADER, [forward_row(r) for r in records]
    if on_cpu(records):
        keep = [i for i, h in enumerate(header) if h not in FLOOR_COLUMNS]
        header, rows = [header[i] for i in keep], [[row[i] for i in keep] for row in rows]
    return header, rows


def progress_line(r: dict[str, Any]) -> str:
    """One measured forward record in a line, as the run goes (the table comes at the end): its
    times, and measured / floor on the GPU."""
    if r.get("status") != "ok":
        return f"  {r['mode']}: {r.get('status', '?').upper()} {r.get('error', '')[:100]}"
    step = r.get("step_ms")
    line = f"  {r['mode']}: forward {num(r['forward_ms'])} ms"
    line += "" if step is None else f", step {num(step)} ms"
    return line if r.get("device") == "cpu" else line + f", {ratio(r['forward_over_floor'])} floor"


BREAKDOWN_HEADER = ["model", "mode", "context", "batch", "kernels ms", *CATEGORIES,
                    "expert TB/s"]  # fmt: skip


def breakdown_row(r: dict[str, Any]) -> list[str]:
    prof = r["profile"]
    cats = [num(prof["categories_ms"][c]) for c in CATEGORIES]
    tbps = prof.get("expert_tbps")
    return [r["model"], r["mode"], ctx_label(r["context"]), str(r["batch"]),
            num(prof["kernel_ms"]), *cats, "" if tbps is None else f"{tbps:.2f}"]  # fmt: skip


PREFILL_HEADER = ["model", "mode", "prompt", "requests", "prefill tok/s", "target"]


def prefill_row(r: dict[str, Any]) -> list[str]:
    head = [r["model"], r["mode"], ctx_label(r["prompt_tokens"]), str(r["requests"])]
    if r.get("status") != "ok":
        return [*head, r.get("status", "?").upper(), r.get("error", "")[:60]]
    tps, want = r.get("prefill_tokens_per_s"), r.get("target_tokens_per_s")
    target = "" if want is None else f">= {want:,.0f}: {'met' if (tps or 0) >= want else 'missed'}"
    return [*head, "" if tps is None else f"{tps:,.0f}", target]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns aligned with spaces (the terminal's table)."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    )


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def top_kernels(r: dict[str, Any], n: int = 5) -> list[str]:
    """The ``n`` slowest kernels of a profiled record, one line each."""
    return [
        f"{k['ms']:.3f} ms  x{k['calls']:g}  [{k['category']}]  {k['name'][:100]}"
        for k in r["profile"]["top"][:n]
    ]


def _plots(out: Path, fwd: list[dict[str, Any]]) -> list[str]:
    plt = pyplot()
    ok = [r for r in fwd if r.get("status") == "ok"]
    if plt is None:
        skipped("forward report")
        return []
    if not ok or on_cpu(ok):  # the floor is a GPU's: no plot of CPU timings against it
        return []
    labels = [f"{r['model']}\n{r['mode']} {ctx_label(r['context'])} bs{r['batch']}" for r in ok]
    xs = range(len(ok))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(ok)), 4))
    ax.bar([x - 0.2 for x in xs], [r["forward_ms"] for r in ok], 0.4, label="forward")
    ax.bar([x + 0.2 for x in xs], [r["floor"]["floor_ms"] for r in ok], 0.4, label="floor")
    for x, r in zip(xs, ok, strict=True):
        if r.get("target"):
            ax.plot([x - 0.4, x + 0.4], [r["target"]["limit_ms"]] * 2, "k--", lw=1)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("ms per forward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "forward_vs_floor.png", dpi=120)
    plt.close(fig)
    names = ["forward_vs_floor.png"]
    prof = [r for r in ok if r.get("profile")]
    if prof:
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(prof)), 4))
        bottom = [0.0] * len(prof)
        for cat in CATEGORIES:
            vals = [r["profile"]["categories_ms"][cat] for r in prof]
            ax.bar(range(len(prof)), vals, 0.6, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(prof)), [labels[ok.index(r)] for r in prof], fontsize=7)
        ax.set_ylabel("kernel ms per forward")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "forward_breakdown.png", dpi=120)
        plt.close(fig)
        names.append("forward_breakdown.png")
    return names


def write_report(out: Path) -> Path:
    """``out/forward.md`` (and plots) from ``out/forward.jsonl``; returns the markdown's path."""
    path = out / JSONL_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {JSONL_NAME} in {out}")
    records = load(path)
    fwd, pre = latest(records, "forward"), latest(records, "prefill")
    parts = ["# Forward benchmark (`herald bench forward`)", "",
             f"Generated from `{JSONL_NAME}` by `python -m herald.bench.forward_report`. Floors: "
             "bytes / HBM bandwidth or FLOPs / peak, whichever is larger (herald/bench/"
             "forward_floor.py); the forward is the engine's decode forward without the logits, "
             "a step adds the logits, sampling and host syncs.", ""]  # fmt: skip
    if fwd:
        parts += ["## Forward time", "", md_table(*forward_table(fwd))]
        parts += ["", CPU_NOTE] if on_cpu(fwd) else []
        prof = [r for r in fwd if r.get("profile")]
        if prof:
            rows = [breakdown_row(r) for r in prof]
            parts += [
                "",
                "## Kernel breakdown (ms per forward)",
                "",
                md_table(BREAKDOWN_HEADER, rows),
            ]
    if pre:
        parts += ["", "## Prefill", "", md_table(PREFILL_HEADER, [prefill_row(r) for r in pre])]
    runs = sorted({f"{r['_run'].get('code')} on {r['_run'].get('machine')}"
                   for r in fwd + pre if r.get("_run")})  # fmt: skip
    if runs:
        parts += ["", "Measured by: " + "; ".join(runs) + "."]
    plots = _plots(out, fwd)
    parts += [""] + [f"![{p}]({p})" for p in plots]
    md = out / REPORT_NAME
    md.write_text("\n".join(parts).rstrip() + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m herald.bench.forward_report", description=__doc__)
    p.add_argument("out", type=Path, help="folder holding forward.jsonl")
    print(f"wrote {write_report(p.parse_args(argv).out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
