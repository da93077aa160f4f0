"""Live servers for the HTTP tests: the real app under uvicorn on 127.0.0.1, a free port, and the
reference decoder. Tests import these from here, a module name of its own (``conftest`` is
ambiguous when several test folders with a conftest are collected in one run); the fixtures
are in conftest.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from helpers import make_engine

from herald.cli import main as cli_main
from herald.config import OffloadConfig, SamplingParams
from herald.models.loader import load_model
from herald.server.api import ServerState
from herald.server.defaults import FRONT_DEFAULTS, SERVE_DEFAULTS, FrontLimits
from herald.server.launch import bound_url, build_app, make_server, reserve_port

MODEL = "tiny-sdar"
MAX_SEQ_LEN = 256
API_KEY = "sesame"
TIMEOUT = httpx.Timeout(60.0)
TEST_FRONT = dataclasses.replace(FRONT_DEFAULTS, keep_alive_timeout_s=600.0)
"""``herald serve``'s front limits, but idle kept-alive connections stay open 600 s instead of 5.
httpx (and so the ``openai`` client) drops a pooled connection after 5 s idle, the server's own
default: a request sent on a connection idle just under 5 s could meet the server closing it
("Server disconnected without sending a response"), a race a loaded machine widens. With the
server's timeout far above the client's, the client always lets go first."""
SAMPLED = ["--temperature", "0.8", "--top-p", "0.9"]
"""CLI flags of the sampled case of :func:`assert_server_matches_cli` (the CLI's seed is 0)."""


def assert_server_matches_cli(
    url: str, capsys: pytest.CaptureFixture[str], mode_args: list[str], extra: list[str]
) -> None:
    """`herald generate` (``mode_args`` + ``extra``: [] or :data:`SAMPLED`) and the server at
    ``url`` give the same completion for the same prompt, length and steps."""
    prompt, n, steps = "the cli and the server agree", 48, 3
    argv = ["generate", "--model", MODEL, *mode_args, "--prompt", prompt]
    argv += ["--max-new-tokens", str(n), "--steps", str(steps), "--quiet", *extra]
    assert cli_main(argv) == 0
    want = capsys.readouterr().out[:-1]  # the completion, then print's newline
    body: dict[str, object] = {"prompt": prompt, "max_tokens": n, "steps": steps}
    if extra:
        body.update(temperature=0.8, top_p=0.9, seed=0)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


@dataclass
class LiveServer:
    app: FastAPI
    url: str
    server: Any  # uvicorn.Server
    thread: threading.Thread

    @property
    def state(self) -> ServerState:
        state: ServerState = self.app.state.herald
        return state

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def start_server(
    dtype: torch.dtype = torch.float32,
    *,
    api_key: str | None = None,
    mode: str = "dense",
    offload: OffloadConfig | None = None,
    model: str = MODEL,
    device: str = "cpu",
    limits: FrontLimits = TEST_FRONT,
    **engine_fields: object,
) -> LiveServer:
    """A live server of ``model`` on ``device`` over ``herald serve``'s engine and front settings
    with ``engine_fields`` changed, on a port the system picks (bound before the model loads, as
    ``herald serve``)."""
    if mode != "dense" and offload is None:
        offload = OffloadConfig.for_mode(mode)
    fields = {"max_seq_len": MAX_SEQ_LEN, "offload": offload, **engine_fields}
    engine = SERVE_DEFAULTS.replace(**fields)
    sock = reserve_port("127.0.0.1", 0)
    app = build_app(model, engine, device=device, dtype=dtype, api_key=api_key, limits=limits)
    server = make_server(app, sock, limits=limits, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    return LiveServer(app, bound_url(sock), server, thread)


class Offline:
    """The reference: each prompt decoded alone by a fresh DenseEngine on its own model copy."""

    def __init__(self) -> None:
        self.model, self.config, self.tokenizer = load_model(MODEL, "cpu", torch.float32)

    def run(self, prompt: str, params: SamplingParams) -> list[int]:
        engine = make_engine(
            self.model, self.config, None, max_batch_size=1, max_seq_len=MAX_SEQ_LEN
        )
        (req,) = engine.generate([self.tokenizer.encode(prompt)], params)
        return list(req.output_ids)
