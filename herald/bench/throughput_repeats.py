"""How much one throughput measurement varies, for the throughput report
(:mod:`herald.bench.throughput_report`): configurations measured twice in the current records
(80 GB cap and whole GPU, the cap not binding) and points of ``superseded/remeasured*.jsonl``
measured again, per mode and per host.
"""
# ruff: noqa: E501  (markdown rows are clearer on one line)

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from herald.bench import throughput_plan as plan
from herald.bench.throughput_data import Data, variant_label
from herald.bench.throughput_plan import CAP_H100
from herald.bench.throughput_plan import ctx_label as _ctx
from herald.bench.throughput_records import load_records_file


def repeat_pairs(d: Data) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    """Points measured twice with the same configuration, the 80 GB cap and the whole GPU,
    where the capped point's peak GPU memory stayed under the cap (so the cap did not change
    it): (capped, whole GPU, difference in %), by configuration."""
    by_key: dict[tuple[Any, ...], dict[Any, dict[str, Any]]] = defaultdict(dict)
    for p in d.points:
        if p["status"] == "ok":
            key = (p["model"], p["context"], p["variant"], p.get("budget"), p["steps"],
                   plan.record_contexts(p), p["batch"])  # fmt: skip
            by_key[key][p.get("gpu_cap_gb")] = p
    out = []
    # budget may be None, so the configuration sorts by its text, then by batch as a number
    # (uniform before mixed contexts)
    order = sorted(
        by_key.items(), key=lambda kv: (str(kv[0][:5]), kv[0][5] != plan.UNIFORM, kv[0][6])
    )
    for _, caps in order:
        a, b = caps.get(CAP_H100), caps.get(None)
        if a is None or b is None or a.get("peak_gpu_gib") is None:
            continue
        if a["peak_gpu_gib"] * 2**30 >= CAP_H100 * 1e9:  # the cap may have bound: not a repeat
            continue
        out.append((a, b, 100 * (b["decode_tokens_per_s"] / a["decode_tokens_per_s"] - 1)))
    return out


def noise_pct(pairs: list[tuple[dict[str, Any], dict[str, Any], float]]) -> float | None:
    """The median absolute difference (%) between two measurements of one configuration made in
    different runs (the methods of a table were measured in different runs), or over every
    pair when no pair spans two runs; None without pairs (``pairs``: :func:`repeat_pairs`)."""
    cross = [abs(x) for a, b, x in pairs if a["run_id"] != b["run_id"]]
    diffs = cross or [abs(x) for _, _, x in pairs]
    return statistics.median(diffs) if diffs else None


def repeats(d: Data) -> list[str]:
    """How much one measurement varies (:func:`repeat_pairs`). Each point times one or two
    blocks, and every peak in the tables above is one such measurement."""
    rows: list[str] = []
    diffs: list[float] = []
    cross: list[float] = []
    one: list[float] = []
    for a, b, diff in repeat_pairs(d):
        diffs.append(abs(diff))
        (cross if a["run_id"] != b["run_id"] else one).append(abs(diff))
        runs = a["run_id"] if a["run_id"] == b["run_id"] else f"{a['run_id']}, {b['run_id']}"
        rows.append(
            f"| {plan.model_name(a['model'])} | {_ctx(a['context'])} | {variant_label(a)} "
            f"| {a['steps']} | {a['batch']} | {a['decode_tokens_per_s']:.0f} "
            f"| {b['decode_tokens_per_s']:.0f} | {diff:+.1f}% | {runs} |"
        )
    if not rows:
        return []
    split = (
        f" {len(cross)} pairs come from two runs, hours apart: {statistics.median(cross):.1f}% "
        f"(median), up to {max(cross):.1f}%"
        + (
            f"; {len(one)} from one run, minutes apart: {statistics.median(one):.1f}% (median)."
            if one
            else "."
        )
        + " The modes of a table were measured in different runs, so compare them by more than "
        "the two-run figure (the Targets do)."
        if cross
        else " Each pair comes from one run, so this is a lower bound for two runs' noise."
    )
    return [
        "## Repeatability",
        "",
        f"{len(rows)} configurations were measured twice (once under the 80 GB cap, once on the "
        "whole GPU, with the capped point's peak memory under the cap, so the cap did not bind): "
        f"the two differ by {statistics.median(diffs):.1f}% (median) and up to {max(diffs):.1f}%. "
        "Every peak in this report is one such measurement." + split,
        "",
        "| model | ctx | mode | T | bs | 80 GB cap tok/s | whole GPU tok/s | difference | runs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def remeasured(d: Data, files: list[Path]) -> list[str]:
    """Points measured again: configurations of ``superseded/remeasured*.jsonl`` (points moved
    out only so that a later run measures them again, not because a fix changed them) that the
    current points measure too, same sweep (model, context, mode, budget, cap, T) and batch.
    Their difference is the noise between runs hours apart plus whatever the code changed in
    between, so it is given per mode (a mode whose code changed shifts as a whole). Old points
    that ran but whose configuration now failed (out of memory, DRAM) are listed too."""

    def key(p: dict[str, Any]) -> tuple[Any, ...]:
        return (*plan.record_sweep_key(p), p["batch"])

    def rate(p: dict[str, Any]) -> float:
        x = p.get("decode_tokens_per_s")
        return float(x) if isinstance(x, (int, float)) else 0.0

    cuda = any(p.get("device") == "cuda" for p in d.points)
    old: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in files:
        for p in load_records_file(path):
            if p.get("kind") != "point" or p.get("status") != "ok" or rate(p) <= 0:
                continue
            if cuda and p.get("device") != "cuda":  # as Data keeps only the GPU points
                continue
            old[key(p)] = p  # later records win, as in the tables
    now = {key(p): p for p in d.points}
    both = [(old[k], p) for k, p in now.items() if k in old and p["status"] == "ok" and rate(p) > 0]
    failed = [(old[k], p) for k, p in now.items() if k in old and p["status"] != "ok"]
    if not both and not failed:
        return []

    def host(p: dict[str, Any]) -> Any:
        return d.host.get(p.get("run_id", ""))

    # a pair from two hosts (cores, DRAM) measures the host too, not run-to-run noise
    pairs = [(a, b) for a, b in both if host(a) == host(b)]
    moved = [(a, b) for a, b in both if host(a) != host(b)]
    lines = ["### Measured again", ""]
    names = ", ".join(f"`superseded/{f.name}`" for f in files)
    if moved:
        by_hosts: dict[tuple[Any, Any, str], list[float]] = defaultdict(list)
        for a, b in moved:
            by_hosts[(host(a), host(b), _mode(b))].append(100 * (rate(b) / rate(a) - 1))

        def name(h: Any) -> str:
            return f"{h[0]} cores, {h[1]} GiB" if h else "host unknown"

        lines += [
            f"{len(moved)} configurations of {names} were measured again on another host "
            "(cores, DRAM: the CPU selection kernel's threads and bandwidth differ), so their "
            "difference is the host's as much as the run's; they are left out of the noise "
            "figures below:",
            "",
            "| before on | again on | mode | configurations | median signed difference | range |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {name(h0)} | {name(h1)} | {m} | {len(xs)} | {statistics.median(xs):+.1f}% "
                f"| {min(xs):+.1f}% to {max(xs):+.1f}% |"
                for (h0, h1, m), xs in sorted(by_hosts.items(), key=str)
            ),
            "",
        ]
    if pairs:
        diffs = [100 * (rate(b) / rate(a) - 1) for a, b in pairs]
        absd = [abs(x) for x in diffs]
        by_mode: dict[str, list[float]] = defaultdict(list)
        for (_, b), x in zip(pairs, diffs, strict=True):
            by_mode[_mode(b)].append(x)
        lines += [
            f"{len(pairs)} configurations of {names} were measured again by the runs above on "
            f"the same host (hours later, at a later code version): the two differ by {statistics.median(absd):.1f}% "
            f"(median of the absolute differences), {sum(x >= 10 for x in absd)} by 10% or more "
            f"and up to {max(absd):.1f}%. A mode whose code changed in between shifts as a whole "
            "(its signed median), the rest is run-to-run noise:",
            "",
            "| mode | configurations | median signed difference | median absolute | largest |",
            "| --- | --- | --- | --- | --- |",
            *(
                f"| {v} | {len(xs)} | {statistics.median(xs):+.1f}% "
                f"| {statistics.median(abs(x) for x in xs):.1f}% | {max(xs, key=abs):+.1f}% |"
                for v, xs in sorted(by_mode.items())
            ),
            "",
        ]
        rows = [
            f"{_config_cells(b)} {rate(a):.0f} | {rate(b):.0f} | {x:+.1f}% |"
            for (a, b), x in sorted(zip(pairs, diffs, strict=True), key=lambda t: -abs(t[1]))
            if abs(x) >= 20
        ]  # same host only
        if rows:
            lines += [
                "Configurations that differ by 20% or more:",
                "",
                "| model | ctx | mode | cap GB | T | bs | before tok/s | again tok/s | difference |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *rows,
                "",
            ]
    if failed:
        dram = any(b["status"] == "dram" for _, b in failed)

        def hosts(a: dict[str, Any], b: dict[str, Any]) -> str:
            h0, h1 = host(a), host(b)
            return "same" if h0 == h1 else f"{h0[1]} -> {h1[1]} GiB" if h0 and h1 else "?"

        lines += [
            f"{len(failed)} configuration(s) that ran before did not fit when measured again"
            + (
                " (DRAM: a run's CPU pool takes the DRAM free at its start less a reserve, so a "
                "host with less DRAM, or a run that found less of it free, holds fewer requests):"
                if dram
                else ":"
            ),
            "",
            "| model | ctx | mode | cap GB | T | bs | before tok/s | again | host DRAM |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *(
                f"{_config_cells(b)} {rate(a):.0f} | {b['status']} | {hosts(a, b)} |"
                for a, b in failed
            ),
            "",
        ]
    return lines


def _config_cells(p: dict[str, Any]) -> str:
    """A point's "| model | ctx | mode | cap GB | T | bs |" cells."""
    return (
        f"| {plan.model_name(p['model'])} | {_ctx(p['context'])} | {_mode(p)} "
        f"| {p['gpu_cap_gb'] or 'whole GPU'} | {p['steps']} | {p['batch']} |"
    )


def _mode(p: dict[str, Any]) -> str:
    """``variant budget%`` (``dense`` has no budget), `` (mixed)`` for mixed contexts."""
    v = variant_label(p)
    return f"{v} {100 * p['budget']:g}%" if p.get("budget") else v
