"""Building a server: load the model, make the engine, its loop, metrics and the app.

:func:`build_app` is what ``herald serve`` and the tests use; :func:`serve` runs it under uvicorn.
"""

from __future__ import annotations

import torch
from fastapi import FastAPI

from herald.engine.dense import DenseEngine
from herald.models.loader import load_model
from herald.server.api import ServerState, create_app
from herald.server.engine_loop import EngineLoop
from herald.server.metrics import ServerMetrics


def build_app(
    model: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_batch_size: int = 16,
    max_seq_len: int = 2048,
    max_waiting: int = 64,
    api_key: str | None = None,
    seed: int = 0,
) -> FastAPI:
    """Load ``model`` (checkpoint directory or preset) and return the app serving it.

    ``max_seq_len`` (prompt + generated tokens per request, rounded up to whole blocks) is capped
    at the model's context. The engine thread starts with the app's lifespan.
    """
    if max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {max_waiting}")
    if max_batch_size < 1 or max_seq_len < 1:
        raise ValueError("--max-batch-size and --max-seq-len must be >= 1")
    net, config, tokenizer = load_model(model, device=device, dtype=dtype, random_init_seed=seed)
    seq = min(max_seq_len, config.max_position_embeddings)
    engine = DenseEngine(
        net, config, max_batch_size=max_batch_size, max_seq_len=seq, use_cuda_graph=False
    )
    metrics = ServerMetrics()
    loop = EngineLoop(engine, max_waiting=max_waiting, metrics=metrics)
    state = ServerState(loop, tokenizer, str(model), metrics, api_key)
    return create_app(state)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run ``app`` under uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info")
