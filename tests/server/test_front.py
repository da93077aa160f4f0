"""The HTTP front (``herald.server.front``) over raw sockets: slow headers and bodies are closed,
bodies above the limit get a 413 before they are read, the API key is checked first.

No test races the server: limits are small (a fraction of a second), and each test reads until
the server closes the connection, with a client-side timeout far longer than the limit.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from server_kit import API_KEY, TEST_FRONT, TIMEOUT, LiveServer, start_server

from herald.server.defaults import SERVE_DEFAULTS, FrontLimits

LIMITS = FrontLimits(
    header_timeout_s=0.3, body_timeout_s=0.3, keep_alive_timeout_s=0.3, max_body_bytes=4096
)
EOF_WAIT = 30.0  # seconds the client waits for the server to close: 100x the limits
AUTH = f"Authorization: Bearer {API_KEY}\r\n"


@pytest.fixture(scope="module")
def front_server() -> Iterator[LiveServer]:
    s = start_server(max_batch_size=2, api_key=API_KEY, limits=LIMITS)
    yield s
    s.close()


def _connect(s: LiveServer) -> socket.socket:
    url = urlsplit(s.url)
    assert url.hostname is not None and url.port is not None
    sock = socket.create_connection((url.hostname, url.port), timeout=EOF_WAIT)
    sock.settimeout(EOF_WAIT)
    return sock


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout, failing
    the test, if it keeps it open for EOF_WAIT seconds)."""
    out = []
    with sock:
        while chunk := sock.recv(65536):
            out.append(chunk)
    return b"".join(out)


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return status, error


def _post_head(length: int | None, *, auth: bool = True, chunked: bool = False) -> bytes:
    lines = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    if auth:
        lines += AUTH
    if length is not None:
        lines += f"Content-Length: {length}\r\n"
    if chunked:
        lines += "Transfer-Encoding: chunked\r\n"
    return (lines + "\r\n").encode()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"])
def test_unfinished_headers_are_closed(front_server: LiveServer, sent: bytes) -> None:
    sock = _connect(front_server)
    sock.sendall(sent)
    assert _until_closed(sock) == b""  # closed, nothing answered


def test_headers_after_a_kept_alive_request_are_timed_too(front_server: LiveServer) -> None:
    sock = _connect(front_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\nGET /health HTTP/1.1\r\n")
    raw = _until_closed(sock)  # the first is answered, the unfinished second is closed
    assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1") == 1


def test_idle_keep_alive_connection_is_closed(front_server: LiveServer) -> None:
    sock = _connect(front_server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    raw = _until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"status":"ok"}')


def test_unfinished_body_gets_408_and_is_closed(front_server: LiveServer) -> None:
    sock = _connect(front_server)
    sock.sendall(_post_head(100) + b'{"prompt": ')
    status, error = _status_and_error(_until_closed(sock))
    assert status == 408 and error["code"] == "request_timeout"


def test_unfinished_chunked_body_gets_408(front_server: LiveServer) -> None:
    sock = _connect(front_server)
    sock.sendall(_post_head(None, chunked=True) + b'5\r\n{"pro\r\n')
    status, _ = _status_and_error(_until_closed(sock))
    assert status == 408


def test_content_length_above_the_limit_gets_413_before_the_body(
    front_server: LiveServer,
) -> None:
    sock = _connect(front_server)
    sock.sendall(_post_head(30 * 1024**2))  # no body byte is sent
    status, error = _status_and_error(_until_closed(sock))
    assert status == 413 and error["code"] == "request_too_large" and "4096" in error["message"]


def test_chunked_body_is_counted_while_read(front_server: LiveServer) -> None:
    sock = _connect(front_server)
    chunk = b"x" * 3000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(2)) + b"0\r\n\r\n"
    sock.sendall(_post_head(None, chunked=True) + body)
    status, _ = _status_and_error(_until_closed(sock))
    assert status == 413


@pytest.mark.parametrize("length", [30 * 1024**2, 20])
def test_api_key_is_checked_before_the_body(front_server: LiveServer, length: int) -> None:
    """401 (not 413, not a 400 for the JSON) although the body is too large or not JSON, and
    without waiting for it (the body never comes: a 408 would mean it was waited for)."""
    sock = _connect(front_server)
    sock.sendall(_post_head(length, auth=False))
    status, error = _status_and_error(_until_closed(sock))
    assert status == 401 and error["type"] == "authentication_error"


def test_requests_within_the_limits_are_served(front_server: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 8, "steps": 1}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    # A fresh connection per request: this server closes idle connections after 0.3 s, and a
    # pooled one reused after a pause that long (a loaded machine) would race its closing.
    fresh = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=front_server.url, timeout=TIMEOUT, headers=auth, limits=fresh) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: a chunked body
            data = json.dumps(body).encode()
            yield data[:5]
            yield data[5:]

        r = c.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
        r = c.post("/v1/completions", json={**body, "prompt": "x" * 5000})
        assert r.status_code == 413
        assert c.get("/health").status_code == 200
    assert httpx.get(f"{front_server.url}/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{front_server.url}/v1/models", timeout=TIMEOUT).status_code == 401


@pytest.mark.parametrize("stream", [True, False])
def test_shutdown_closes_requests_still_running_after_its_timeout(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A shutdown waits ``shutdown_timeout_s`` for the requests in flight, then closes them: a
    request the engine holds (at a gate, so however slow the machine) must not hold it. A
    non-streamed request cut so gets a closed connection or an error in the API's shape (503,
    ``server_shutting_down``), never a bare 500; a stream ends with that error as its last event,
    then ``data: [DONE]``. The server logs one warning for it (herald's, that the shutdown cut
    the request), no error and no traceback (uvicorn's ERROR line is turned into that warning)."""
    import logging
    import threading

    from engine_gate import engine_gate

    srv = start_server(
        limits=dataclasses.replace(TEST_FRONT, shutdown_timeout_s=0.5), max_batch_size=2
    )
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")  # configured by the server: after its start
    uvicorn_log.addHandler(handler)
    engine = srv.state.engine_loop.engine
    ended = threading.Event()
    outcome: dict[str, str] = {}
    events: list[str] = []

    def client() -> None:
        body = {"prompt": "held", "max_tokens": 64, "stream": stream}
        try:
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                if stream:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        events.extend(x for x in r.iter_lines() if x.startswith("data: "))
                    done = events[-1:] == ["data: [DONE]"]
                    outcome["end"] = "complete" if done and "error" not in events[-2] else "cut"
                    if done and "error" in events[-2]:
                        outcome["end"] = f"error {json.loads(events[-2][6:])['error']['code']}"
                else:
                    r = c.post("/v1/completions", json=body)
                    outcome["end"] = "complete" if r.status_code == 200 else str(r.status_code)
                    if r.status_code == 503:
                        outcome["end"] = f"503 {r.json()['error']['code']}"
        except httpx.HTTPError as e:
            outcome["end"] = type(e).__name__
        ended.set()

    try:
        with engine_gate(engine) as gate:
            gate.hold_after(lambda: engine.num_running > 0)
            threading.Thread(target=client, daemon=True).start()
            assert gate.held.wait(60), "the request never reached the engine"
            srv.server.should_exit = True
            assert ended.wait(60), "the shutdown waited for a request the engine holds"
        assert outcome["end"] != "complete", outcome  # cut by the shutdown, not finished
        if stream:
            assert outcome["end"] == "error server_shutting_down", (outcome, events)
        else:
            assert outcome["end"] in ("503 server_shutting_down", "RemoteProtocolError"), outcome
    finally:
        srv.close()
        uvicorn_log.removeHandler(handler)
    assert not srv.thread.is_alive()
    records = [*logged, *caplog.records]  # uvicorn's logger does not reach the root's
    assert [r.exc_info for r in records if r.exc_info] == [], "a traceback was logged"
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    assert errors == [], "an expected end of a shutdown logged as an error"
    assert [r.getMessage() for r in logged] == []
    cut = [r for r in caplog.records if r.getMessage().startswith("shutdown: ")]
    assert [(r.name, r.levelno) for r in cut] == [("herald.server.launch", logging.WARNING)]
    assert cut[0].getMessage().startswith("shutdown: 1 request(s) still running"), cut


def test_a_forced_quit_stops_the_engine_and_logs_one_warning(monkeypatch, caplog) -> None:
    """A second Ctrl-C while requests run makes uvicorn cancel the app's lifespan before its
    shutdown: serve() still stops the engine thread (else the interpreter exits under a running
    step and the process aborts), and the cancelled lifespan's traceback, which starlette sends
    uvicorn as a failed shutdown, is one herald warning."""
    import logging

    from herald.server import launch

    app = launch.build_app("tiny-sdar", SERVE_DEFAULTS.replace(max_batch_size=1), warm_up=False)
    stopped: list[bool] = []
    monkeypatch.setattr(app.state.herald.engine_loop, "stop", lambda: stopped.append(True))

    class ForcedQuit:
        def run(self, sockets) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(launch, "make_server", lambda *args, **kwargs: ForcedQuit())
    with pytest.raises(KeyboardInterrupt):
        launch.serve(app, sock=launch.reserve_port("127.0.0.1", 0))
    assert stopped == [True]
    uvicorn_log = logging.getLogger("uvicorn.error")
    record = uvicorn_log.makeRecord(
        "uvicorn.error", logging.ERROR, __file__, 1,
        "Traceback (most recent call last):\n  ...\nasyncio.exceptions.CancelledError\n", (), None,
    )  # fmt: skip
    assert launch._SHUTDOWN_CUT.filter(record) is False
    assert "forced quit: requests still running were cut" in caplog.text
    other = uvicorn_log.makeRecord(
        "uvicorn.error", logging.ERROR, __file__, 1, "Traceback: ValueError", (), None
    )
    assert launch._SHUTDOWN_CUT.filter(other) is True  # any other error is logged as it is
