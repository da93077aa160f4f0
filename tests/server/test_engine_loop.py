"""Admission (the scheduler, as the server drives it) and failure handling of the engine loop,
driven directly (no HTTP, tiny-sdar on the CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import make_engine

from herald.config import OffloadConfig, SamplingParams
from herald.engine.request import RequestStatus
from herald.engine.scheduler import QueueFullError
from herald.engine.stats import EngineStats
from herald.kv.manager import RequestTooLarge
from herald.models.loader import load_model
from herald.server.engine_loop import EngineDeadError, EngineLoop
from herald.server.metrics import ServerMetrics

PARAMS = SamplingParams(max_new_tokens=32, num_denoise_steps=2)


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny-sdar", "cpu", torch.bfloat16)


@pytest.fixture
def aloop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _running(reqs: list) -> int:
    return sum(r.status != RequestStatus.WAITING for r in reqs)


def test_prefill_budget_bounds_the_prompt_tokens_of_each_boundary(tiny, aloop) -> None:
    """max_prefill_tokens=70 (B = 32: 64 per boundary): prompts of 32, 32, 192, 0, 0 prefill
    tokens (the tail of a prompt is in its first block) join over the boundaries as the budget
    allows, the long one in chunks, the head never overtaken."""
    model, config, _ = tiny
    engine = make_engine(
        model, config, None, max_batch_size=8, max_seq_len=256, max_prefill_tokens=70,
        use_cuda_graph=False,
    )  # fmt: skip
    loop = EngineLoop(engine)
    hs = [loop.submit([7] * n, PARAMS, aloop) for n in (40, 40, 200, 10, 10)]
    reqs = [h.request for h in hs]
    joined, prefilled = [], []
    for _ in range(5):
        before = engine.stats.num_prefill_tokens
        engine.step()
        joined.append(_running(reqs))
        prefilled.append(engine.stats.num_prefill_tokens - before)
    # 32 + 32 | 64 of 192 | 64 | 64 (budget spent) | 0 + 0
    assert joined == [2, 2, 2, 3, 5]
    assert prefilled == [64, 64, 64, 64, 0]


def test_slots_bound_admission(tiny, aloop) -> None:
    model, config, _ = tiny
    engine = make_engine(model, config, None, max_batch_size=2, max_seq_len=256)
    loop = EngineLoop(engine)
    hs = [loop.submit([7] * 10, PARAMS, aloop) for _ in range(3)]
    engine.step()
    assert [h.request.status for h in hs].count(RequestStatus.RUNNING) == 2
    assert hs[2].request.status == RequestStatus.WAITING and engine.num_waiting == 1


def test_cpu_pool_pages_bound_admission(tiny, aloop) -> None:
    model, config, _ = tiny
    cfg = OffloadConfig.for_mode("herald", kv_budget=1.0, cpu_kv_tokens=8 * 32)
    engine = make_engine(model, config, cfg, max_batch_size=4, max_seq_len=256)
    try:
        loop = EngineLoop(engine)
        # 10 + 32 tokens: 2 blocks + 1 = 3 pages each; the pool holds 8
        hs = [loop.submit([7] * 10, PARAMS, aloop) for _ in range(3)]
        engine.step()
        assert _running([h.request for h in hs]) == 2
        assert engine.usage().cpu_pages_used == 6
        while _running([hs[2].request]) == 0:  # the first two finish and leave: pages come back
            assert engine.has_unfinished()
            engine.step()
        assert all(h.request.status.finished for h in hs[:2])
        while engine.has_unfinished():
            engine.step()
        assert engine.usage().cpu_pages_used == 0
    finally:
        engine.close()


def test_a_request_larger_than_the_cpu_pool_is_refused_at_submit(tiny, aloop) -> None:
    model, config, _ = tiny
    cfg = OffloadConfig.for_mode("herald", kv_budget=1.0, cpu_kv_tokens=8 * 32)
    engine = make_engine(model, config, cfg, max_batch_size=4, max_seq_len=512)
    try:
        loop = EngineLoop(engine)
        with pytest.raises(RequestTooLarge, match="CPU pool holds 8") as err:
            loop.submit([7] * 10, SamplingParams(max_new_tokens=300), aloop)  # 11 pages
        assert err.value.code == "kv_capacity_exceeded"
        small = loop.submit([7] * 10, PARAMS, aloop)
        engine.step()
        assert small.request.status == RequestStatus.RUNNING and engine.num_waiting == 0
    finally:
        engine.close()


def test_waiting_queue_bound(tiny, aloop) -> None:
    """max_waiting counts requests beyond the free slots: 1 slot + 1 waiting, then 503."""
    model, config, _ = tiny
    engine = make_engine(model, config, None, max_batch_size=1, max_seq_len=256, max_waiting=1)
    loop = EngineLoop(engine)
    loop.submit([7] * 10, PARAMS, aloop)
    second = loop.submit([7] * 10, PARAMS, aloop)
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        loop.submit([7] * 10, PARAMS, aloop)
    loop.cancel(second)  # a waiting request leaves at once: room again
    assert second.request.status == RequestStatus.FINISHED_ABORTED
    loop.submit([7] * 10, PARAMS, aloop)


async def _last_item(loop: EngineLoop, ids: list[int]) -> tuple[str, Any]:
    """Submit ``ids`` and return the handle's last item (``done`` or ``error``)."""
    h = loop.submit(ids, PARAMS, asyncio.get_running_loop())
    while True:
        kind, val = await asyncio.wait_for(h.queue.get(), 30)
        if kind != "tokens":
            return kind, val


def _broken() -> None:
    raise RuntimeError("broken")


def test_failing_steps_fail_their_requests_then_the_engine_is_declared_dead(tiny) -> None:
    model, config, tokenizer = tiny
    engine = make_engine(model, config, None, max_batch_size=2, max_seq_len=256)
    loop = EngineLoop(engine, max_step_failures=2)
    real_prefill = engine._prefill
    bad = tokenizer.encode("POISON" * 10)  # >= one block: a prefill runs

    def prefill(chunk: Any) -> None:
        if chunk.request.prompt_ids == bad:
            raise RuntimeError("prefill failed")
        real_prefill(chunk)

    engine._prefill = prefill  # type: ignore[method-assign]

    async def one(ids: list[int]) -> tuple[str, Any]:
        return await _last_item(loop, ids)

    async def go() -> None:
        # A prefill failure fails the request being admitted (and the step's running ones).
        kind, val = await one(bad)
        assert kind == "error" and "prefill failed" in str(val)
        assert engine.usage().gpu_slots_used == 0  # its slot came back
        assert await one(tokenizer.encode("fine")) == ("done", "length")  # the loop goes on
        # Steps that fail without running anything: retried, then the engine is declared dead
        # (after 2 failures in a row here) and what waits fails.
        engine.step = _broken  # type: ignore[method-assign]
        kind, val = await one(tokenizer.encode("a"))
        assert kind == "error" and "broken" in str(val)
        assert loop.dead is not None and not loop.is_alive()
        with pytest.raises(EngineDeadError):
            loop.submit([1], PARAMS, asyncio.get_running_loop())

    loop.start()
    try:
        asyncio.run(go())
    finally:
        loop.stop()


def test_out_of_gpu_memory_in_a_step_says_which_flags_lower_it(tiny, caplog) -> None:
    """The step's request gets the error; the log says what to lower; the loop goes on."""
    model, config, tokenizer = tiny
    engine = make_engine(model, config, None, max_batch_size=2, max_seq_len=256)
    loop = EngineLoop(engine)
    real_prefill, calls = engine._prefill, [0]

    def prefill(chunk: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB.")
        real_prefill(chunk)

    engine._prefill = prefill  # type: ignore[method-assign]

    async def one(ids: list[int]) -> tuple[str, Any]:
        return await _last_item(loop, ids)

    async def go() -> None:
        kind, val = await one(tokenizer.encode("long enough to need a prefill forward" * 2))
        assert kind == "error" and "Tried to allocate 64.00 MiB" in str(val)
        assert await one(tokenizer.encode("fine")) == ("done", "length")

    loop.start()
    try:
        asyncio.run(go())
    finally:
        loop.stop()
    assert "out of GPU memory: the step's requests failed" in caplog.text
    assert "--max-batch-size, --max-seq-len or --max-prefill-tokens" in caplog.text


def test_generation_rate_covers_the_window_and_decays_to_zero_when_idle(tiny) -> None:
    model, config, _ = tiny
    loop = EngineLoop(make_engine(model, config, None, max_batch_size=1, max_seq_len=64))
    assert loop.generation_rate(100.0) == 0.0  # no step yet
    loop._rate_start = 50.0  # the first step began long ago: the rates are over the window
    loop._recent.extend([(100.0, 40), (102.0, 60)])  # two steps ended at t = 100 s and 102 s
    assert loop.generation_rate(104.0) == pytest.approx(100 / 10.0)
    assert loop.generation_rate(111.0) == pytest.approx(60 / 10.0)  # the first left the window
    assert loop.generation_rate(113.0) == 0.0  # idle for longer than the window
    loop._recent_prompt.extend([(100.0, 64), (102.0, 0)])  # the prompt rate: the same window
    assert loop.prompt_rate(104.0) == pytest.approx(64 / 10.0)
    assert loop.prompt_rate(111.0) == 0.0  # the prefill left the window; decode steps only
    assert loop.prompt_rate(113.0) == 0.0
    # a server whose first step began 2 s ago: over those 2 s, not over the whole window
    loop._rate_start, loop._recent = 98.0, type(loop._recent)([(99.0, 30), (100.0, 20)])
    assert loop.generation_rate(100.0) == pytest.approx(50 / 2.0)


def _value(m: ServerMetrics, name: str) -> float:
    v = m.registry.get_sample_value(name)
    assert v is not None, name
    return v


def test_metrics_count_prompt_tokens_engine_seconds_and_request_latencies(tiny, aloop) -> None:
    """Driven step by step: the prompt tokens and prefill / decode seconds are the engine's
    (what it counted before the loop, or before its stats were replaced, is not counted twice);
    each request observes one time to first token, one gap per later block and, unless it was
    aborted, one end-to-end latency."""
    model, config, _ = tiny
    engine = make_engine(model, config, None, max_batch_size=2, max_seq_len=256)
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=2, ignore_eos=True)
    engine.generate([[7] * 40], params)  # counted by the engine before the loop: not by it
    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics=metrics)

    def run(prompts: list[int]) -> list[Any]:
        hs = [loop.submit([7] * n, params, aloop) for n in prompts]
        while engine.has_unfinished():
            engine.step()
            loop._publish(0.01)
        return hs

    before = engine.stats.num_prefill_tokens
    hs = run([40, 72])  # B = 32: 32 + 64 prompt tokens prefilled (the tails in the first block)
    assert all(h.request.status == RequestStatus.FINISHED_LENGTH for h in hs)
    assert engine.stats.num_prefill_tokens - before == 96
    assert _value(metrics, "herald_prompt_tokens_total") == 40 + 72  # whole prompts, as usage
    # every decode forward ran both rows until the first finished (the same length: together)
    forwards = _value(metrics, "herald_decode_forwards_total")
    assert forwards > 0 and _value(metrics, "herald_batch_rows_total") == 2 * forwards
    assert _value(metrics, "herald_generated_tokens_total") == 128
    assert _value(metrics, "herald_prefill_seconds_total") > 0
    assert _value(metrics, "herald_decode_seconds_total") > 0
    assert _value(metrics, "herald_prefill_tokens_per_second") > 0
    assert _value(metrics, "herald_time_to_first_token_seconds_count") == 2
    assert _value(metrics, "herald_time_to_first_token_seconds_sum") > 0
    # a prompt's tail shares its first block: 24 + 32 + 8 tokens, three pushes, two gaps each
    assert _value(metrics, "herald_time_per_output_block_seconds_count") == 4
    assert _value(metrics, "herald_e2e_request_latency_seconds_count") == 2
    assert _value(metrics, "herald_e2e_request_latency_seconds_sum") > 0
    decode = _value(metrics, "herald_decode_seconds_total")

    engine.stats = EngineStats()  # the engine's counters start again (as after a warm-up)
    aborted = loop.submit([7] * 10, params, aloop)
    loop.cancel(aborted)  # still waiting: it leaves at once, no latency observed
    # 170 prompt tokens: more than the old stats had when replaced (40 + 40 + 72), all new
    run([170])
    assert aborted.request.status == RequestStatus.FINISHED_ABORTED
    assert _value(metrics, "herald_prompt_tokens_total") == 40 + 72 + 170
    assert _value(metrics, "herald_decode_seconds_total") > decode
    assert _value(metrics, "herald_time_to_first_token_seconds_count") == 3
    assert _value(metrics, "herald_time_per_output_block_seconds_count") == 6  # 22 + 32 + 10
    assert _value(metrics, "herald_e2e_request_latency_seconds_count") == 3
    text = metrics.render().decode()
    assert 'herald_e2e_request_latency_seconds_bucket{le="120.0"} 3.0' in text
