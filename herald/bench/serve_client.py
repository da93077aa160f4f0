"""The client side of ``herald bench serve``: one load level through the official ``openai``
client, and its statistics.

A level sends its prompts (token ids) as streaming completions, at most ``concurrency`` in
flight at once, in order; after ``duration_limit_s`` every request still running or not yet sent
is cancelled (its connection closed, which aborts it in the server) and counted as cancelled.
Each request records the time to its first chunk with tokens, the times between its chunks with
tokens (a herald stream sends one per committed block) and, when it completes, its end-to-end
latency; its generated tokens are the ``token_ids`` its chunks carry (herald's extension), else
the usage the server reports. The server's own counters (``/metrics``) read before and after a
level give its engine's prefill and decode seconds and tokens over the level
(:func:`engine_deltas`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Plain HTTP to the server, never through a proxy the environment names."""

ENGINE_COUNTERS = {
    "engine_prefill_s": "herald_prefill_seconds_total",
    "engine_decode_s": "herald_decode_seconds_total",
    "engine_prompt_tokens": "herald_prompt_tokens_total",
    "engine_generated_tokens": "herald_generated_tokens_total",
}
"""Level record field -> the server counter (``/metrics``) whose increase over the level it is."""


@dataclass(frozen=True)
class LoadSettings:
    """What every request of a level asks for."""

    model: str
    max_tokens: int
    steps: int | None
    """Denoising steps per block (herald's ``steps`` field), None: not sent."""
    ignore_eos: bool
    duration_limit_s: float
    api_key: str | None = None

    def extra_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"ignore_eos": True} if self.ignore_eos else {}
        if self.steps is not None:
            body["steps"] = self.steps
        return body


@dataclass
class Outcome:
    """One request: ``status`` completed, failed or cancelled (the limit came first)."""

    status: str = "cancelled"
    started: bool = False
    first_chunk_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    tokens: int = 0
    chunks: int = 0
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    error: str | None = None


async def _stream(client: Any, ids: list[int], s: LoadSettings, o: Outcome) -> None:
    o.started = True
    t0 = last = time.perf_counter()
    try:
        # NOTE: the ids go in ``extra_body``, which the client merges into the JSON body as it
        # is: given as ``prompt=``, the openai package checks every element against the
        # parameter's type annotations in Python, on the event loop (2.9 s for 32K ids on a
        # loaded 2-core box, against 0.06 s this way), which counted as the server's time to
        # first chunk and held every other stream of the level meanwhile. The body sent is the
        # same.
        stream = await client.completions.create(
            model=s.model, prompt=[], max_tokens=s.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={**s.extra_body(), "prompt": ids},
        )  # fmt: skip
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    o.usage_completion_tokens = chunk.usage.completion_tokens
                    o.usage_prompt_tokens = chunk.usage.prompt_tokens
                got = [getattr(c, "token_ids", None) for c in chunk.choices]
                n = sum(len(x or ()) for x in got)
                # a chunk of a block carries its tokens; a server without token_ids, its text
                # (herald's last chunk may carry text held back at the end, and no tokens)
                if n or (all(x is None for x in got) and any(c.text for c in chunk.choices)):
                    if o.first_chunk_s is None:
                        o.first_chunk_s = now - t0
                    else:
                        o.gaps_s.append(now - last)
                    last = now
                    o.tokens += n
                    o.chunks += 1
        o.latency_s = time.perf_counter() - t0
        if not o.tokens and o.usage_completion_tokens:
            o.tokens = o.usage_completion_tokens  # a server without the token_ids extension
        o.status = "completed"
    except asyncio.CancelledError:
        raise  # the limit: status stays "cancelled"
    except Exception as e:  # noqa: BLE001  (an HTTP or API error: the request failed)
        o.status, o.error = "failed", f"{type(e).__name__}: {str(e)[:200]}"


async def run_level(
    url: str, prompts: list[list[int]], concurrency: int, s: LoadSettings
) -> tuple[list[Outcome], float]:
    """Send ``prompts`` at ``concurrency``; the outcomes in prompt order and the level's wall
    time (to the last request's end, or to the limit)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{url}/v1", api_key=s.api_key or "unused", max_retries=0,
        timeout=s.duration_limit_s + 60,
    )  # fmt: skip
    outcomes = [Outcome() for _ in prompts]
    gate = asyncio.Semaphore(concurrency)  # FIFO: requests are sent in prompt order

    async def one(i: int) -> None:
        async with gate:
            await _stream(client, prompts[i], s, outcomes[i])

    try:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        _, pending = await asyncio.wait(tasks, timeout=s.duration_limit_s)
        wall = time.perf_counter() - t0
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await client.close()
    return outcomes, wall


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 of ``xs`` (linear between order statistics; None when empty) and the
    mean."""
    out: dict[str, float | None] = {}
    if not xs:
        return out | {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    s = sorted(xs)
    for q in PERCENTILES:
        pos = q / 100 * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out[f"p{q}"] = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    out["mean"] = sum(s) / len(s)
    return out


def summarize(outcomes: list[Outcome], wall: float, prompt_tokens: int) -> dict[str, Any]:
    """A level's counts, rates and percentiles. Generated tokens count every token received,
    cancelled requests' included; prompt tokens count the prompts the server prefilled (those
    whose first chunk arrived); both rates are over the level's wall time.
    ``latency_by_request_s``: each request's latency in the order sent (None: not completed).
    """
    done = [o for o in outcomes if o.status == "completed"]
    prefilled = sum(o.first_chunk_s is not None for o in outcomes)
    generated = sum(o.tokens for o in outcomes)
    errors = sorted({o.error for o in outcomes if o.error})
    return {
        "completed": len(done),
        "failed": sum(o.status == "failed" for o in outcomes),
        "cancelled": sum(o.status == "cancelled" for o in outcomes),
        "cancelled_in_flight": sum(o.status == "cancelled" and o.started for o in outcomes),
        "errors": errors[:5],
        "wall_s": wall,
        "generated_tokens": generated,
        "prefilled_prompt_tokens": prefilled * prompt_tokens,
        "generated_tokens_per_s": generated / wall if wall > 0 else None,
        "prompt_tokens_per_s": prefilled * prompt_tokens / wall if wall > 0 else None,
        "time_to_first_chunk_s": percentiles(
            [o.first_chunk_s for o in outcomes if o.first_chunk_s is not None]
        ),
        "time_between_chunks_s": percentiles([g for o in outcomes for g in o.gaps_s]),
        "latency_s": percentiles([o.latency_s for o in done if o.latency_s is not None]),
        "latency_by_request_s": [
            o.latency_s if o.status == "completed" else None for o in outcomes
        ],  # fmt: skip
        "completion_tokens_per_request": sorted({o.tokens for o in done}),
        "chunks_per_request": sorted({o.chunks for o in done}),
        "prompt_tokens_reported": sorted(
            {o.usage_prompt_tokens for o in outcomes if o.usage_prompt_tokens is not None}
        ),
    }


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of Prometheus text format by name as written, labels included (e.g.
    ``herald_requests_total{outcome="ok"}``); comments, blank lines and lines whose value is
    not a number are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cut = line.rfind("}") + 1 if "{" in line else line.find(" ")
        if cut <= 0:
            continue
        name, rest = line[:cut].strip(), line[cut:].split()
        if not rest:
            continue
        try:
            out[name] = float(rest[0])
        except ValueError:
            continue
    return out


def server_metrics(url: str) -> dict[str, float] | None:
    """The samples of the ``/metrics`` of the server at ``url`` (:func:`parse_metrics`), None
    when it cannot be read."""
    try:
        with _OPENER.open(f"{url}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())
    except (OSError, UnicodeDecodeError):
        return None


def metrics_after(
    url: str, before: dict[str, float] | None, generated_tokens: int, timeout_s: float = 2.0
) -> dict[str, float] | None:
    """The server's samples after a level (:func:`server_metrics`), read again for at most
    ``timeout_s`` until its generated-token counter has grown since ``before`` by at least the
    ``generated_tokens`` the clients received (the engine thread counts a step's tokens just
    after pushing them); the last read when it has not, or when there is nothing to compare."""
    name = ENGINE_COUNTERS["engine_generated_tokens"]
    deadline = time.monotonic() + timeout_s
    while True:
        after = server_metrics(url)
        if after is None or before is None or name not in after or name not in before:
            return after
        if after[name] - before[name] >= generated_tokens or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def counter_deltas(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """The increase over a level of every ``herald_*`` counter and histogram sum / count the
    server reports (block stream times, step times, batch rows, latencies: what a level's time
    went to), None when a scrape failed; samples that went down are left out."""
    if before is None or after is None:
        return None
    return {
        name: after[name] - before.get(name, 0.0)
        for name in sorted(after)
        if name.startswith("herald_")
        and name.endswith(("_total", "_sum", "_count"))
        and after[name] >= before.get(name, 0.0)
    }


def engine_deltas(
    before: dict[str, float] | None, after: dict[str, float] | None, generated_tokens: int,
    wall_s: float,
) -> dict[str, Any]:  # fmt: skip
    """A level's engine figures from the server's samples ``before`` and ``after`` it: each
    :data:`ENGINE_COUNTERS` field is its counter's increase (tokens as int), None when a scrape
    failed, the counter is missing or it went down (the server started again); and
    ``served_tokens_per_s``, the decode-only served rate: ``generated_tokens`` (received by the
    clients) over ``wall_s`` less the engine's prefill seconds (None without them, or when they
    leave no time)."""
    out: dict[str, Any] = {}
    for field_name, metric in ENGINE_COUNTERS.items():
        a = None if before is None else before.get(metric)
        b = None if after is None else after.get(metric)
        delta = None if a is None or b is None or b < a else b - a
        if delta is not None and field_name.endswith("_tokens"):
            delta = round(delta)
        out[field_name] = delta
    out["server_deltas"] = counter_deltas(before, after)
    prefill = out["engine_prefill_s"]
    decode_wall = None if prefill is None else wall_s - prefill
    out["served_tokens_per_s"] = (
        generated_tokens / decode_wall if decode_wall is not None and decode_wall > 0 else None
    )
    return out


def server_idle(url: str, timeout_s: float = 60.0) -> bool | None:
    """Wait until the server at ``url`` runs and queues no request (its ``/metrics`` gauges),
    at most ``timeout_s``: True when idle, False when still busy, None when it has no such
    gauges."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = server_metrics(url)
        if samples is None:
            return None
        names = ("herald_requests_running", "herald_requests_waiting")
        gauges = {n: samples[n] for n in names if n in samples}
        if len(gauges) < 2:
            return None
        if not any(gauges.values()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def server_card(url: str, api_key: str | None) -> dict[str, Any]:
    """The first model ``/v1/models`` of the server at ``url`` lists (id, max_model_len and
    herald's mode, kv_budget, block_size where it reports them). Raises OSError when there is
    none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(f"{url}/v1/models", headers=headers)
    try:
        with _OPENER.open(req, timeout=30) as r:
            card: dict[str, Any] = json.loads(r.read())["data"][0]
    except (OSError, KeyError, IndexError, ValueError) as e:
        raise OSError(f"no model list from {url}/v1/models ({type(e).__name__}: {e})") from None
    return card
