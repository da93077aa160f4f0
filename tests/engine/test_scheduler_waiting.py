"""The scheduler's ``max_waiting`` bound while a step is under way: requests that join the batch
at a boundary take their slots at once, so a burst that arrives during the step is refused past
the free slots plus ``max_waiting`` (it once got up to ``max_batch_size`` more in)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from herald.engine.scheduler import QueueFullError, Scheduler


class _KV:
    """Room for everything: only the scheduler's counting is under test."""

    def check_fits(self, prompt_len: int, max_new: int) -> None: ...

    def can_admit(self, prompt_len: int, max_new: int) -> bool:
        return True

    def admit(self, request_id: str, prompt_len: int, max_new: int) -> None: ...

    def free(self, request_id: str) -> None: ...


def _request(i: int) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=f"r{i}",
        prompt_len=64,
        params=SimpleNamespace(max_new_tokens=32),
        layout=SimpleNamespace(num_prefill_tokens=64),
    )


def test_requests_joining_at_a_boundary_take_their_slots_at_once() -> None:
    kv: Any = _KV()
    sched = Scheduler(kv, block_size=32, max_batch_size=2, max_prefill_tokens=None, max_waiting=2)
    for i in range(4):  # two for the free slots, two waiting
        sched.add(_request(i))  # type: ignore[arg-type]
    with pytest.raises(QueueFullError):
        sched.add(_request(4))  # type: ignore[arg-type]
    chunks = sched.schedule(num_running=0)  # the boundary: r0 and r1 prefill and join
    assert [c.request.request_id for c in chunks] == ["r0", "r1"] and sched.num_waiting == 2
    # still inside the step (set_num_running not yet called): no slot is free
    with pytest.raises(QueueFullError):
        sched.add(_request(5))  # type: ignore[arg-type]
    sched.set_num_running(1)  # the step ended with one of them finished: one slot free
    sched.add(_request(6))  # type: ignore[arg-type]
    with pytest.raises(QueueFullError):
        sched.add(_request(7))  # type: ignore[arg-type]
