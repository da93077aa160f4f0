"""The records of ``herald bench serve`` (``OUT/serve_bench.jsonl``) and the README built from
them: one section per run, one table row per load level. ``python -m herald.bench.serve_report
DIR`` rebuilds ``DIR/README.md`` (after records from several machines were appended there).

Records of a run: ``kind: level`` (one per load level), ``kind: throughput_point`` (the
throughput benchmark's figure of a level, with ``--throughput-point``) and, once the run has
ended, one ``kind: summary`` whose ``rows`` set each level's served rate beside that figure
(:func:`comparison`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from herald.bench.plotting import pyplot, skipped
from herald.bench.throughput_plan import ctx_label

JSONL_NAME = "serve_bench.jsonl"

COLUMNS = (
    "mode", "prompt tokens", "concurrency", "requests done / failed / cancelled", "wall s",
    "generated tok/s", "engine prefill s", "engine decode s", "engine idle / publish s",
    "mean batch", "served tok/s",
    "prompt tok/s",
    "first chunk p50 / p90 / p99 s", "between chunks p50 / p90 / p99 s",
    "latency p50 / p90 / p99 s", "throughput bench tok/s", "served / bench",
)  # fmt: skip


def load_records(out: Path) -> list[dict[str, Any]]:
    """Every record of ``out/serve_bench.jsonl``, run heads included, in file order."""
    path = out / JSONL_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def group_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``{"head", "levels", "points", "summary"}`` per run (``run_id``) in order of
    appearance; a run's head is the last ``kind: run`` line before its first record, its summary
    its last ``kind: summary`` record (None before the run ended)."""
    runs: dict[str, dict[str, Any]] = {}
    head: dict[str, Any] | None = None
    for r in records:
        if r.get("kind") == "run":
            head = r
            continue
        if r.get("bench") != "serve" or "run_id" not in r:
            continue
        new: dict[str, Any] = {"head": head, "levels": [], "points": [], "summary": None}
        run = runs.setdefault(r["run_id"], new)
        if r.get("kind") == "summary":
            run["summary"] = r
        else:
            run["levels" if r.get("kind") == "level" else "points"].append(r)
    return list(runs.values())


def _point(lv: dict[str, Any], points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The throughput point of level ``lv`` (same prompt tokens and concurrency), if any."""
    return next((p for p in points if p["prompt_tokens"] == lv["prompt_tokens"]
                 and p["concurrency"] == lv["concurrency"]), None)  # fmt: skip


def _ratio(served: float | None, bench: float | None) -> float | None:
    return served / bench if served is not None and bench else None


def comparison(levels: list[dict[str, Any]], points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per level: the served rates beside the throughput benchmark's, to re-check the
    comparison from the records. ``context``: prompt tokens + max_tokens (the throughput
    point's ``--context`` is the prompt tokens);
    ``served_tokens_per_s``: the level's decode-only served rate (engine prefill seconds taken
    out of its wall time), ``generated_tokens_per_s`` the end-to-end one; ``bench_tokens_per_s``:
    the point's decode tok/s (None without an ok point); ``served_over_bench`` their ratio."""
    rows = []
    for lv in levels:
        point = _point(lv, points)
        bench = point.get("decode_tokens_per_s") if point and point["status"] == "ok" else None
        served = lv.get("served_tokens_per_s")
        rows.append({
            "device": lv.get("device"), "mode": lv["mode"], "kv_budget": lv.get("kv_budget"),
            "steps": lv.get("steps"), "prompt_tokens": lv["prompt_tokens"],
            "max_tokens": lv["max_tokens"], "context": lv["prompt_tokens"] + lv["max_tokens"],
            "concurrency": lv["concurrency"], "wall_s": lv["wall_s"],
            "engine_prefill_s": lv.get("engine_prefill_s"),
            "generated_tokens_per_s": lv["generated_tokens_per_s"],
            "served_tokens_per_s": served, "bench_tokens_per_s": bench,
            "served_over_bench": _ratio(served, bench),
        })  # fmt: skip
    return rows


def _s(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pcts(d: dict[str, float | None]) -> str:
    return " / ".join(_s(d.get(k)) for k in ("p50", "p90", "p99"))


def mean_batch(lv: dict[str, Any]) -> float | None:
    """The engine's mean batch size over a level's decode forwards (its ``server_deltas``;
    records before the forward counter: over its steps, which also count the steps that only
    prefilled), None without them."""
    d = lv.get("server_deltas") or {}
    steps = d.get("herald_decode_forwards_total", d.get("herald_engine_step_seconds_count"))
    rows = d.get("herald_batch_rows_total")
    return rows / steps if steps and rows is not None else None


def idle_publish(lv: dict[str, Any]) -> str:
    """The engine thread's idle seconds during a level (its idle counter's increase less the
    seconds after the level until the last scrape) and its publish seconds, '-' without them."""
    d = lv.get("server_deltas") or {}
    idle, tail = d.get("herald_engine_idle_seconds_total"), lv.get("after_level_s")
    publish = d.get("herald_engine_publish_seconds_total")
    if idle is None or tail is None or publish is None:
        return "-"
    return f"{max(0.0, idle - tail):.2f} / {publish:.2f}"


def _row(lv: dict[str, Any], points: list[dict[str, Any]]) -> str:
    point = _point(lv, points)
    bench = None
    if point is None:
        tp = "-"
    elif point["status"] == "ok":
        bench = point["decode_tokens_per_s"]
        tp = f"{bench:.1f}"
    else:
        tp = str(point["status"])
    served = lv.get("served_tokens_per_s")
    mode = (
        lv["mode"] if lv.get("kv_budget") in (None, 1.0) else f"{lv['mode']} ({lv['kv_budget']:g})"
    )
    cells = [
        mode, str(lv["prompt_tokens"]), str(lv["concurrency"]),
        f"{lv['completed']} / {lv['failed']} / {lv['cancelled']}", _s(lv["wall_s"], 2),
        _s(lv["generated_tokens_per_s"], 1), _s(lv.get("engine_prefill_s"), 2),
        _s(lv.get("engine_decode_s"), 2), idle_publish(lv), _s(mean_batch(lv), 1),
        _s(served, 1),
        _s(lv["prompt_tokens_per_s"], 1), _pcts(lv["time_to_first_chunk_s"]),
        _pcts(lv["time_between_chunks_s"]), _pcts(lv["latency_s"]), tp,
        _s(_ratio(served, bench), 2),
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table(levels: list[dict[str, Any]], points: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n| " + " | ".join("---" for _ in COLUMNS) + " |"
    return "\n".join([head, *(_row(lv, points) for lv in levels)])


def _why_no_point(lv: dict[str, Any]) -> str:
    """Why level ``lv`` has no throughput point."""
    if lv.get("url") is not None:
        return "--throughput-point needs the server this benchmark starts, not --url"
    if "steps" in lv and not lv["steps"]:
        return "--throughput-point needs --steps >= 1"
    if "throughput_command" in lv and lv["throughput_command"] is None:
        return "no throughput benchmark variant has the served engine's settings"
    if lv.get("throughput_point"):
        return "measured once every level has run"
    return "add --throughput-point"


def table_notes(levels: list[dict[str, Any]], points: list[dict[str, Any]]) -> list[str]:
    """Why :func:`table` shows '-' where it does for lack of a figure: one line per cause (the
    engine's counters, the throughput point), none when nothing is missing."""
    notes = []
    if any(lv.get("engine_prefill_s") is None for lv in levels):
        notes.append("engine prefill / decode / idle s, mean batch, served tok/s: '-' where the "
                     "server gave no engine counters on /metrics")  # fmt: skip
    whys = sorted({_why_no_point(lv) for lv in levels if _point(lv, points) is None})
    if whys:
        notes.append(f"throughput bench tok/s, served / bench: not measured ({'; '.join(whys)})")
    return notes


def _machine(head: dict[str, Any] | None) -> str:
    if head is None:
        return "not recorded"
    m = head.get("machine", {})
    cpu = f"{m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores"
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    code = head.get("code", {})
    version = code.get("git") or code.get("source_sha256", "?")
    return f"{cpu}{gpu}, torch {m.get('torch', '?')}, Python {m.get('python', '?')}; code {version}"


def first_vs_last(lv: dict[str, Any], tail: int = 10) -> str | None:
    """For a concurrency-1 level of more than ``tail`` completed requests: the first request's
    latency beside the median of the last ``tail`` (a warm server's first request should be as
    fast as its hundredth); None otherwise."""
    lat = lv.get("latency_by_request_s") or []
    if lv.get("concurrency") != 1 or len(lat) <= tail or any(x is None for x in lat):
        return None
    last = sorted(lat[-tail:])
    median = (last[(tail - 1) // 2] + last[tail // 2]) / 2
    return (
        f"{lv['mode']}, {lv['prompt_tokens']} prompt tokens, concurrency 1, {len(lat)} requests "
        f"in a row: first {lat[0]:.3f} s, median of the last {tail} {median:.3f} s "
        f"(first / last = {lat[0] / median:.2f})"
    )


def run_section(run: dict[str, Any]) -> str:
    """One run: what ran where, its table, and the throughput command beside it."""
    first, head = run["levels"][0], run["head"]
    s = first["server"]
    if first["url"] is not None:
        where = f"server at {first['url']}"
    elif (first.get("server") or {}).get("process") == "child":
        where = "herald serve in a child process"
    else:  # --server thread, and records from before the child process was the default
        where = "in-process server (clients in the server's process)"
    lines = [
        f"### {first['time_utc']}: {first['model']} on {first['device']} ({first['dtype']})",
        "",
        f"{where}; mode {first['mode']}, kv budget {first['kv_budget']}, max batch "
        f"{s.get('max_batch_size')}, max seq len {s.get('max_seq_len')}, prefill budget "
        f"{s.get('max_prefill_tokens')} tokens per decode forward; "
        f"max_tokens {first['max_tokens']}, "
        f"steps {first['steps']}, ignore_eos {first['ignore_eos']}, limit "
        f"{first['duration_limit_s']:g} s per level. Machine: {_machine(head)}.",
    ]
    if head is not None:
        lines += ["", f"Command: `{head.get('command', '?')}`"]
    lines += ["", table(run["levels"], run["points"])]
    lines += [x for note in table_notes(run["levels"], run["points"]) for x in ("", note)]
    cmd = first.get("throughput_command")
    if not run["points"] and cmd:
        lines += ["", f"Throughput figure beside it: `{cmd}`"]
    for lv in run["levels"]:
        line = first_vs_last(lv)
        if line:
            lines += ["", line]
    bad = sorted({e for lv in run["levels"] for e in lv.get("errors", [])})
    if bad:
        lines += ["", "Errors: " + "; ".join(f"`{e}`" for e in bad[:5])]
    return "\n".join(lines)


INTRO = """# herald bench serve

End-to-end load on a real `herald serve` over loopback, through the official `openai` client:
streaming completions of real text (the local Python standard library's sources, cut to exactly
the prompt length in the model's tokens), one load level per concurrency, each with a bounded
number of requests and a hard time limit after which the rest are cancelled. Generated tok/s:
every token received (cancelled requests' too) over the level's wall time, end to end; engine
prefill s: the seconds the server's engine spent prefilling prompts during the level (its
`/metrics` counters read before and after the level, '-' for a server without them); served
tok/s: the same generated tokens over the wall time less that prefill time (the decode-only
served rate); prompt tok/s: the prompts whose first chunk arrived, over the wall time. First
chunk: request sent to its first chunk with tokens (the first committed block, prefill
included); between chunks: from one chunk to the next (one per block); latency: request to its
last chunk, completed requests only. The clients run in the benchmark's process; the server it
starts is `herald serve` in a child process, or (each run says which) in a thread of the
benchmark's process, whose clients then share its interpreter lock. Throughput bench tok/s:
`herald bench throughput`'s point for the same model, mode, steps and kv_pad at context =
prompt tokens and batch = concurrency (all requests admitted at once, synthetic prefill, decode
only, no HTTP), measured in the benchmark's process once the server had stopped; '-' where it
was not asked for (`--throughput-point`). Served / bench: served tok/s over throughput bench tok/s.
Records: `serve_bench.jsonl` (a line naming the machine, code and command, one line per level,
one per throughput point, then a summary whose rows set each level's served tok/s beside its
throughput bench tok/s).
"""


PLOT_NAME = "served_vs_bench.png"


def _plot_rows(runs: list[dict[str, Any]]) -> list[tuple[str, list[float | None]]]:
    """Per level with engine counters: its label and (end-to-end, served, engine decode,
    throughput bench) tok/s."""
    rows = []
    for run in runs:
        for lv, cmp in zip(run["levels"], comparison(run["levels"], run["points"]), strict=True):
            if cmp["served_tokens_per_s"] is None:
                continue
            gen, dec = lv.get("engine_generated_tokens"), lv.get("engine_decode_s")
            label = (f"{lv['time_utc'][5:16].replace('T', ' ')}\n{lv['mode']} "
                     f"{ctx_label(lv['prompt_tokens'])} x{lv['concurrency']}")  # fmt: skip
            rows.append((label, [cmp["generated_tokens_per_s"], cmp["served_tokens_per_s"],
                                 gen / dec if gen and dec else None,
                                 cmp["bench_tokens_per_s"]]))  # fmt: skip
    return rows


def write_plot(out: Path, runs: list[dict[str, Any]]) -> Path | None:
    """``out/served_vs_bench.png``: each level's generated tok/s end to end, served tok/s
    (wall less prefill), the engine's decode rate (its generated tokens over its decode seconds)
    and the throughput benchmark's point; None without matplotlib or levels with counters."""
    rows = _plot_rows(runs)
    plt = pyplot()
    if plt is None or not rows:
        if plt is None:
            skipped("serve report")
        return None
    names = ("end to end", "served (wall - prefill)", "engine decode", "throughput bench")
    shown = [j for j in range(len(names)) if any(v[j] is not None for _, v in rows)]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(rows)), 4.5))
    width = 0.8 / len(shown)
    for n, j in enumerate(shown):  # a series no level has (no throughput point) is left out
        xs = [i + (n - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [v[j] or 0.0 for _, v in rows], width, label=names[j])
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=6)
    ax.set_ylabel("generated tokens/s")
    ax.set_title("herald bench serve: served rates against the throughput benchmark")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / PLOT_NAME
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_readme(out: Path) -> Path:
    """``out/README.md`` (and its plot, :func:`write_plot`) from every record of
    ``out/serve_bench.jsonl``."""
    runs = [r for r in group_runs(load_records(out)) if r["levels"]]
    body = "\n\n".join(run_section(r) for r in runs) or "No level recorded yet."
    if write_plot(out, runs) is not None:
        body = f"![served vs throughput bench tok/s per level]({PLOT_NAME})\n\n" + body
    path = out / "README.md"
    path.write_text(INTRO + "\n" + body + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m herald.bench.serve_report DIR``: rebuild DIR/README.md from its records."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / JSONL_NAME).is_file():
        print(f"usage: python -m herald.bench.serve_report DIR (a folder with {JSONL_NAME})",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"wrote {write_readme(Path(args[0]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
