"""Soak: identical load rounds against a live server leave nothing behind.

Each round sends the same mixed-length prompts (slices of standard-library sources) from
concurrent clients to a real server (tiny-sdar on the CPU), in herald mode and, for comparison,
dense. After every round the engine must be back to its idle state exactly: no KV page or slot
in use, no per-request entry in any of its tables. The process's resident memory must reach a
plateau: after the warm-up rounds, the measured rounds may not add more than
:data:`RSS_MARGIN_MB`.

What grew round after round at the embedded model's scale was oneDNN's per-shape primitive caches
(CPU bf16 matmuls, herald mode; :mod:`herald.onednn`): the variety of shapes a long, mixed load
brings. These small identical rounds meet all their shapes in the warm-up, so the soak guards
against memory the server keeps per request or per round, and the last test checks the cache
bound itself, deterministically, from oneDNN's creation log.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_kit import TIMEOUT, LiveServer, start_server

from herald import onednn
from herald.offload.engine import OffloadEngine

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads the resident set from /proc"
)

WARMUP_ROUNDS, MEASURED_ROUNDS = 2, 4
CLIENTS = 6
RSS_MARGIN_MB = 24.0
"""Growth allowed from the first to the last measured round (three rounds apart). Measured this
way, identical rounds differ by under 2 MB; a step that keeps 64 KB (~5 MB a round) shows as
~5 MB a round, so a leak of 8 MB a round or more fails, and the tens of MB a round this test
guards against fail by far."""


def _prompts() -> list[str]:
    """Twelve prompts of 20-180 characters (tokens: tiny-sdar's vocabulary is bytes), cut from
    standard-library sources, so that prompt lengths and batch mixes vary within a round."""
    src = "".join(inspect.getsource(m) for m in (json, textwrap, inspect))
    return [src[i * 997 : i * 997 + 20 + (i * 37) % 160] for i in range(12)]


BODIES = [
    {"prompt": p, "max_tokens": (32, 48, 64)[i % 3], "steps": (4, 8)[i % 2]}
    for i, p in enumerate(_prompts())
]


def _rss_mb() -> float:
    """Resident memory of this process after a full collection and, with glibc, a heap trim: the
    allocator otherwise keeps freed memory in its arenas by amounts that differ from round to
    round, which is noise here, not memory held."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _held(s: LiveServer) -> dict[str, int]:
    """What the server holds for requests: every entry must be 0 when it is idle."""
    loop = s.state.engine_loop
    eng = loop.engine
    usage = eng.usage()
    held = {
        "cpu pages": usage.cpu_pages_used,
        "gpu slots": usage.gpu_slots_used,
        "slot map": eng.kv.num_slots_used,
        "waiting": eng.num_waiting,
        "running": eng.num_running,
        "prefilling": int(eng.scheduler.prefilling is not None),
        "batch rows": int(eng.batch.tokens.shape[0]),
        "batch top logprobs": len(eng.batch._top),
        "live handles": len(loop._live),
    }
    if isinstance(eng, OffloadEngine):
        held.update({
            "page lists": len(eng.cpu_pool._pages),
            "selected rows": len(eng.k_sel),
            "last blocks": len(eng.last_len),
            "prompt store": int(eng.prompt.request is not None or bool(eng.prompt.tk)),
            "selection job": int(getattr(eng.policy, "_job", None) is not None),
        })  # fmt: skip
    return held


def _wait_idle(s: LiveServer) -> dict[str, int]:
    """The state once the engine thread has handed back the last finished handle (the replies
    can reach the clients just before it does); a bound, not a pace."""
    deadline = time.monotonic() + 120
    while any(_held(s).values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _held(s)


def _round(s: LiveServer) -> None:
    def one(body: dict[str, Any]) -> None:
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(one, BODIES))


def _soak(s: LiveServer) -> list[float]:
    """Run the rounds, check the idle state after each; the RSS after each measured round."""
    rss: list[float] = []
    warm_stagings: dict[str, int] = {}
    for r in range(WARMUP_ROUNDS + MEASURED_ROUNDS):
        _round(s)
        held = _wait_idle(s)
        assert not any(held.values()), f"round {r}: {held}"
        eng = s.state.engine_loop.engine
        # The offloading engine's gather staging grows to the largest batch, then is reused.
        stagings = {k: v.numel for k, v in getattr(eng, "_stagings", {}).items()}
        if r < WARMUP_ROUNDS:
            warm_stagings = stagings
            continue
        assert stagings == warm_stagings, f"round {r}: the staging buffers changed"
        rss.append(_rss_mb())
    return rss


@pytest.fixture(scope="module")
def herald_server() -> Iterator[LiveServer]:
    s = start_server(dtype=torch.bfloat16, mode="herald", max_batch_size=4, max_waiting=64)
    yield s
    s.close()


@pytest.mark.slow
def test_herald_rounds_return_to_idle_and_plateau(herald_server: LiveServer) -> None:
    rss = _soak(herald_server)
    print("herald RSS after each measured round (MB):", [round(x, 1) for x in rss])
    assert rss[-1] - rss[0] <= RSS_MARGIN_MB, rss


@pytest.mark.slow
def test_dense_rounds_return_to_idle_and_plateau() -> None:
    s = start_server(max_batch_size=4, max_waiting=64)
    try:
        rss = _soak(s)
    finally:
        s.close()
    print("dense RSS after each measured round (MB):", [round(x, 1) for x in rss])
    assert rss[-1] - rss[0] <= RSS_MARGIN_MB, rss


_CACHE_PROBE = """
import os, herald, torch
w = torch.zeros(64, 32, dtype=torch.bfloat16)
for _ in range(2):
    for m in range(1, 81):
        torch.nn.functional.linear(torch.zeros(m, 32, dtype=torch.bfloat16), w)
print("capacities", *(os.environ.get(v, "unset") for v in herald.onednn.VARIABLES))
"""


def test_importing_herald_bounds_the_onednn_primitive_caches() -> None:
    """A fresh process that imports herald has both cache capacities set, and oneDNN's cache
    holds at most :data:`herald.onednn.CAPACITY` shapes: the second pass over 80 matmul shapes
    misses every one again (with the default capacity, 1024, it would hit them all). Counted
    from oneDNN's creation log, not timed."""
    env = {k: v for k, v in os.environ.items() if k not in onednn.VARIABLES}
    env["ONEDNN_VERBOSE"] = "profile_create"
    out = subprocess.run(
        [sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
        check=True, cwd=Path(__file__).resolve().parents[2],
    ).stdout.splitlines()  # fmt: skip
    assert out[-1] == f"capacities {onednn.CAPACITY} {onednn.CAPACITY}"
    created = [line for line in out if ",create:cache_" in line]
    if not created:
        pytest.skip("bf16 matmuls do not go through oneDNN here")
    misses = sum(",create:cache_miss," in line for line in created)
    assert onednn.CAPACITY < 75 < len(created) // 2  # (1 or 2 rows take another path)
    assert misses == len(created)
