"""herald bench serve end to end on the CPU: a real server of the embedded model over loopback,
loaded through the openai client with prompts of the standard library; its records, README and
refusals. Small sizes (two levels of three requests, 96-token prompts, two blocks of two steps):
no assertion on how fast anything ran."""

from __future__ import annotations

import json
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from herald.bench import serve
from herald.bench.serve_prompts import StdlibPrompts
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
    head, *levels = _records(tmp_path)
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
    _check_prompts(levels[0]["prompts"], 96)
    readme = (tmp_path / "README.md").read_text()
    assert "| dense | 96 | 1 | 3 / 0 / 0 |" in readme and "| dense | 96 | 3 | 3 / 0 / 0 |" in readme
    assert "Throughput figure beside it (not measured in this run): `herald bench" in readme


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


@pytest.mark.parametrize(("mode", "variant"), [("dense", "dense"), ("herald", "herald-selected")])
def test_the_throughput_point_beside_each_level(mode: str, variant: str, tmp_path: Path) -> None:
    argv = ["--model", "tiny-sdar", "--mode", mode, "--prompt-tokens", "64", "--concurrency", "2"]
    argv += ["--requests", "2", *SMALL, "--throughput-point", "--out", str(tmp_path)]
    assert serve.main(argv) == 0
    _, level, point = _records(tmp_path)
    assert level["kind"] == "level" and level["completed"] == 2 and level["mode"] == mode
    assert point["kind"] == "throughput_point" and point["run_id"] == level["run_id"]
    assert (point["prompt_tokens"], point["concurrency"], point["steps"]) == (64, 2, 2)
    assert point["variant"] == variant and point["status"] == "ok", point.get("error")
    assert point["decode_tokens_per_s"] > 0
    assert f"--context 64 --mode {variant} " in point["command"]
    assert "--batches 2 --steps 2" in point["command"]
    row = next(r for r in (tmp_path / "README.md").read_text().splitlines() if f"| {mode}" in r)
    assert row.endswith(f"| {point['decode_tokens_per_s']:.1f} |")
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
    _, level = _records(tmp_path)
    assert level["url"] == running_server and level["served_model"] == "tiny-sdar"
    assert level["completed"] + level["failed"] + level["cancelled"] == 4
    assert level["cancelled"] >= 1 and level["failed"] == 0
    assert level["server_idle_after"] is True  # the cancelled requests left the server


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompt-tokens", "200", "--max-seq-len", "256"], "more than --max-seq-len (256"),
        (["--prompt-tokens", "32768"], "the context of code-sdar"),
        (["--concurrency", "1", "0"], "--concurrency must be >= 1"),
        (["--model", "no-such-model"], "--model 'no-such-model' is neither"),
        (["--url", "http://127.0.0.1:9", "--mode", "herald"], "--mode: settings of the server"),
        (["--throughput-point", "--steps", "0"], "--throughput-point needs --steps"),
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
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not out.exists()


def test_herald_bench_serve_is_a_subcommand(tmp_path: Path, capsys) -> None:
    assert cli_main(["bench", "serve", "--concurrency", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
