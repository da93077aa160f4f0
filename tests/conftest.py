"""Suite-wide test settings."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``) each worker takes its share of the cores for torch's
    intra-op threads, so N workers do not oversubscribe the machine (OpenMP threads spin)."""
    from herald.env import usable_cpus

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, usable_cpus() // workers))


@pytest.fixture(autouse=True, scope="session")
def _batch_invariant_cpu_matmul():
    """Run CPU matmuls through ATen's own GEMM, not oneDNN.

    Many tests compare engines token for token (offloading at budget 1.0 against dense, chunked
    against whole-prompt prefill, one batch composition against another). That needs a row's
    result not to depend on how many other rows share its matmul. oneDNN's bf16 GEMM picks its
    kernel by problem size on some CPUs (seen on an AMD EPYC with AVX512-BF16, torch 2.13.0: a
    prompt prefilled in 32-token chunks decoded other tokens than the whole prompt), so the
    comparisons would test the CPU's GEMM blocking, not the engines. GPU tests are unaffected.
    """
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before


@pytest.fixture(autouse=True)
def _close_engines_left_open():
    """Close what :func:`helpers.make_engine` built and the test left open (a failed check)."""
    from helpers import OPEN_ENGINES

    yield
    while OPEN_ENGINES:
        OPEN_ENGINES.pop().close()


@pytest.fixture(autouse=True)
def _fresh_env_settings():
    """Every test starts from this process's real ``HERALD_*`` switches (``herald.env`` parses
    them once; a test that sets one calls ``reload_settings()`` after ``monkeypatch.setenv``)."""
    from herald.env import reload_settings

    reload_settings()
    yield


class _EnvAwareMonkeyPatch:
    """``monkeypatch`` whose ``setenv`` / ``delenv`` re-parse ``herald.env``'s settings, so a
    test that sets a ``HERALD_*`` switch runs with it (the library parses them once)."""

    def __init__(self, inner: pytest.MonkeyPatch) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        from herald.env import reload_settings

        self._inner.setenv(name, value, prepend)
        reload_settings()

    def delenv(self, name: str, raising: bool = True) -> None:
        from herald.env import reload_settings

        self._inner.delenv(name, raising)
        reload_settings()


@pytest.fixture
def monkeypatch(monkeypatch: pytest.MonkeyPatch):  # noqa: F811 - wraps pytest's own
    return _EnvAwareMonkeyPatch(monkeypatch)
