"""The engine behind a server: which one a mode builds, what a request needs of it, its usage.

One server runs one engine, chosen at launch: ``dense`` (:class:`DenseEngine`, the full KV on the
model's device) or an offloading mode, ``herald`` / ``mage`` / ``infinigen``
(:class:`OffloadEngine`, the full KV in a CPU pool, a GPU sparse pool per slot). The HTTP side
asks here whether a request can ever fit (:func:`check_fits`, a 400 before it queues) and reads
pool usage for ``/metrics`` (:func:`pool_usage`); the engine thread asks which waiting requests it
may hand over now (:func:`cpu_pages_free`, :func:`cpu_pages_needed`). Only the public attributes of
the engines are read: ``config``, ``max_seq_len``, ``max_batch_size``, ``batch``, ``cpu_pool``,
``pool``, ``cache``, ``offload``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from herald.config import OffloadConfig, SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.offload import OffloadEngine
from herald.engine.request import new_request
from herald.kv.dense_cache import DEFAULT_KV_PAD
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig

Engine = DenseEngine | OffloadEngine

MODES = ("dense", "herald", "mage", "infinigen")
"""What ``herald serve --mode`` accepts: dense, or one of :meth:`OffloadConfig.for_mode`'s."""


class RequestTooLarge(ValueError):
    """A request this server can never run (HTTP 400), with the OpenAI error's param and code."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def build_engine(
    mode: str,
    model: BlockDiffusionLM,
    config: ModelConfig,
    *,
    max_batch_size: int,
    max_seq_len: int,
    offload: OffloadConfig | None = None,
    max_prefill_tokens: int | None = None,
    kv_pad: int = DEFAULT_KV_PAD,
) -> Engine:
    """The engine of ``mode``; ``offload`` (offloading modes only, default
    ``OffloadConfig.for_mode(mode)``) carries the budget and CPU pool size;
    ``max_prefill_tokens``: prompt tokens the engine prefills per step / block boundary at most
    (a longer prompt is prefilled over several); ``kv_pad``: see
    :class:`~herald.kv.dense_cache.SlotAttention` (512: batch-invariant outputs).

    Raises ValueError for an unknown mode or an offload config given with ``dense``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "dense":
        if offload is not None:
            raise ValueError("--kv-budget and the CPU pool options apply to offloading modes only")
        return DenseEngine(
            model, config, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
            max_prefill_tokens=max_prefill_tokens, kv_pad=kv_pad, use_cuda_graph=False,
        )  # fmt: skip
    offload = offload or OffloadConfig.for_mode(mode)
    return OffloadEngine(
        model, config, offload, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
        max_prefill_tokens=max_prefill_tokens, kv_pad=kv_pad, use_cuda_graph=False,
    )  # fmt: skip


def kv_budget(engine: Engine) -> float:
    """Fraction of the prefix each block attends to (1.0 for dense)."""
    return engine.offload.kv_budget if isinstance(engine, OffloadEngine) else 1.0


def cpu_pages_needed(engine: OffloadEngine, prompt_len: int, max_new_tokens: int) -> int:
    """CPU pool pages a request holds while it runs (:meth:`OffloadEngine.pages_needed`)."""
    return engine.pages_needed(prompt_len, max_new_tokens)


def check_fits(engine: Engine, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """Raise :class:`RequestTooLarge` if the request can never run here: prompt +
    ``max_tokens`` beyond the engine's ``max_seq_len`` (whole blocks), ids outside the vocabulary
    (ValueError from :func:`new_request`), or more CPU pool pages than the whole pool holds.

    Thread-safe: reads only what the engine fixed at construction.
    """
    try:
        req = new_request(
            list(prompt_ids), params, engine.config.block_size, engine.max_seq_len,
            engine.config.vocab_size,
        )  # fmt: skip
    except ValueError as e:
        raise RequestTooLarge(str(e), param="max_tokens", code="context_length_exceeded") from e
    if isinstance(engine, OffloadEngine):
        need = cpu_pages_needed(engine, req.prompt_len, params.max_new_tokens)
        total = engine.cpu_pool.num_pages
        if need > total:
            b = engine.block_size
            raise RequestTooLarge(
                f"the request needs {need} CPU KV pages ({need * b} tokens: prompt + max_tokens "
                f"in blocks of {b}, plus one) but this server's CPU pool holds {total} pages in "
                "all; lower max_tokens or the prompt, or restart the server with a larger "
                "--cpu-kv-gb / --cpu-kv-tokens",
                param="max_tokens",
                code="kv_capacity_exceeded",
            )


def cpu_pages_free(engine: OffloadEngine) -> int:
    """Pages free at the next block boundary: free now, plus those of requests that finished
    or were aborted and leave (freeing their pages) at that boundary, before admission."""
    pool = engine.cpu_pool
    leaving = sum(
        len(pool.pages(r.request_id))
        for r in list(engine.batch.requests)
        if r.status.finished and r.request_id in pool
    )
    return pool.num_free_pages + leaving


@dataclass(frozen=True)
class PoolUsage:
    """What ``/metrics`` reports about KV memory (pages, slots, bytes)."""

    cpu_pages_used: int
    cpu_pages_total: int
    gpu_slots_used: int
    gpu_slots_total: int
    gpu_kv_bytes: int


def pool_usage(engine: Engine) -> PoolUsage:
    """KV memory in use. Slots are the GPU pool's unit (one request's dense cache row, or its
    sparse-pool rows: every slot holds a full-budget request, so slots bound admission); the
    CPU pool (offloading modes; 0 / 0 for dense) is in pages of one block."""
    used = len(engine.batch)
    if isinstance(engine, OffloadEngine):
        stores = [t for t in engine.dense_k + engine.dense_v if t is not None]
        dense = sum(t.numel() * t.element_size() for t in stores)
        pool = engine.cpu_pool
        return PoolUsage(
            pool.num_used_pages, pool.num_pages, used, engine.max_batch_size,
            engine.pool.num_bytes + dense,
        )  # fmt: skip
    return PoolUsage(0, 0, used, engine.max_batch_size, engine.cache.num_bytes)


def budget_matches(engine: Engine, requested: float) -> bool:
    return math.isclose(requested, kv_budget(engine), rel_tol=1e-9, abs_tol=0.0)
