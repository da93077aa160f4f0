"""A long prompt is prefilled in chunks over several block boundaries while others decode."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from engine_gate import engine_gate
from server_kit import Offline, start_server

from herald.config import SamplingParams


def _wait_for(cond: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_long_prompt_prefilled_in_chunks_next_to_a_running_request(
    offline: Offline, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = start_server(max_batch_size=2, max_prefill_tokens=64)
    try:
        engine = srv.state.engine_loop.engine
        assert engine.max_prefill_tokens == 64
        monkeypatch.setattr(engine.batch, "eos_token_ids", set())  # both run to max_tokens
        mid_prefill = []
        real_admit = engine._admit

        def admit() -> None:
            real_admit()
            prefilling = engine.scheduler.prefilling
            if prefilling is not None and len(engine.batch):
                mid_prefill.append(prefilling.request.request_id)

        monkeypatch.setattr(engine, "_admit", admit)
        short = {"prompt": "import os\n", "max_tokens": 128}
        long = {"prompt": "def f(x):\n    return x * 2\n" * 8, "max_tokens": 32}  # ~220 tokens
        got: dict[str, list[int]] = {}

        def post(name: str, body: dict) -> None:
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            got[name] = r.json()["choices"][0]["token_ids"]

        with engine_gate(engine) as gate:
            # the short one joins and decodes its first step; then the engine waits for the long
            # one to be queued, so that its chunks are prefilled next to a running request
            gate.hold_after(lambda: len(engine.batch) > 0)
            first = threading.Thread(target=post, args=("short", short))
            first.start()
            second = threading.Thread(target=post, args=("long", long))
            _wait_for(lambda: gate.held.is_set())
            second.start()
            _wait_for(lambda: engine.num_waiting == 1)
            gate.open()
            first.join(timeout=120)
            second.join(timeout=120)
        for name, body in (("short", short), ("long", long)):
            params = SamplingParams(max_new_tokens=body["max_tokens"], ignore_eos=True)
            assert got[name] == offline.run(body["prompt"], params), name
        assert len(mid_prefill) >= 2  # chunks of the long prompt at several boundaries
    finally:
        srv.close()
