"""``herald serve --mode herald`` over HTTP: the offload engine behind the real server (tiny-sdar,
bf16, CPU, budget 1.0, a CPU pool of 8 pages that admits at most 2 of these requests at once).

At budget 1.0 every block attends to the whole prefix, so each client must get exactly what
offline ``herald generate --mode herald --kv-budget 1.0`` gives.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from helpers import make_engine
from server_kit import (
    MAX_SEQ_LEN,
    MODEL,
    SAMPLED,
    TIMEOUT,
    LiveServer,
    assert_server_matches_cli,
    start_server,
)

from herald.cli import main as cli_main
from herald.config import OffloadConfig, SamplingParams
from herald.diffusion.block import BlockLayout
from herald.engine.request import RequestStatus
from herald.models.loader import load_model
from herald.offload.engine import OffloadEngine

POOL_TOKENS = 256  # 8 pages of B = 32


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=body["max_tokens"],
        temperature=body.get("temperature", 0.0),
        top_p=body.get("top_p", 1.0),
        threshold=body.get("threshold", 0.95),
        num_denoise_steps=body.get("steps"),
        seed=body.get("seed"),
    )


class OfflineHerald:
    """What ``herald generate --mode herald --kv-budget 1.0`` runs: one request alone in a fresh
    OffloadEngine sized for it (bf16, the default CPU pool)."""

    def __init__(self) -> None:
        self.model, self.config, self.tokenizer = load_model(MODEL, "cpu", torch.bfloat16)

    def run(self, prompt: str, params: SamplingParams) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        max_len = len(ids) + params.max_new_tokens + self.config.block_size
        cfg = OffloadConfig.for_mode("herald", kv_budget=1.0)
        engine = make_engine(self.model, self.config, cfg, max_batch_size=1, max_seq_len=max_len)
        try:
            (req,) = engine.generate([ids], params)
        finally:
            engine.close()
        return list(req.output_ids)


@pytest.fixture(scope="module")
def herald_server() -> Iterator[LiveServer]:
    offload = OffloadConfig.for_mode("herald", kv_budget=1.0, cpu_kv_tokens=POOL_TOKENS)
    s = start_server(
        dtype=torch.bfloat16, mode="herald", offload=offload, max_batch_size=4, max_waiting=64
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline_herald() -> OfflineHerald:
    return OfflineHerald()


def _engine(s: LiveServer) -> OffloadEngine:
    engine = s.state.engine_loop.engine
    assert isinstance(engine, OffloadEngine)
    return engine


def _wait(cond: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _idle(s: LiveServer) -> bool:
    loop = s.state.engine_loop
    return not loop.engine.has_unfinished() and loop.num_running == 0 and loop.num_waiting == 0


def _record_steps(
    s: LiveServer,
    monkeypatch: pytest.MonkeyPatch,
    gate: threading.Event | None = None,
    hold: Callable[[], bool] | None = None,
) -> list:
    """Wrap the engine's step: wait for ``gate`` (when given) before each; record (rows, CPU
    pages used, aborted rows) after each; clear ``gate`` (from the engine thread) after the
    first step at whose end ``hold()`` is true."""
    engine = _engine(s)
    real_step = engine.step
    seen: list[tuple[int, int, int]] = []
    held: list[bool] = []

    def step() -> Any:
        if gate is not None:
            gate.wait()
        out = real_step()
        reqs = engine.batch.requests
        aborted = sum(r.status == RequestStatus.FINISHED_ABORTED for r in reqs)
        seen.append((len(reqs), engine.cpu_pool.num_used_pages, aborted))
        if gate is not None and hold is not None and not held and hold():
            held.append(True)  # once
            gate.clear()
        return out

    monkeypatch.setattr(engine, "step", step)
    return seen


def test_16_clients_match_offline_herald_generate(
    herald_server: LiveServer, offline_herald: OfflineHerald, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _record_steps(herald_server, monkeypatch)
    bodies = []
    for i in range(16):
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": f"client {i} says hello",
            "max_tokens": 32 + 16 * (i % 3),
            "steps": 2 + i % 3,
            "mode": "herald",
        }
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.9, seed=100 + i)
        bodies.append(body)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=herald_server.url, timeout=TIMEOUT) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies)))

    responses = asyncio.run(go())
    for body, r in zip(bodies, responses, strict=True):
        assert r.status_code == 200, r.text
        want = offline_herald.run(body["prompt"], _params(body))
        assert r.json()["choices"][0]["token_ids"] == want
    _wait(lambda: _idle(herald_server))
    # Admission by CPU pool: these requests hold 3 or 4 of the 8 pages, so at most 2 ran at once
    # although the server has 4 slots; and every page came back.
    assert max(rows for rows, _, _ in seen) == 2
    assert max(pages for _, pages, _ in seen) <= POOL_TOKENS // 32
    assert _engine(herald_server).cpu_pool.num_used_pages == 0
    with httpx.Client(base_url=herald_server.url, timeout=TIMEOUT) as c:
        metrics = c.get("/metrics").text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln[:1] != "#"}
    assert values["herald_cpu_kv_pool_pages_total"] == 8
    assert values["herald_cpu_kv_pool_pages_used"] == 0
    assert values["herald_gpu_kv_slots_total"] == 4
    for name in ("main_stream", "retrieval_stream", "boundary_stall"):
        assert values[f"herald_block_{name}_seconds_count"] > 0


@pytest.mark.parametrize("extra", [[], SAMPLED], ids=["greedy", "sampled"])
def test_matches_the_real_herald_generate_command(
    herald_server: LiveServer, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert_server_matches_cli(
        herald_server.url, capsys, ["--mode", "herald", "--kv-budget", "1.0"], extra
    )


def test_streaming_joins_to_the_same_text(herald_server: LiveServer) -> None:
    body = {"prompt": "stream me", "max_tokens": 80, "steps": 2}
    with httpx.Client(base_url=herald_server.url, timeout=TIMEOUT) as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]
        texts, ids = [], []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    texts.append(choice["text"])
                    ids += choice["token_ids"]
    assert "".join(texts) == full["text"] and ids == full["token_ids"]
    assert len(texts) >= 3  # one chunk per block, then the final one


def test_cancel_mid_block_frees_cpu_pages_for_waiting_requests(
    herald_server: LiveServer, offline_herald: OfflineHerald, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, engine = herald_server, _engine(herald_server)
    gate = threading.Event()
    gate.set()

    after_first_block: list[int] = []

    def mid_second_block() -> bool:  # 2 of 32 steps into its second block, whatever the timing
        reqs = engine.batch.requests
        if len(reqs) == 1 and reqs[0].output_ids:
            after_first_block.append(1)
        return len(after_first_block) == 3

    seen = _record_steps(s, monkeypatch, gate, hold=mid_second_block)
    monkeypatch.setattr(engine.batch, "eos_token_ids", set())  # the long one must not end early
    loop = s.state.engine_loop
    aborted = loop.num_aborted
    # 6 of the 8 pages, 32 steps per block: the short ones (3 pages each) cannot join until it
    # leaves.
    long_body = {"prompt": "a long one", "max_tokens": 150, "threshold": 1.0, "stream": True}
    short = {"prompt": "others wait for pages", "max_tokens": 32, "steps": 2}
    results: list[httpx.Response] = []
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        threads = [
            threading.Thread(target=lambda: results.append(c.post("/v1/completions", json=short)))
            for _ in range(2)
        ]
        with c.stream("POST", "/v1/completions", json=long_body) as r:
            lines = r.iter_lines()  # kept open: leaving this block closes the stream
            while not next(lines).startswith("data: "):
                pass  # its first block arrived: it is mid-generation
            _wait(lambda: not gate.is_set(), timeout=120.0)  # held inside its second block
            for t in threads:
                t.start()
            _wait(lambda: loop.num_waiting == 2, timeout=120.0)  # held back by the CPU pool
            assert len(engine.batch) == 1 and engine.cpu_pool.num_used_pages == 6
        # Leaving the block closed the stream: the abort reaches the engine mid-block.
        _wait(lambda: engine.scheduler.num_aborts_pending == 1, timeout=120.0)
        gate.set()
        for t in threads:
            t.join(timeout=120)
    assert [r.status_code for r in results] == [200, 200]
    want = offline_herald.run(short["prompt"], _params(short))
    assert all(r.json()["choices"][0]["token_ids"] == want for r in results)
    _wait(lambda: _idle(s))
    assert loop.num_aborted == aborted + 1
    assert engine.cpu_pool.num_used_pages == 0 and len(engine.batch) == 0
    # Lockstep blocks: the aborted row stayed (holding its 6 pages) for the rest of its block,
    # then left at the boundary, its pages freed; the short ones joined at that same boundary.
    held = [i for i, (_, pages, n) in enumerate(seen) if n == 1]
    assert len(held) >= 2 and all(seen[i][:2] == (1, 6) for i in held)
    assert seen[held[-1] + 1] == (2, 6, 0)  # 2 short ones x 3 pages


def test_bad_inputs_while_a_good_request_completes(
    herald_server: LiveServer, offline_herald: OfflineHerald
) -> None:
    good = {"prompt": "the good one", "max_tokens": 64, "steps": 3}
    got: list[httpx.Response] = []
    with httpx.Client(base_url=herald_server.url, timeout=TIMEOUT) as c:
        t = threading.Thread(target=lambda: got.append(c.post("/v1/completions", json=good)))
        t.start()
        bad: list[tuple[dict[str, Any], str, str]] = [
            ({"prompt": "hi", "mode": "dense"}, "mode", "runs mode 'herald'"),
            ({"prompt": "hi", "mode": "mage"}, "mode", "runs mode 'herald'"),
            ({"prompt": "hi", "mode": "warp"}, "mode", "unknown mode"),
            ({"prompt": "hi", "budget": 0.05}, "budget", "kv budget 1.0"),
            ({"prompt": "hi", "kv_budget": 2}, "kv_budget", "less than or equal to 1"),
            # 10 + 230 tokens -> 256 in blocks: 9 pages (with the draft page) of a pool of 8.
            ({"prompt": "0123456789", "max_tokens": 230}, "max_tokens", "CPU pool holds 8"),
            ({"prompt": "hi", "max_tokens": MAX_SEQ_LEN}, "max_tokens", "max_seq_len"),
            ({"prompt": "hi", "threshold": 0}, "threshold", "greater than 0"),
            ({"prompt": ""}, "prompt", "at least 1"),
        ]
        for body, param, needle in bad:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and needle in err["message"], (body, err)
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "steps": 1,
                                              "mode": "herald", "budget": 1.0})  # fmt: skip
        assert ok.status_code == 200, ok.text
        t.join(timeout=60)
    assert got and got[0].status_code == 200, got
    assert got[0].json()["choices"][0]["token_ids"] == offline_herald.run(
        good["prompt"], _params(good)
    )
    models = httpx.get(f"{herald_server.url}/v1/models").json()["data"][0]["herald"]
    assert models == {"mode": "herald", "kv_budget": 1.0, "block_size": 32, "first_pass": "none"}


def test_page_count_is_the_canvas_in_blocks_plus_one(herald_server: LiveServer) -> None:
    engine = _engine(herald_server)
    for prompt_len, n in ((1, 1), (10, 22), (31, 1), (32, 32), (33, 100), (100, 150)):
        canvas = BlockLayout(prompt_len, 32, n).total_len
        assert canvas % 32 == 0
        assert engine.pages_needed(prompt_len, n) == canvas // 32 + 1


def test_openai_client(herald_server: LiveServer, offline_herald: OfflineHerald) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"{herald_server.url}/v1", api_key="unused", timeout=60, max_retries=0
    )
    extra = {"steps": 2, "mode": "herald"}
    r = client.completions.create(model=MODEL, prompt="openai", max_tokens=40, extra_body=extra)
    want = offline_herald.run("openai", SamplingParams(max_new_tokens=40, num_denoise_steps=2))
    assert r.choices[0].text == offline_herald.tokenizer.decode(want)
    stream = client.completions.create(
        model=MODEL, prompt="openai", max_tokens=40, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="runs mode 'herald'"):
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=8, extra_body={"mode": "infinigen"}
        )


def test_kv_pad_server_at_low_budget_equals_the_real_cli_next_to_batch_mates(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--kv-pad reaches the engines of both commands, and at budget 0.05 a request served next
    to batch mates gets exactly the tokens `herald generate ... --kv-pad 512` gives alone. (That
    the padding is what makes this hold for any mates is shown on the engine:
    tests/engine/test_offload.py::test_kv_pad_makes_outputs_independent_of_batch_mates.)"""
    prompt, n = "Request 5: i fhiiace iefjdgigchejfdejd ajgfgdedb c", 64
    argv = ["generate", "--model", MODEL, "--mode", "herald", "--kv-budget", "0.05"]
    argv += ["--kv-pad", "512"]
    argv += ["--prompt", prompt, "--max-new-tokens", str(n), "--quiet"]
    assert cli_main(argv) == 0
    want = capsys.readouterr().out[:-1]
    offload = OffloadConfig.for_mode("herald", kv_budget=0.05, cpu_kv_tokens=4096)
    srv = start_server(dtype=torch.bfloat16, mode="herald", offload=offload, kv_pad=512,
                       max_batch_size=4)  # fmt: skip
    try:
        engine = srv.state.engine_loop.engine
        assert engine.kv_pad == 512 and engine.sparse_attn.kv_pad == 512
        bodies = [{"prompt": p, "max_tokens": n} for p in (prompt, "x" * 150, "y" * 100)]
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c, ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda b: c.post("/v1/completions", json=b), bodies))
        assert all(r.status_code == 200 for r in got), [r.text for r in got]
        assert got[0].json()["choices"][0]["text"] == want
    finally:
        srv.close()
