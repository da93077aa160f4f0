"""HTTP tests of ``herald serve`` against the real server (uvicorn on loopback, tiny-sdar, CPU).

Every request uses fixed-steps mode or few blocks so the whole file stays well under a minute.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from engine_gate import engine_gate, running
from server_kit import (
    API_KEY,
    MAX_SEQ_LEN,
    MODEL,
    SAMPLED,
    TIMEOUT,
    LiveServer,
    Offline,
    assert_server_matches_cli,
    start_server,
)

from herald.config import SamplingParams


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=body["max_tokens"],
        temperature=body.get("temperature", 0.0),
        top_p=body.get("top_p", 1.0),
        threshold=body.get("threshold", 0.95),
        num_denoise_steps=body.get("steps"),
        seed=body.get("seed"),
    )


def _wait(cond: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _idle(s: LiveServer) -> bool:
    loop = s.state.engine_loop
    return not loop.engine.has_unfinished() and loop.num_running == 0 and loop.num_waiting == 0


def _sse_chunks(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_concurrent_clients_match_offline(server: LiveServer, offline: Offline) -> None:
    bodies = []
    for i in range(16):
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": f"client {i} says hello",
            "max_tokens": 32 + 16 * (i % 3),
            "steps": 2 + i % 3,
        }
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.9, seed=100 + i)
        bodies.append(body)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as c:
            return list(await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies)))

    responses = asyncio.run(go())
    for body, r in zip(bodies, responses, strict=True):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        want = offline.run(body["prompt"], _params(body))
        assert choice["token_ids"] == want
        assert choice["text"] == offline.tokenizer.decode(want)
        assert choice["finish_reason"] in ("stop", "length")
        assert r.json()["usage"]["completion_tokens"] == len(want)
    _wait(lambda: _idle(server))


@pytest.mark.parametrize("extra", [[], SAMPLED], ids=["greedy", "sampled"])
def test_matches_the_real_herald_generate_command(
    server: LiveServer, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    assert_server_matches_cli(server.url, capsys, ["--device", "cpu"], extra)


def test_streaming_joins_to_the_same_text(server: LiveServer) -> None:
    body = {"prompt": "stream me", "max_tokens": 96, "steps": 2}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = _sse_chunks(r)
    assert chunks[-1] == "[DONE]"
    parts = chunks[:-1]
    assert "".join(p["choices"][0]["text"] for p in parts) == full["text"]
    assert [t for p in parts for t in p["choices"][0]["token_ids"]] == full["token_ids"]
    # One chunk per completed block (at most B = 32 tokens; the first block also holds the
    # prompt's tail), then the final one with the reason.
    blocks = [p["choices"][0]["token_ids"] for p in parts[:-1]]
    assert len(blocks) >= 96 // 32 and all(0 < len(b) <= 32 for b in blocks)
    assert parts[-1]["choices"][0]["token_ids"] == []
    assert parts[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
    assert all(p["choices"][0]["finish_reason"] is None for p in parts[:-1])


def test_chat_completion_and_stream(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "steps": 2}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["role"] == "assistant"
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            chunks = _sse_chunks(s)
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert "".join(p["choices"][0]["delta"]["content"] for p in chunks[:-1]) == msg["content"]


def test_cancelled_stream_frees_its_slot(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.state.engine_loop.engine
    monkeypatch.setattr(engine.batch, "eos_token_ids", set())  # no early EOS: runs to the end
    aborted = server.state.engine_loop.num_aborted
    long_body = {"prompt": "a long one", "max_tokens": 200, "threshold": 1.0, "stream": True}
    short = {"prompt": "others keep going", "max_tokens": 32, "steps": 2}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c, engine_gate(engine) as gate:
        # held after the long request's first block: it cannot finish before the client goes
        gate.hold_after(lambda: running(engine, 200))
        results: list[int] = []
        t = threading.Thread(
            target=lambda: results.extend(
                c.post("/v1/completions", json=short).status_code for _ in range(3)
            )
        )
        with c.stream("POST", "/v1/completions", json=long_body) as r:
            lines = r.iter_lines()  # kept open: leaving this block closes the stream
            while not next(lines).startswith("data: "):
                pass  # first block arrived: the request is mid-generation
            t.start()
        # Leaving the block closed the stream; the abort reaches the held engine.
        _wait(lambda: engine.scheduler.num_aborts_pending == 1, timeout=120.0)
        gate.open()
        t.join(timeout=120)
    assert results == [200, 200, 200]
    _wait(lambda: _idle(server), timeout=120.0)
    assert len(server.state.engine_loop.engine.batch) == 0
    assert server.state.engine_loop.num_aborted == aborted + 1
    metrics = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT).text
    assert 'herald_requests_total{outcome="aborted"}' in metrics  # not counted as "ok"


def test_bad_inputs_get_4xx_while_a_good_request_completes(
    server: LiveServer, offline: Offline
) -> None:
    good: dict[str, Any] = {"prompt": "the good one", "max_tokens": 64, "steps": 3}
    got: list[httpx.Response] = []
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        t = threading.Thread(target=lambda: got.append(c.post("/v1/completions", json=good)))
        t.start()
        bad: list[tuple[dict[str, Any] | str, int, str | None]] = [
            ({"prompt": ""}, 400, "prompt"),
            ({}, 400, "prompt"),
            ({"prompt": "x" * (MAX_SEQ_LEN + 10)}, 400, "prompt"),
            ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
            ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
            ({"prompt": "hi", "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens"),
            ({"prompt": "hi", "threshold": 0}, 400, "threshold"),
            ({"prompt": "hi", "threshold": 1.5}, 400, "threshold"),
            ({"prompt": "hi", "n": 2}, 400, "n"),
            ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
            ({"prompt": "hi", "temperature": 1e300}, 400, "temperature"),
            ({"prompt": "hi", "temperature": 1, "seed": 2**64}, 400, "seed"),
            ({"prompt": "hi", "steps": 10**30}, 400, "steps"),
            ({"prompt": "x" * (64 * MAX_SEQ_LEN + 1)}, 400, "prompt"),
            ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
            ({"prompt": "hi", "steps": 0}, 400, "steps"),
            ({"prompt": "hi", "steps": 2, "threshold": 0.9}, 400, "steps"),
            ({"prompt": "hi", "stop": [""]}, 400, "stop"),
            ({"prompt": "hi", "mode": "warp"}, 400, "mode"),
            ({"prompt": "hi", "mode": "herald"}, 400, "mode"),
            ({"prompt": "hi", "budget": 0.05}, 400, "budget"),
            ({"prompt": "hi", "budget": 0}, 400, "budget"),
            ({"prompt": []}, 400, "prompt"),
            ({"prompt": ["a", ""]}, 400, "prompt"),
            ({"prompt": [[]]}, 400, "prompt"),
            ({"prompt": [1, "a"]}, 400, "prompt"),
            ({"prompt": "hi", "model": "nope"}, 404, "model"),
            ('{"prompt": "hi", ', 400, None),
            ("[1, 2]", 400, None),
        ]
        for body, status, param in bad:
            if isinstance(body, str):
                r = c.post(
                    "/v1/completions", content=body, headers={"content-type": "application/json"}
                )
            else:
                r = c.post("/v1/completions", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            if param is not None:
                assert err["param"] == param, (body, err)
        r = c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        r = c.post("/v1/chat/completions", json={"messages": image})
        assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
        # Unknown fields are refused, by name; the server's own mode and budget are accepted.
        r = c.post("/v1/completions", json={"prompt": "hi", "x": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x", r.text
        r = c.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 8, "steps": 1, "mode": "dense", "budget": 1.0},
        )
        assert r.status_code == 200, r.text
        # A temperature too small for float32 logits samples (as 1e-4) instead of failing.
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "temperature": 1e-40})
        assert r.status_code == 200, r.text
        t.join(timeout=60)
    assert got and got[0].status_code == 200, got
    want = offline.run(good["prompt"], _params(good))
    assert got[0].json()["choices"][0]["token_ids"] == want


def test_mask_text_is_plain_text(server: LiveServer) -> None:
    prompt = "before <|MASK|> after <|MASK|>"
    mask_id = server.state.engine_loop.engine.config.mask_token_id
    assert mask_id not in server.state.tokenizer.encode(prompt)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32, "steps": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_string_truncates(server: LiveServer) -> None:
    body = {"prompt": "stop test", "max_tokens": 64, "steps": 2}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = text[5:7]
        assert stop
        r = c.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
        assert r["text"] == text[: text.find(stop)] and r["finish_reason"] == "stop"
        streamed = {**body, "stop": [stop], "stream": True}
        with c.stream("POST", "/v1/completions", json=streamed) as s:
            parts = _sse_chunks(s)[:-1]
        assert "".join(p["choices"][0]["text"] for p in parts) == r["text"]
    _wait(lambda: _idle(server))


def test_engine_error_fails_that_request_only(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.state.engine_loop.engine
    poison = server.state.tokenizer.encode("POISON")
    real = engine.add_request

    def add_request(ids: list[int], params: SamplingParams) -> Any:
        if list(ids) == poison:
            raise RuntimeError("injected failure")
        return real(ids, params)

    monkeypatch.setattr(engine, "add_request", add_request)
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        ok: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: ok.append(
                c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 32, "steps": 2})
            )
        )
        t.start()
        r = c.post("/v1/completions", json={"prompt": "POISON", "max_tokens": 8})
        t.join(timeout=60)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        assert ok[0].status_code == 200
        assert c.get("/health").status_code == 200


def test_queue_full_503_and_api_key(
    small_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One slot, one waiting place: with the slot held and the place taken, a third request gets
    a 503. The engine is held after the running request's first block (not slowed down), so no
    step can free the slot or the place while the test looks."""
    s = small_server
    engine = s.state.engine_loop.engine
    monkeypatch.setattr(engine.batch, "eos_token_ids", set())  # the held request must not end
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        assert c.get("/v1/models").status_code == 401
        bad = c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401
        models = c.get("/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == MODEL
        assert c.get("/health").json() == {"status": "ok"}

        long_body = {"prompt": "hold", "max_tokens": 200, "threshold": 1.0, "stream": True}
        queued: list[httpx.Response] = []
        loop = s.state.engine_loop
        with engine_gate(engine) as gate:
            gate.hold_after(lambda: running(engine, 200))
            with c.stream("POST", "/v1/completions", json=long_body, headers=auth) as held:
                lines = held.iter_lines()  # kept open: leaving this block closes the stream
                while not next(lines).startswith("data: "):
                    pass  # its first block arrived: it holds the one slot, the engine waits
                body = {"prompt": "queued", "max_tokens": 16, "steps": 1}
                t = threading.Thread(
                    target=lambda: queued.append(c.post("/v1/completions", json=body, headers=auth))
                )
                t.start()
                _wait(lambda: loop.num_waiting == 1, timeout=120.0)
                full = c.post("/v1/completions", json=body, headers=auth)
                assert full.status_code == 503, full.text
                assert full.json()["error"]["type"] == "overloaded_error"
                assert full.headers["retry-after"] == "1"
            # leaving the block closed the stream: its abort is pending, the engine still held
            _wait(lambda: engine.scheduler.num_aborts_pending == 1, timeout=120.0)
            gate.open()
            t.join(timeout=120)
        assert queued and queued[0].status_code == 200
        _wait(lambda: _idle(s), timeout=120.0)


def test_metrics_and_health(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        c.post("/v1/completions", json={"prompt": "count me", "max_tokens": 32, "steps": 1})
        text = c.get("/metrics").text
        assert c.get("/health").status_code == 200
    for name in (
        "herald_requests_running",
        "herald_requests_waiting",
        "herald_generated_tokens_total",
        "herald_generation_tokens_per_second",
        "herald_engine_step_seconds_count",
        "herald_batch_size",
        "herald_gpu_kv_slots_used",
        "herald_gpu_kv_slots_total",
        "herald_gpu_kv_bytes",
        "herald_cpu_kv_pool_pages_used",
        "herald_prompt_tokens_total",
        "herald_prefill_tokens_per_second",
        "herald_prefill_seconds_total",
        "herald_decode_seconds_total",
        "herald_time_to_first_token_seconds_count",
        "herald_time_per_output_block_seconds_count",
        "herald_e2e_request_latency_seconds_count",
        "herald_batch_rows_total",
        "herald_engine_idle_seconds_total",
        "herald_engine_publish_seconds_total",
    ):
        assert name in text
    values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln[:1] != "#"}
    for name in ("herald_generated_tokens_total", "herald_decode_seconds_total",
                 "herald_time_to_first_token_seconds_count",
                 "herald_e2e_request_latency_seconds_count", "herald_batch_rows_total",
                 "herald_engine_publish_seconds_total"):  # fmt: skip
        assert values[name] > 0, name


def test_disconnected_non_streaming_client_is_aborted(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.state.engine_loop.engine
    monkeypatch.setattr(engine.batch, "eos_token_ids", set())  # no early EOS: runs to the end
    _wait(lambda: _idle(server))
    aborted = server.state.engine_loop.num_aborted
    body = json.dumps({"prompt": "gone", "max_tokens": 200, "threshold": 1.0}).encode()
    url = httpx.URL(server.url)
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    with engine_gate(engine) as gate:
        # held after its first step: the request is running and cannot finish
        gate.hold_after(lambda: running(engine, 200))
        sock = socket.create_connection((url.host, url.port), timeout=60)
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait(gate.held.is_set)
        sock.close()  # the client goes away while its request runs
        _wait(lambda: engine.scheduler.num_aborts_pending == 1)  # the server saw it
        gate.open()
    _wait(lambda: _idle(server))
    assert server.state.engine_loop.num_aborted == aborted + 1


def test_burst_fills_free_slots_before_the_queue_and_client_conveniences() -> None:
    """8 requests at once with 4 slots and a 4-deep queue all run (none gets a 503); the API key
    scheme is case-insensitive; GET /v1/models/{id}; chat's max_completion_tokens."""
    srv = start_server(max_batch_size=4, max_waiting=4, api_key=API_KEY)
    try:
        auth = {"Authorization": f"bearer {API_KEY}"}
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT, headers=auth) as c:
            assert c.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
            assert c.get("/v1/models/other").status_code == 404
            body = {"prompt": "burst", "max_tokens": 48, "steps": 2}
            with ThreadPoolExecutor(8) as ex:
                codes = list(ex.map(lambda _: c.post("/v1/completions", json=body).status_code,
                                    range(8)))  # fmt: skip
            assert codes == [200] * 8
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    finally:
        srv.close()


def test_refused_generation_requests_are_counted_as_invalid(server: LiveServer) -> None:
    """400s of the generation routes (bad field, bad type, a prompt over the context) count as
    outcome invalid; other routes' answers and good requests do not."""

    def invalid(c: httpx.Client) -> float:
        for ln in c.get("/metrics").text.splitlines():
            if ln.startswith('herald_requests_total{outcome="invalid"}'):
                return float(ln.split()[1])
        return 0.0

    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        before = invalid(c)
        bad = [{"prompt": "x", "max_tokens": 4, "best_of": 2}, {"prompt": "x", "max_tokens": "4"}]
        for body in bad:
            assert c.post("/v1/completions", json=body).status_code == 400
        long = {"messages": [{"role": "user", "content": "y " * 4000}], "max_tokens": 4}
        assert c.post("/v1/chat/completions", json=long).status_code == 400
        assert c.post("/tokenize", json={"prompt": 5}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 4}).status_code == 200
        assert invalid(c) == before + 3
