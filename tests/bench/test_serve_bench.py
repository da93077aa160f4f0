"""herald bench serve end to end on the CPU: a real server of the embedded model over loopback,
loaded through the openai client with prompts of the standard library; its records, README and
refusals. Small sizes (two levels of three requests, 96-token prompts, two blocks of two steps):
no assertion on how fast anything ran."""

from __future__ import annotations

import json
import re
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import user_error

from herald.bench import serve
from herald.bench.plotting import pyplot
from herald.bench.serve_client import engine_deltas, parse_metrics
from herald.bench.serve_prompts import StdlibPrompts
from herald.bench.serve_report import (
    PLOT_NAME,
    _plot_rows,
    comparison,
    group_runs,
    load_records,
    table_notes,
    write_readme,
)
from herald.bench.serve_report import main as report_main
from herald.cli import main as cli_main
from herald.models.loader import bundled_checkpoint, load_config
from herald.models.tokenizer import load_tokenizer

pytest.importorskip("openai")

SMALL = ["--max-tokens", "64", "--steps", "2", "--warmup-requests", "0", "--device", "cpu"]
STATS = ("time_to_first_chunk_s", "time_between_chunks_s", "latency_s")


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "serve_bench.jsonl").read_text().splitlines()]


def _ordered(stats: dict[str, float | None]) -> bool:
    p50, p90, p99 = stats["p50"], stats["p90"], stats["p99"]
    return p50 is not None and p90 is not None and p99 is not None and p50 <= p90 <= p99


def test_two_levels_of_stdlib_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "code-sdar", "--prompt-tokens", "96", "--concurrency", "1", "3"]
    assert serve.main([*argv, "--requests", "3", *SMALL, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "level start" in out and "level done" in out and "| dense | 96 | 3 |" in out
    head, *levels, summary = _records(tmp_path)
    assert head["kind"] == "run" and head["command"]
    assert head["machine"]["cpu_count"] and head["code"]["source_sha256"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["kind"] == "level" and lv["mode"] == "dense" and lv["url"] is None
        assert (lv["completed"], lv["failed"], lv["cancelled"]) == (3, 0, 0)
        assert lv["prompt_tokens_reported"] == [96]  # the server counted exactly 96
        assert lv["completion_tokens_per_request"] == [64] and lv["generated_tokens"] == 192
        assert lv["chunks_per_request"] == [2]  # one per 32-token block
        assert lv["generated_tokens_per_s"] > 0 and lv["prompt_tokens_per_s"] > 0
        assert all(_ordered(lv[k]) for k in STATS), {k: lv[k] for k in STATS}
        assert lv["server_idle_after"] is True
        assert lv["throughput_command"].startswith("herald bench throughput --device cpu")
        # the server's counters over the level: 3 prompts of 3 whole blocks each prefilled
        assert lv["engine_prompt_tokens"] == 288 and lv["engine_generated_tokens"] == 192
        assert lv["engine_prefill_s"] > 0 and lv["engine_decode_s"] > 0
        assert lv["served_tokens_per_s"] > lv["generated_tokens_per_s"]
        assert lv["context"] == 96 + 64
        assert lv["server"]["process"] == "child"  # herald serve in a process of its own
    log_text = (tmp_path / "server.log").read_text()
    assert log_text.startswith("$ ") and " -m herald serve --model code-sdar " in log_text
    assert "herald serve ready on http://127.0.0.1:" in log_text
    assert summary["kind"] == "summary" and summary["run_id"] == levels[0]["run_id"]
    assert [r["concurrency"] for r in summary["rows"]] == [1, 3]
    for row, lv in zip(summary["rows"], levels, strict=True):
        assert (row["device"], row["mode"], row["context"]) == ("cpu", "dense", 160)
        assert row["served_tokens_per_s"] == lv["served_tokens_per_s"]
        assert row["bench_tokens_per_s"] is None and row["served_over_bench"] is None
    _check_prompts(levels[0]["prompts"], 96)
    readme = (tmp_path / "README.md").read_text()
    assert "| dense | 96 | 1 | 3 / 0 / 0 |" in readme and "| dense | 96 | 3 | 3 / 0 / 0 |" in readme
    rows = [r for r in readme.splitlines() if r.startswith("| dense | 96 |")]
    assert all(r.endswith("| - | - |") for r in rows)  # no throughput point: no ratio
    for row, lv in zip(rows, levels, strict=True):
        assert f"| {lv['served_tokens_per_s']:.1f} |" in row
    assert "Throughput figure beside it: `herald bench" in readme
    # the '-' of the throughput columns says why, once, on the screen and in the README
    note = "throughput bench tok/s, served / bench: not measured (add --throughput-point)"
    assert out.count(note) == 1 and readme.count(note) == 1
    assert "no engine counters" not in out + readme  # every level has them


def _check_prompts(prompts: dict[str, Any], n: int) -> None:
    """The recorded prompts are the standard library's files, and rebuilding them gives exactly
    ``n`` tokens of those files' text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    assert Path(prompts["root"]) == root and prompts["source"] == "python standard library"
    config = load_config("code-sdar")
    tok = load_tokenizer(bundled_checkpoint("code-sdar"), config)
    source = StdlibPrompts(tok, seed=prompts["seed"])
    for i, files in enumerate(prompts["files"]):
        assert files and all((root / f).is_file() for f in files)
        assert not any("site-packages" in f for f in files)
        p = source.prompt(n, i)
        assert len(p.token_ids) == n and p.files == files
        text = "".join((root / f).read_text(encoding="utf-8") for f in files)
        assert text.startswith(tok.decode(p.token_ids).rstrip("\ufffd"))


@pytest.mark.parametrize(
    ("mode", "variant", "server", "batch"),
    [("dense", "dense", "process", 2), ("herald", "herald-selected", "thread", 1)],
)
def test_the_throughput_point_beside_each_level(
    mode: str, variant: str, server: str, batch: int, tmp_path: Path
) -> None:
    """The point is measured on the served model: rebuilt here after a child server, the
    thread server's own otherwise; at the batch the server decodes at, the concurrency or
    --max-batch-size where that is smaller."""
    argv = ["--model", "tiny-sdar", "--mode", mode, "--prompt-tokens", "64", "--concurrency", "2"]
    argv += ["--requests", "2", *SMALL, "--throughput-point", "--server", server]
    argv += ["--max-batch-size", str(batch)]
    assert serve.main([*argv, "--out", str(tmp_path)]) == 0
    _, level, point, summary = _records(tmp_path)
    assert level["kind"] == "level" and level["completed"] == 2 and level["mode"] == mode
    assert level["server"]["process"] == {"process": "child", "thread": "thread"}[server]
    assert (tmp_path / "server.log").exists() == (server == "process")
    assert point["kind"] == "throughput_point" and point["run_id"] == level["run_id"]
    assert (point["prompt_tokens"], point["concurrency"], point["steps"]) == (64, 2, 2)
    assert point["batch"] == batch
    assert point["variant"] == variant and point["status"] == "ok", point.get("error")
    assert point["decode_tokens_per_s"] > 0
    assert f"--context 64 --mode {variant} " in point["command"]
    assert f"--batches {batch} --steps 2" in point["command"]
    bench = point["decode_tokens_per_s"]
    (cmp,) = summary["rows"]
    assert cmp["bench_tokens_per_s"] == bench and cmp["concurrency"] == 2
    assert cmp["served_over_bench"] == pytest.approx(level["served_tokens_per_s"] / bench)
    readme = (tmp_path / "README.md").read_text()
    row = next(r for r in readme.splitlines() if f"| {mode}" in r)
    assert row.endswith(f"| {bench:.1f} | {cmp['served_over_bench']:.2f} |")
    assert "served / bench: not measured" not in readme and "no engine counters" not in readme
    (tmp_path / "README.md").unlink()
    assert report_main([str(tmp_path)]) == 0 and row in (tmp_path / "README.md").read_text()


@pytest.fixture
def running_server() -> Iterator[str]:
    """A server of tiny-sdar started apart from the benchmark, as ``herald serve`` starts it."""
    from herald.server.defaults import SERVE_DEFAULTS
    from herald.server.launch import bound_url, build_app, make_server, reserve_port

    sock = reserve_port("127.0.0.1", 0)
    app = build_app("tiny-sdar", SERVE_DEFAULTS.replace(max_batch_size=2, max_seq_len=512))
    server = make_server(app, sock, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield bound_url(sock)
    server.should_exit = True
    thread.join(timeout=60)
    sock.close()


def test_a_running_server_and_the_limit_cancels(running_server: str, tmp_path: Path) -> None:
    argv = ["--url", running_server, "--model", "tiny-sdar", "--prompt-tokens", "64"]
    argv += ["--concurrency", "2", "--requests", "4", "--max-tokens", "64", "--steps", "2"]
    argv += ["--warmup-requests", "0", "--duration-limit-s", "0.001", "--out", str(tmp_path)]
    assert serve.main(argv) == 0
    _, level, summary = _records(tmp_path)
    assert level["url"] == running_server and level["served_model"] == "tiny-sdar"
    assert summary["kind"] == "summary" and summary["rows"][0]["device"] is None
    assert level["completed"] + level["failed"] + level["cancelled"] == 4
    assert level["cancelled"] >= 1 and level["failed"] == 0
    assert level["server_idle_after"] is True  # the cancelled requests left the server


_BEFORE = """# HELP herald_prefill_seconds_total Engine seconds spent prefilling prompts
# TYPE herald_prefill_seconds_total counter
herald_prefill_seconds_total 1.5
herald_prefill_seconds_created 1.7e+09
herald_decode_seconds_total 10.0
herald_prompt_tokens_total 512.0
herald_generated_tokens_total 1000.0
herald_requests_total{outcome="ok"} 4.0
herald_requests_running 0.0
"""
_AFTER = """herald_prefill_seconds_total 2.0
herald_decode_seconds_total 18.0
herald_prompt_tokens_total 1024.0
herald_generated_tokens_total 1640.0
herald_requests_total{outcome="ok"} 8.0
herald_requests_running 0.0
"""


def test_engine_figures_are_the_counters_increases_over_a_level() -> None:
    before, after = parse_metrics(_BEFORE), parse_metrics(_AFTER)
    assert before['herald_requests_total{outcome="ok"}'] == 4.0
    assert before["herald_prefill_seconds_total"] == 1.5 and "# HELP" not in str(before)
    got = engine_deltas(before, after, generated_tokens=640, wall_s=10.5)
    # every herald_* counter's increase, for what the level's time went to
    assert got.pop("server_deltas") == {
        "herald_decode_seconds_total": 8.0, "herald_generated_tokens_total": 640.0,
        "herald_prefill_seconds_total": 0.5, "herald_prompt_tokens_total": 512.0,
    }  # fmt: skip
    assert got == {
        "engine_prefill_s": 0.5, "engine_decode_s": 8.0, "engine_prompt_tokens": 512,
        "engine_generated_tokens": 640, "served_tokens_per_s": 640 / 10.0,
    }  # fmt: skip
    nothing = dict.fromkeys(got)
    failed = engine_deltas(None, after, 640, 10.5)  # a scrape failed
    assert failed.pop("server_deltas") is None and failed == nothing
    old = parse_metrics("herald_requests_running 0.0\n")  # a server without these counters
    bare = engine_deltas(old, old, 640, 10.5)
    assert bare.pop("server_deltas") == {} and bare == nothing
    restarted = engine_deltas(after, before, 640, 10.5)  # counters went down: no increase
    assert restarted["engine_decode_s"] is None and restarted["served_tokens_per_s"] is None
    assert engine_deltas(before, after, 640, 0.5)["served_tokens_per_s"] is None  # no time left


def _level(c: int, **extra: Any) -> dict[str, Any]:
    pcts = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {
        "bench": "serve", "run_id": "r1", "kind": "level", "time_utc": "2025-01-01T00:00:00",
        "model": "m", "served_model": "m", "mode": "herald", "kv_budget": 1.0, "device": "cuda",
        "dtype": "bfloat16", "url": None, "server": {}, "max_tokens": 64, "steps": 4,
        "ignore_eos": True, "duration_limit_s": 120.0, "prompt_tokens": 256, "concurrency": c,
        "requests": 2 * c, "completed": 2 * c, "failed": 0, "cancelled": 0, "wall_s": 10.5,
        "generated_tokens_per_s": 60.0, "prompt_tokens_per_s": 100.0,
        "time_to_first_chunk_s": pcts, "time_between_chunks_s": pcts, "latency_s": pcts,
        **extra,
    }  # fmt: skip


def test_the_report_sets_the_served_rate_beside_the_throughput_point(tmp_path: Path) -> None:
    """From records alone: a level with the engine figures and an ok point gets its served
    tok/s, prefill seconds and served / bench; one without them (an older record, a server
    without the counters) gets '-'."""
    deltas = {
        "herald_engine_step_seconds_count": 10.0, "herald_batch_rows_total": 35.0,
        "herald_engine_idle_seconds_total": 2.5, "herald_engine_publish_seconds_total": 0.25,
    }  # fmt: skip
    new = _level(
        4, engine_prefill_s=0.5, engine_decode_s=8.0, served_tokens_per_s=64.0,
        server_deltas=deltas, after_level_s=2.0,
    )  # fmt: skip
    point = {"bench": "serve", "run_id": "r1", "kind": "throughput_point", "prompt_tokens": 256,
             "concurrency": 4, "status": "ok", "decode_tokens_per_s": 80.0}  # fmt: skip
    records = [new, _level(1), point]
    summary: dict[str, Any] = {"bench": "serve", "run_id": "r1", "kind": "summary"}
    summary["rows"] = comparison(records[:2], [point])
    (tmp_path / "serve_bench.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [*records, summary])
    )
    (run,) = group_runs(load_records(tmp_path))
    assert len(run["levels"]) == 2 and run["points"] == [point]
    assert run["summary"]["rows"][0] == {
        "device": "cuda", "mode": "herald", "kv_budget": 1.0, "steps": 4, "prompt_tokens": 256,
        "max_tokens": 64, "context": 320, "concurrency": 4, "wall_s": 10.5,
        "engine_prefill_s": 0.5, "generated_tokens_per_s": 60.0, "served_tokens_per_s": 64.0,
        "bench_tokens_per_s": 80.0, "served_over_bench": 0.8,
    }  # fmt: skip
    lines = write_readme(tmp_path).read_text().splitlines()
    head = next(ln for ln in lines if ln.startswith("| mode |"))
    assert (
        "| generated tok/s | engine prefill s | engine decode s | engine idle / publish s "
        "| mean batch | served tok/s |"
    ) in head
    assert head.endswith("| throughput bench tok/s | served / bench |")
    row4 = next(ln for ln in lines if ln.startswith("| herald | 256 | 4 |"))
    assert "| 60.0 | 0.50 | 8.00 | 0.50 / 0.25 | 3.5 | 64.0 |" in row4 and row4.endswith(
        "| 80.0 | 0.80 |"
    )
    row1 = next(ln for ln in lines if ln.startswith("| herald | 256 | 1 |"))
    assert "| 60.0 | - | - | - | - | - |" in row1 and row1.endswith("| - | - |")
    # the plot's bars: only the level with engine counters, its four rates in order
    (plotted,) = _plot_rows([run])
    assert plotted == ("01-01 00:00\nherald 256 x4", [60.0, 64.0, None, 80.0])
    # the level without counters or point: its '-' explained under the table
    text = "\n".join(lines)
    assert "\n\nengine prefill / decode / idle s, mean batch, served tok/s: '-' where" in text
    assert "served / bench: not measured (add --throughput-point)" in text
    has_plot = (tmp_path / PLOT_NAME).exists()
    assert has_plot == (pyplot() is not None) == (f"]({PLOT_NAME})" in "\n".join(lines))


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({}, "add --throughput-point"),
        ({"throughput_point": True}, "measured once every level has run"),
        ({"url": "http://h:1"}, "--throughput-point needs the server this benchmark starts"),
        ({"steps": None}, "--throughput-point needs --steps >= 1"),
        ({"throughput_command": None}, "no throughput benchmark variant has the served engine"),
    ],
)
def test_the_notes_say_why_the_throughput_columns_are_empty(extra: dict, why: str) -> None:
    counters = {"engine_prefill_s": 0.5}
    (note,) = table_notes([_level(2, **counters, **extra)], [])
    assert note.startswith("throughput bench tok/s, served / bench: not measured (" + why), note
    point = {"prompt_tokens": 256, "concurrency": 2, "status": "ok", "decode_tokens_per_s": 1.0}
    assert table_notes([_level(2, **counters)], [point]) == []
    (gauges,) = table_notes([_level(2)], [point])
    assert "'-' where the server gave no engine counters on /metrics" in gauges


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompt-tokens", "200", "--max-seq-len", "256"], "more than --max-seq-len (256"),
        (["--prompt-tokens", "32768"], "the context of code-sdar"),
        (["--concurrency", "1", "0"], "--concurrency must be >= 1"),
        (["--model", "no-such-model"], "--model 'no-such-model' is neither"),
        (
            ["--url", "http://127.0.0.1:9", "--device", "cpu"],
            "--device does not apply with --url: it sets up the server this benchmark starts, "
            "and --url loads one already running, which keeps its own settings (leave it out, or "
            "leave out --url)",
        ),
        (
            ["--url", "http://127.0.0.1:9", "--mode", "herald", "--throughput-point"],
            "--mode, --throughput-point do not apply with --url: they set up",
        ),
        (["--mode", "herald", "--kv-budget", "5"], "--mode herald: --kv-budget must be in (0, 1]"),
        (["--steps", "-1"], "--steps must be >= 0, got -1"),
        (["--warmup-requests", "-2"], "--warmup-requests must be >= 0, got -2"),
        (["--throughput-point", "--steps", "0"], "--throughput-point needs --steps"),
        (
            ["--gpu-memory-utilization", "1.5"],
            "--gpu-memory-utilization must be in (0, 1], got 1.5",
        ),
        (
            ["--device", "cpu", "--gpu-memory-utilization", "0.5"],
            "--gpu-memory-utilization limits GPU memory only, and the device here is cpu",
        ),
        (
            ["--url", "http://127.0.0.1:9", "--gpu-memory-utilization", "0.5"],
            "--gpu-memory-utilization does not apply with --url",
        ),
    ],
)
def test_bad_inputs_are_refused_before_anything_starts(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    def no_server(*_: object) -> None:
        raise AssertionError("a server was started")

    monkeypatch.setattr(serve, "InProcessServer", no_server)
    out = tmp_path / "out"
    assert serve.main([*argv, "--max-tokens", "64", "--out", str(out)]) == 2
    assert says in user_error(capsys.readouterr().err)
    assert not out.exists()


def test_herald_bench_serve_is_a_subcommand(tmp_path: Path, capsys) -> None:
    assert cli_main(["bench", "serve", "--concurrency", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err


def test_a_long_concurrency_one_level_sets_its_first_request_beside_its_last() -> None:
    from herald.bench.serve_report import first_vs_last

    lat = [1.2] + [1.0] * 8 + [1.1] * 5 + [0.9] * 5
    line = first_vs_last(_level(1, latency_by_request_s=lat))
    assert line is not None and "19 requests in a row: first 1.200 s" in line
    assert "median of the last 10 1.000 s (first / last = 1.20)" in line
    assert first_vs_last(_level(4, latency_by_request_s=lat)) is None  # not one at a time
    assert first_vs_last(_level(1, latency_by_request_s=lat[:10])) is None  # too few
    assert first_vs_last(_level(1, latency_by_request_s=[*lat, None])) is None  # one failed


def test_a_child_server_that_exits_before_ready_is_an_error_with_its_output(
    tmp_path: Path,
) -> None:
    from herald.bench import serve_run

    plan = serve.check_args(serve.build_parser().parse_args(
        ["--model", "tiny-sdar", "--prompt-tokens", "64", "--concurrency", "1", *SMALL,
         "--out", str(tmp_path)]
    ))  # fmt: skip
    child = serve_run.ChildServer(plan, tmp_path / "server.log")
    assert child.cmd[1:4] == ["-m", "herald", "serve"] and "--port" in child.cmd
    child.cmd = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="did not start(.|\\n)*no such model"):
        child.start()
    assert child.proc is not None and child.proc.returncode == 3
    assert "no such model" in (tmp_path / "server.log").read_text()


def test_the_child_server_command_is_herald_serve_with_the_engine_settings(tmp_path: Path) -> None:
    """Every engine setting of the plan reaches herald serve's own parser unchanged."""
    from herald.bench import serve_run
    from herald.cli import build_parser as cli_parser

    argv = ["--model", "tiny-sdar", "--mode", "herald", "--kv-budget", "0.1",
            "--cpu-kv-tokens", "4096", "--prompt-tokens", "64", "--concurrency", "1", "3",
            "--max-prefill-tokens", "512", *SMALL, "--out", str(tmp_path)]  # fmt: skip
    plan = serve.check_args(serve.build_parser().parse_args(argv))
    cmd = serve_run.serve_command(plan)
    assert cmd[:4] == [sys.executable, "-m", "herald", "serve"]
    got = cli_parser().parse_args(cmd[3:])
    e = plan.engine
    assert e is not None
    assert (got.model, got.mode, got.kv_budget, got.cpu_kv_tokens) == (
        "tiny-sdar",
        "herald",
        0.1,
        4096,
    )
    assert (got.max_batch_size, got.max_seq_len, got.max_prefill_tokens, got.port) == (
        e.max_batch_size, e.max_seq_len, 512, 0)  # fmt: skip
    assert (got.max_waiting, got.kv_pad, got.seed) == (e.max_waiting, e.kv_pad, 0)
    assert got.gpu_memory_utilization is None  # not given: herald serve's default
    plan.args.gpu_memory_utilization = 0.85  # (a GPU's; refused on this CPU by check_args)
    got = cli_parser().parse_args(serve_run.serve_command(plan)[3:])
    assert got.gpu_memory_utilization == 0.85
    # idle connections outlive the openai client's 5 s pool expiry (no close-vs-reuse race)
    assert got.keep_alive_timeout_s == serve_run.KEEP_ALIVE_S > 5.0


def test_vllm_names_of_the_engine_flags_as_herald_serve_takes_them(tmp_path: Path) -> None:
    argv = ["--model", "tiny-sdar", "--prompt-tokens", "64", "--concurrency", "1",
            "--max-num-seqs", "3", "--max-model-len", "512", *SMALL,
            "--out", str(tmp_path)]  # fmt: skip
    plan = serve.check_args(serve.build_parser().parse_args(argv))
    assert plan.engine is not None
    assert (plan.engine.max_batch_size, plan.engine.max_seq_len) == (3, 512)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-num-seqs", "0"], "--max-batch-size (--max-num-seqs) must be >= 1, got 0"),
        (["--max-model-len", "0"], "--max-seq-len (--max-model-len) must be >= 1, got 0"),
    ],
)
def test_out_of_range_values_name_their_flag(argv: list[str], says: str, tmp_path: Path) -> None:
    args = serve.build_parser().parse_args([*argv, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=re.escape(says)):
        serve.check_args(args)


def test_the_duration_limit_is_per_level() -> None:
    """--duration-limit-s cuts one level off (cancelling its requests), unlike the other
    commands' --time-limit-s (no new work past a whole run's limit): its help says so."""
    text = " ".join(serve.build_parser().format_help().split())
    assert "each load level's wall-clock limit in seconds" in text
    assert "(per level, not the whole run's) (default: 120.0)" in text


def test_token_counts_take_a_k_suffix_as_herald_serve_s() -> None:
    args = serve.build_parser().parse_args(
        ["--prompt-tokens", "1K", "2k", "--max-tokens", "1K", "--max-model-len", "4K",
         "--max-prefill-tokens", "2K", "--cpu-kv-tokens", "8K", "--out", "x"]
    )  # fmt: skip
    assert args.prompt_tokens == [1024, 2048] and args.max_tokens == 1024
    assert (args.max_seq_len, args.max_prefill_tokens, args.cpu_kv_tokens) == (4096, 2048, 8192)


def test_the_plot_leaves_out_a_series_no_level_has(tmp_path: Path, monkeypatch) -> None:
    """Without throughput points the legend has no "throughput bench" (its bars would all be
    empty)."""
    from types import SimpleNamespace

    from herald.bench import serve_report

    plt = pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed")
    figs: list[Any] = []

    def subplots(*args: Any, **kwargs: Any) -> Any:
        fig, ax = plt.subplots(*args, **kwargs)
        figs.append(fig)
        return fig, ax

    monkeypatch.setattr(
        serve_report, "pyplot", lambda: SimpleNamespace(subplots=subplots, close=plt.close)
    )
    for bench, want in ((None, 3), (80.0, 4)):
        rows = [("a", [60.0, 64.0, 70.0, bench]), ("b", [50.0, 55.0, None, None])]
        monkeypatch.setattr(serve_report, "_plot_rows", lambda runs, rows=rows: rows)
        assert serve_report.write_plot(tmp_path, []) == tmp_path / PLOT_NAME
        legend = [t.get_text() for t in figs[-1].axes[0].get_legend().get_texts()]
        assert len(legend) == want and ("throughput bench" in legend) == (bench is not None)
