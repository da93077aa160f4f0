"""Building a server: load the model, make the engine, its loop, metrics and the app.

:func:`build_app` is what ``herald serve`` and the tests use; :func:`serve` runs it under uvicorn.
The engine is built from the same :class:`~herald.config.EngineConfig` as a benchmark's, so what
is served is what is measured (CUDA graphs on, by default).
"""

from __future__ import annotations

import logging

import torch
from fastapi import FastAPI

from herald.config import EngineConfig
from herald.engines import build_engine
from herald.models.loader import load_model
from herald.server.api import ServerState, create_app
from herald.server.chat import ChatTemplate
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.engine_loop import EngineLoop
from herald.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def build_app(
    model: str,
    engine: EngineConfig = SERVE_DEFAULTS,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> FastAPI:
    """Load ``model`` (checkpoint directory or preset) and return the app serving it with the
    engine ``engine`` describes (``engine.offload`` None: dense; offloading modes run bf16
    models). ``max_seq_len`` is capped at the model's context. The engine thread starts with the
    app's lifespan. Raises ValueError for bad settings, before the model loads where it can.
    """
    engine.validate()
    net, config, tokenizer = load_model(model, device=device, dtype=dtype, random_init_seed=seed)
    engine = engine.replace(max_seq_len=min(engine.max_seq_len, config.max_position_embeddings))
    eng = build_engine(net, config, engine)
    log.info("%s", eng.describe())
    usage = eng.usage()
    longest = eng.kv.pages_needed(1, eng.max_seq_len - 1)
    if usage.cpu_pages_total and longest > usage.cpu_pages_total:
        log.warning(
            "the CPU KV pool holds %d pages, a request of --max-seq-len %d tokens needs %d: "
            "such requests will be refused (enlarge --cpu-kv-gb / --cpu-kv-tokens)",
            usage.cpu_pages_total, eng.max_seq_len, longest,
        )  # fmt: skip
    metrics = ServerMetrics()
    loop = EngineLoop(eng, metrics=metrics)
    template = ChatTemplate.for_model(model, tokenizer)
    state = ServerState(loop, tokenizer, str(model), metrics, api_key, template)
    return create_app(state)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run ``app`` under uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
