"""EngineLoop admission and failure handling, driven directly (no HTTP, tiny-sdar on the CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from herald.config import OffloadConfig, SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.offload import OffloadEngine
from herald.models.loader import load_model
from herald.server.engine_loop import EngineDeadError, EngineLoop, Handle

PARAMS = SamplingParams(max_new_tokens=32, num_denoise_steps=2)


@pytest.fixture(scope="module")
def tiny() -> Any:
    return load_model("tiny-sdar", "cpu", torch.bfloat16)


@pytest.fixture
def aloop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _submit(loop: EngineLoop, aloop: asyncio.AbstractEventLoop, lengths: list[int]) -> list:
    handles = [loop.submit([7] * n, PARAMS, aloop) for n in lengths]
    loop._drain(block=False)  # the engine thread's side, run here (the thread is not started)
    return handles


def _handed(h: Handle) -> bool:
    return h.request is not None


def test_prefill_budget_admits_a_bounded_chunk_per_boundary(tiny, aloop) -> None:
    model, config, _ = tiny
    engine = DenseEngine(model, config, max_batch_size=8, max_seq_len=256, use_cuda_graph=False)
    loop = EngineLoop(engine, max_prefill_tokens=40)
    hs = _submit(loop, aloop, [30, 30, 100, 5, 5])
    admitted = []
    for _ in range(4):
        loop._feed()
        engine.step()  # admits what was handed over
        admitted.append(sum(map(_handed, hs)))
    # 30 | 30 | 100 (alone: longer than the budget) | 5 + 5
    assert admitted == [1, 2, 3, 5]


def test_slots_bound_what_is_handed_over(tiny, aloop) -> None:
    model, config, _ = tiny
    engine = DenseEngine(model, config, max_batch_size=2, max_seq_len=256, use_cuda_graph=False)
    loop = EngineLoop(engine)
    hs = _submit(loop, aloop, [10, 10, 10])
    loop._feed()
    assert [_handed(h) for h in hs] == [True, True, False]
    engine.step()
    loop._feed()
    assert not _handed(hs[2]) and len(engine.batch) == 2


def test_cpu_pool_pages_bound_what_is_handed_over(tiny, aloop) -> None:
    model, config, _ = tiny
    cfg = OffloadConfig.for_mode("herald", kv_budget=1.0, cpu_kv_tokens=8 * 32)
    engine = OffloadEngine(model, config, cfg, max_batch_size=4, max_seq_len=256)
    try:
        loop = EngineLoop(engine)
        hs = _submit(loop, aloop, [10, 10, 10])  # 10 + 32 tokens: 2 blocks + 1 = 3 pages each
        loop._feed()
        assert [_handed(h) for h in hs] == [True, True, False]  # 6 of 8 pages promised
        engine.step()
        assert engine.cpu_pool.num_used_pages == 6
        loop._feed()
        assert not _handed(hs[2])
        while engine.has_unfinished():  # the first two finish and leave: pages come back
            engine.step()
            loop._feed()
        assert _handed(hs[2])
    finally:
        engine.close()


def _broken() -> None:
    raise RuntimeError("broken")


def test_failing_steps_fail_their_requests_then_the_engine_is_declared_dead(tiny) -> None:
    model, config, tokenizer = tiny
    engine = DenseEngine(model, config, max_batch_size=2, max_seq_len=256, use_cuda_graph=False)
    loop = EngineLoop(engine, max_step_failures=2)
    real_prefill = engine._prefill
    bad = tokenizer.encode("POISON" * 10)  # >= one block: a prefill runs

    def prefill(req: Any, slot: int, *span: int) -> None:
        if req.prompt_ids == bad:
            raise RuntimeError("prefill failed")
        real_prefill(req, slot, *span)

    engine._prefill = prefill  # type: ignore[method-assign]

    async def one(ids: list[int]) -> tuple[str, Any]:
        h = loop.submit(ids, PARAMS, asyncio.get_running_loop())
        while True:
            kind, val = await asyncio.wait_for(h.queue.get(), 30)
            if kind != "tokens":
                return kind, val

    async def go() -> None:
        # A prefill failure fails the request being admitted, and the step's running requests.
        kind, val = await one(bad)
        assert kind == "error" and "prefill failed" in str(val)
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


def test_a_request_larger_than_the_cpu_pool_never_blocks_the_queue(tiny, aloop) -> None:
    model, config, _ = tiny
    cfg = OffloadConfig.for_mode("herald", kv_budget=1.0, cpu_kv_tokens=8 * 32)
    engine = OffloadEngine(model, config, cfg, max_batch_size=4, max_seq_len=512)
    try:
        loop = EngineLoop(engine)
        big = loop.submit([7] * 10, SamplingParams(max_new_tokens=300), aloop)  # 11 pages
        (small,) = _submit(loop, aloop, [10])
        loop._feed()
        assert big.request is None and _handed(small)
        aloop.run_until_complete(asyncio.sleep(0))  # deliver the pushed items
        kind, _ = big.queue.get_nowait()
        assert kind == "rejected"
    finally:
        engine.close()
