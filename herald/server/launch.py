"""Building a server: load the model, make the engine, its loop, metrics and the app.

:func:`build_app` is what ``herald serve`` and the tests use; :func:`serve` runs it under uvicorn.
"""

from __future__ import annotations

import logging

import torch
from fastapi import FastAPI

from herald.config import OffloadConfig
from herald.kv.dense_cache import DEFAULT_KV_PAD
from herald.models.loader import load_model
from herald.server.api import ServerState, create_app
from herald.server.chat import ChatTemplate
from herald.server.engine_loop import EngineLoop
from herald.server.metrics import ServerMetrics
from herald.server.served_engine import MODES, build_engine

log = logging.getLogger(__name__)


def build_app(
    model: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    mode: str = "dense",
    offload: OffloadConfig | None = None,
    max_batch_size: int = 16,
    max_seq_len: int = 2048,
    max_waiting: int = 64,
    max_prefill_tokens: int = 4096,
    kv_pad: int = DEFAULT_KV_PAD,
    api_key: str | None = None,
    seed: int = 0,
) -> FastAPI:
    """Load ``model`` (checkpoint directory or preset) and return the app serving it.

    ``mode``: ``dense`` or an offloading mode (``herald`` / ``mage`` / ``infinigen``, which run
    bf16 models); ``offload`` its switches (default ``OffloadConfig.for_mode(mode)``; kv budget
    and CPU pool size). ``max_seq_len`` (prompt + generated tokens per request, rounded up to
    whole blocks) is capped at the model's context. ``max_prefill_tokens``: prompt tokens
    handed over (:class:`EngineLoop`) and prefilled by the engine per block boundary at most; a
    longer prompt goes alone and is prefilled over several boundaries. The engine thread
    starts with the app's lifespan. Raises ValueError for bad settings, before the model loads
    where it can.
    """
    if mode not in MODES:
        raise ValueError(f"unknown --mode {mode!r}; one of {', '.join(MODES)}")
    if max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {max_waiting}")
    if max_batch_size < 1 or max_seq_len < 1:
        raise ValueError("--max-batch-size and --max-seq-len must be >= 1")
    if max_prefill_tokens < 1:
        raise ValueError(f"--max-prefill-tokens must be >= 1, got {max_prefill_tokens}")
    if offload is not None:
        offload.validate()
    net, config, tokenizer = load_model(model, device=device, dtype=dtype, random_init_seed=seed)
    seq = min(max_seq_len, config.max_position_embeddings)
    engine = build_engine(
        mode, net, config, max_batch_size=max_batch_size, max_seq_len=seq, offload=offload,
        max_prefill_tokens=max_prefill_tokens, kv_pad=kv_pad,
    )  # fmt: skip
    if mode != "dense":
        log.info("%s", engine.cpu_pool.describe())  # type: ignore[union-attr]
    metrics = ServerMetrics()
    loop = EngineLoop(
        engine, max_waiting=max_waiting, max_prefill_tokens=max_prefill_tokens, metrics=metrics
    )
    template = ChatTemplate.for_model(model, tokenizer)
    state = ServerState(loop, tokenizer, str(model), metrics, api_key, mode, template)
    return create_app(state)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run ``app`` under uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
