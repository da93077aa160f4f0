"""Building an engine: one entry point for the CLI, the server and the benchmarks.

:func:`build_engine` returns the engine an :class:`~herald.config.EngineConfig` describes (the
dense engine when ``offload`` is None, else the offloading engine with the policy of
``offload.mode``); :func:`offload_for_mode` turns a mode name into its switches. Callers then use
only the :class:`~herald.engine.base.Engine` interface.
"""

from __future__ import annotations

from herald.config import OFFLOAD_MODES, EngineConfig, OffloadConfig
from herald.engine.base import Engine
from herald.engine.dense import DenseEngine
from herald.engine.hooks import EngineHooks
from herald.kv.cpu_pool import CpuKVPool
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig
from herald.offload.engine import OffloadEngine

MODES = ("dense", *OFFLOAD_MODES)
"""Engine modes: ``dense``, or an offloading mode (:data:`herald.config.OFFLOAD_MODES`)."""


def offload_for_mode(mode: str, **overrides: object) -> OffloadConfig | None:
    """None for ``dense`` (then no override is allowed), else
    ``OffloadConfig.for_mode(mode, **overrides)``. ValueError for an unknown mode, or offload
    settings given with ``dense``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "dense":
        if overrides:
            names = ", ".join(sorted(overrides))
            raise ValueError(f"{names}: offloading settings apply to offloading modes only")
        return None
    return OffloadConfig.for_mode(mode, **overrides)


def build_engine(
    model: BlockDiffusionLM,
    config: ModelConfig,
    engine_config: EngineConfig,
    hooks: EngineHooks | None = None,
    *,
    cpu_pool: CpuKVPool | None = None,
) -> Engine:
    """The engine of ``engine_config`` over ``model``. ``cpu_pool``: an existing CPU pool for an
    offloading engine (a benchmark shares one); ValueError with the dense engine."""
    if engine_config.offload is None:
        if cpu_pool is not None:
            raise ValueError("a CPU pool is for offloading modes only")
        return DenseEngine(model, config, engine_config, hooks)
    return OffloadEngine(model, config, engine_config, hooks, cpu_pool=cpu_pool)
