"""Kernel fusion for the small element-wise functions of a forward (GPU only).

A long-context denoising forward spends a third of its GPU time outside GEMMs and attention, in
dozens of tiny element-wise kernels (RMSNorm's five, RoPE's eight, the MoE router and combine).
:func:`cuda_compiled` runs such a pure function through ``torch.compile`` (Inductor fuses it into
one or a few Triton kernels) when its first argument is a CUDA tensor, and calls it eagerly
otherwise: CPU runs, tests and CI never compile. The math is the function's own, op for op.

Set ``HERALD_COMPILE=0`` to disable. NOTE: the first call with a new shape compiles; engines make
that happen in an eager warm-up forward, never inside CUDA-graph capture.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from herald.env import settings

F = TypeVar("F", bound=Callable[..., Any])

_RECOMPILE_LIMIT = 64
_local = threading.local()


def run_eagerly_in_this_thread() -> None:
    """Never compile in the calling thread (its calls run the eager functions). The retrieval
    worker calls it: Dynamo is not thread-safe, so only the thread that steps the engine (the
    main thread of a benchmark, the server's engine thread) compiles."""
    _local.eager = True


def compile_enabled() -> bool:
    """``HERALD_COMPILE`` (:mod:`herald.env`) is not ``0``."""
    return settings().compile


def cuda_compiled(fn: F) -> F:
    """Decorator: ``torch.compile(fn)`` for CUDA inputs (first argument), ``fn`` otherwise."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        first = args[0]
        if not (isinstance(first, torch.Tensor) and first.is_cuda and compile_enabled()):
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling() or getattr(_local, "eager", False):
            # Dynamo is not thread-safe: the retrieval worker thread runs the eager function
            # (its single-token forwards are tiny); the engine's thread compiles.
            return fn(*args, **kwargs)
        if compiled is None:
            # Each model config (dims, eps, expert counts) and dtype is its own specialisation;
            # a process that builds many models (tests) needs more than the default 8. Past the
            # limit Dynamo runs the function eagerly instead of failing (no fullgraph=True).
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return cast(F, wrapper)
