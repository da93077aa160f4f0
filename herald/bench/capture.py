"""The data of the selection-recall analysis (:mod:`herald.eval.recall`): one dense decode per
example with :class:`ForwardRecorder` around the engine's attention backend, keeping every
forward's post-RoPE q/k/v of every layer; :func:`capture_dense` sorts them into the committed KV
(prompt and completed blocks) and the denoising-step forwards of each decoded block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from herald.config import SamplingParams
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig


@dataclass
class RecordedForward:
    """One forward's tensors, row 0 of the batch: q [L, Hq, D], k/v [L, Hkv, D] per layer."""

    start: int
    length: int
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class ForwardRecorder:
    """Wraps an engine's attention backend (``prepare`` + ``forward``) and keeps each forward's
    q/k/v (queries only for forwards starting at or after ``keep_queries_from``)."""

    def __init__(self, inner: Any, keep_queries_from: int) -> None:
        self.inner = inner
        self.keep_queries_from = keep_queries_from
        self.forwards: list[RecordedForward] = []

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        self.inner.prepare(*args, **kwargs)
        prefix = args[0] if args else kwargs["prefix"]
        length = args[1] if len(args) > 1 else kwargs["length"]
        self.forwards.append(RecordedForward(int(prefix[0]), int(length)))

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        f = self.forwards[-1]
        if f.start >= self.keep_queries_from:
            f.q[layer_id] = q[0].clone()
        f.k[layer_id], f.v[layer_id] = k[0].clone(), v[0].clone()
        return self.inner.forward(layer_id, q, k, v)


@dataclass
class Capture:
    """A dense decode's recorded tensors.

    ``committed_k/v[layer]``: [Hkv, T, D] (prompt blocks + committed decoded blocks, absolute
    positions ``[0, T)``); ``steps[start]``: the denoising-step forwards of the block at
    ``start`` (commit forward excluded); ``block_starts``: decoded blocks in order.
    """

    prompt_ids: list[int]
    block_starts: list[int]
    committed_k: list[torch.Tensor]
    committed_v: list[torch.Tensor]
    steps: dict[int, list[RecordedForward]]


@torch.inference_mode()
def capture_dense(
    model: BlockDiffusionLM,
    config: ModelConfig,
    prompt_ids: list[int],
    num_blocks: int,
    params: SamplingParams,
) -> Capture:
    """Decode ``num_blocks`` blocks after ``prompt_ids`` with the dense engine (EOS ignored) and
    record them. ``params``: threshold / fixed steps (greedy); its max_new_tokens is replaced."""
    from dataclasses import replace

    from herald.config import EngineConfig
    from herald.diffusion.block import BlockLayout
    from herald.engine.dense import DenseEngine

    b = config.block_size
    p = replace(params, max_new_tokens=num_blocks * b, ignore_eos=True, temperature=0.0)
    first = BlockLayout(len(prompt_ids), b, p.max_new_tokens).first_block_start
    seq = len(prompt_ids) + p.max_new_tokens + 2 * b
    engine = DenseEngine(
        model, config, EngineConfig(max_batch_size=1, max_seq_len=seq, use_cuda_graph=False)
    )
    rec = ForwardRecorder(engine.attn, keep_queries_from=first)
    engine.attn = rec  # type: ignore[assignment]
    req = engine.add_request(prompt_ids, p)
    while engine.has_unfinished():
        engine.step()
    by_start: dict[int, list[RecordedForward]] = {}
    prefill: list[RecordedForward] = []
    for f in rec.forwards:
        (prefill if f.start < first else by_start.setdefault(f.start, [])).append(f)
    starts = sorted(by_start)
    committed: list[RecordedForward] = list(prefill)
    steps: dict[int, list[RecordedForward]] = {}
    for start, n in zip(starts, req.steps_per_block, strict=False):
        fs = by_start[start]
        steps[start] = fs[:n]
        if len(fs) > n:  # the commit forward (every completed block but the last one)
            committed.append(fs[n])
    layers = range(config.num_layers)
    ck = [torch.cat([f.k[i] for f in committed]).transpose(0, 1) for i in layers]
    cv = [torch.cat([f.v[i] for f in committed]).transpose(0, 1) for i in layers]
    return Capture(list(prompt_ids), starts, ck, cv, steps)
