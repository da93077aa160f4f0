"""The selection kernel's thread-count rule (herald.env.selection_threads)."""

from __future__ import annotations

import os

import pytest

from herald import env


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_default_is_every_usable_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERALD_SELECTION_THREADS", raising=False)
    for n in (1, 2, 16):
        _cores(monkeypatch, n)
        assert env.usable_cpus() == n
        assert env.selection_threads() == n


def test_environment_and_argument_override_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 16)
    monkeypatch.setenv("HERALD_SELECTION_THREADS", "5")
    assert env.selection_threads() == 5
    assert env.selection_threads(3) == 3  # an explicit count wins over the variable


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_requested_count_raises(bad: object) -> None:
    with pytest.raises(ValueError, match="positive int"):
        env.selection_threads(bad)  # type: ignore[arg-type]


def test_bad_environment_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="HERALD_SELECTION_THREADS"):
        monkeypatch.setenv("HERALD_SELECTION_THREADS", "0")
