"""Bounded oneDNN primitive caches, so that CPU serving in bf16 reaches a memory plateau.

On the CPU, PyTorch runs bf16 matmuls through oneDNN, which JIT-compiles one primitive per
distinct problem shape and keeps it in two LRU caches of 1024 entries each by default: oneDNN's
own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's, PyTorch's wrapper around it
(``LRU_CACHE_CAPACITY``). A cached shape costs about 0.65 MB of resident memory whatever the
matrix sizes (measured with PyTorch 2.13 on an AVX-512 BF16 CPU, weights from 64 x 64 to
4096 x 4096).

A server meets new shapes for a long time: the logits are computed at the masked positions only
(their number changes from step to step and with the batch), prefill chunks follow the prompts
and the prefill budget, the representative query's rows follow the batch size. With the default
capacities an offloading server on the CPU (bf16) grew by ~30-70 MB of RSS per identical load
round, and would go on until both caches held 1024 shapes (~1.3 GB); the dense engine on the
CPU runs fp32 (MKL, no per-shape cache) and did not grow.

A small capacity costs almost nothing: a primitive is created in ~0.5 ms, and the shapes that
repeat (every layer of a forward shares the same few, consecutive steps share a batch) stay in
the cache. Replaying the matmul shapes of three recorded load rounds (~130 s, ~20,000 matmuls,
327 shapes) through an LRU of :data:`CAPACITY` entries gives ~420 more creations than an
unbounded cache, ~0.2 s (~0.15%), and bounds the memory to ~2 x 64 x 0.65 MB.

Both capacities are read once, at the process's first oneDNN call, and cannot be changed later
from Python: :func:`bound_primitive_caches` runs when ``herald`` is imported (before it can
build a model); a program that runs CPU bf16 matmuls before importing herald keeps the defaults.
A capacity set in the environment is kept.

On a CPU without bf16 matmul instructions the model's projections run in float32 by default
(:mod:`herald.layers.linear`, MKL, no per-shape cache), so these caches matter where the CPU has
them or under ``HERALD_CPU_MATMUL=native``.
"""

from __future__ import annotations

import os

CAPACITY = 64
"""Entries per cache (each of the two), unless the environment sets one."""

VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's and ideep's capacity variables."""


def bound_primitive_caches(capacity: int = CAPACITY) -> None:
    """Set each of :data:`VARIABLES` to ``capacity`` unless it is already set."""
    for name in VARIABLES:
        os.environ.setdefault(name, str(capacity))
