"""Fixtures of the server tests (module scope): the main server, a small one with an API key,
the offline reference. What they are built from is in server_kit.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_kit import API_KEY, LiveServer, Offline, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """The main server: 4 running requests at most, so 16 clients exercise the queue."""
    s = start_server(max_batch_size=4, max_waiting=64)
    yield s
    s.close()


@pytest.fixture(scope="module")
def small_server() -> Iterator[LiveServer]:
    """One running request, one waiting at most, an API key."""
    s = start_server(max_batch_size=1, max_waiting=1, api_key=API_KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline() -> Offline:
    return Offline()
