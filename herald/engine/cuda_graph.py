"""Piecewise CUDA graphs for B-token forwards: everything but attention is replayed from graphs.

Per decoder layer two graphs are captured once per batch size: ``qkv`` (input norm, projections,
QK-norm, RoPE) and ``finish`` (o_proj, residual, FFN / MoE). Attention runs eagerly between them,
so a graph does not depend on where each request is (its KV length grows every block, and requests
of a continuous batch sit at different positions): one capture serves every block of every request
mix of that batch size. This is the "piecewise" scheme vLLM uses; the eager part is a handful of
launches per layer, far below the GPU time of a long-context forward.

NOTE: all graphs of one runner share one memory pool and are always replayed in capture order
(layer 0 qkv, layer 0 finish, layer 1 qkv, ...), the pattern under which sharing a pool is safe.
Static buffers are only written on the current stream, in order with the replays that read them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from herald.models.base import AttentionBackend, BlockDiffusionLM, DecoderLayer


class PiecewiseGraphForward:
    """Replays a model's B-token forward for a fixed batch size ``bs`` and length ``length``.

    Args:
        model: a :class:`BlockDiffusionLM` on a CUDA device.
        bs, length: the forward's input shape ``[bs, length]``.
    Call :meth:`forward` exactly like ``model.forward``.
    """

    def __init__(self, model: BlockDiffusionLM, bs: int, length: int) -> None:
        self.model = model
        self.bs, self.length = bs, length
        self.pool: Any = None
        self._captured = False
        self._graphs: list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = []
        self._hidden: list[torch.Tensor] = []  # hidden[i] = input of layer i; [L] = output
        self._qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._attn_out: list[torch.Tensor] = []
        self._positions: torch.Tensor | None = None

    def _layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    def _capture(
        self, hidden0: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> None:
        layers = self._layers()
        self._positions = positions.clone()
        self.pool = torch.cuda.graph_pool_handle()
        hidden = hidden0.clone()
        self._hidden = [hidden]
        for layer in layers:
            ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # NOTE: thread-local capture: the retrieval worker thread may issue CUDA work on its
            # own stream meanwhile, which a global capture would reject.
            with torch.cuda.graph(ga, pool=self.pool, capture_error_mode="thread_local"):
                q, k, v = layer.qkv(hidden, self._positions)
            ga.replay()
            # Attention runs eagerly at replay time; here only to size its static output.
            attn_out = attn.forward(layer.layer_id, q, k, v).clone()
            with torch.cuda.graph(gb, pool=self.pool, capture_error_mode="thread_local"):
                hidden = layer.finish(self._hidden[-1], attn_out)
            gb.replay()
            self._graphs.append((ga, gb))
            self._qkv.append((q, k, v))
            self._attn_out.append(attn_out)
            self._hidden.append(hidden)
        self._captured = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """Same contract as :meth:`BlockDiffusionLM.forward`; ``input_ids`` is [bs, length].

        The returned tensor is a static buffer, overwritten by the next call.
        """
        hidden0 = self.model.embed(input_ids)
        if not self._captured:
            # NOTE: capturing also executes every layer once (each graph is replayed right after
            # its capture, attention eagerly in between), so this call's output is valid.
            with _no_garbage_collection():
                self._capture(hidden0, positions, attn)
            return self.model.final_norm(self._hidden[-1])
        assert self._positions is not None
        self._hidden[0].copy_(hidden0)
        self._positions.copy_(positions)
        for i, layer in enumerate(self._layers()):
            ga, gb = self._graphs[i]
            ga.replay()
            q, k, v = self._qkv[i]
            self._attn_out[i].copy_(attn.forward(layer.layer_id, q, k, v))
            gb.replay()
        return self.model.final_norm(self._hidden[-1])


@contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Collect garbage now, then keep the collector off for the duration of a capture.

    NOTE: a collection during a capture may free an unreachable engine whose finalizers call
    CUDA (a pinned pool unregistering after ``torch.cuda.synchronize``, old graphs resetting),
    which invalidates the capture; the collector runs in whatever thread allocates, so it is
    switched off process-wide, for the few seconds a capture takes.
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
