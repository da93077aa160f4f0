"""KVManager slot bookkeeping: joins, leaves, and prompts admitted between them."""

from __future__ import annotations

import pytest

from herald.kv.manager import KVManager


class Store:
    """A slot store that records its moves and what each slot holds."""

    def __init__(self, n: int) -> None:
        self.holds: list[str | None] = [None] * n
        self.moves: list[tuple[int, int]] = []

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.moves.append((src, dst))
        self.holds[dst] = self.holds[src]


def test_a_joiner_takes_its_row_from_a_prompt_admitted_after_it() -> None:
    """Slots 0-2. A and B run; C prefills into slot 2; A leaves (B moves to 0); D is admitted at
    the boundary where C's last chunk runs and takes the lowest free slot, 1: the row C joins.
    C still joins as row 1 and D (nothing prefilled yet) takes slot 2."""
    kv = KVManager(3, 32, prefill_in_slot=True)
    store = Store(3)
    kv.add_store(store)
    for rid, row in (("A", 0), ("B", 1)):
        assert kv.admit(rid, 10, 10) == row
        store.holds[row] = rid
        kv.join(rid, row, 0)
    assert kv.admit("C", 10, 10) == 2
    store.holds[2] = "C"
    assert kv.release([("A", 0), ("B", 0)], [0]) == [(1, 0)]
    assert kv.admit("D", 10, 10) == 1  # before C joins: the scheduler runs ahead of the engine
    assert kv.join("C", 1, 0) == 1
    assert (kv.slot("B"), kv.slot("C"), kv.slot("D")) == (0, 1, 2)
    assert store.holds[:2] == ["B", "C"] and store.moves[-1] == (2, 1)


def test_a_row_held_by_a_running_request_is_an_error() -> None:
    kv = KVManager(2, 32, prefill_in_slot=True)
    kv.add_store(Store(2))
    kv.admit("A", 10, 10)
    kv.join("A", 0, 0)
    kv.admit("B", 10, 10)
    with pytest.raises(RuntimeError, match="slot 0 is taken"):
        kv.join("B", 0, 0)
