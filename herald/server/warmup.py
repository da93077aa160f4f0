"""The start-up warm-up of ``herald serve``: the engine's one-time costs paid before any client.

A served engine replays its decode forwards from CUDA graphs captured per batch size
(:class:`~herald.engine.runner.ModelRunner`: the first forward of a shape runs eagerly, the
second captures, later ones replay). Left alone, every batch size the server meets for the first
time pays an eager forward and a capture inside a client's request, and a continuous batch meets
every size from 1 to ``max_batch_size`` as requests come and go. :func:`warm_up_engine` walks
through all of them before the server accepts requests:

* with graphs (CUDA), one wave of ``max_batch_size`` short requests of staggered lengths (the
  ``i``-th generates ``i + 2`` blocks): the batch starts full and loses one row per block, so
  every batch size from ``max_batch_size`` down to 1 runs for a whole block (several forwards:
  eager, capture, replays), in every forward shape the mode uses (the offloading modes' main
  stream, draft and commit forwards included). When the staggered lengths do not fit the
  context, one wave per batch size instead (each of its requests two blocks long).
* without graphs (CPU), one request of two blocks: compiled kernels and the offloading modes'
  first selection and hand-offs are the only one-time costs.

Each request denoises a block in three steps and ignores EOS. The engine's counters start again
afterwards, and it holds no KV (each request finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from herald.config import SamplingParams
from herald.engine.stats import EngineStats

WARM_UP_PROMPT = "def warm_up(x):\n    return x\n"
WARM_UP_STEPS = 3
"""Denoising steps per block of the warm-up requests."""


@dataclass(frozen=True)
class WarmUp:
    """What the warm-up did: ``seconds``, the batch sizes its forwards ran at, the forward shapes
    the engine had captured CUDA graphs for afterwards, the GPU memory PyTorch's allocator
    reserved meanwhile (after minus before: the graphs' pools and the blocks the warm-up's eager
    forwards left cached, less what it released; negative when it released more) and what the
    graphs' private pools hold (0 on CPU), which may be carved from memory reserved before the
    warm-up and so exceed the growth."""

    seconds: float
    batch_sizes: tuple[int, ...]
    """Every batch size the engine's decode forwards have run at so far."""
    graph_shapes: int
    gpu_bytes: int
    graph_pool_bytes: int = 0

    def describe(self) -> str:
        sizes = self.batch_sizes
        span = f"{min(sizes)}-{max(sizes)}" if len(sizes) > 1 else str(sizes[0]) if sizes else "-"
        text = f"{self.seconds:.1f} s, batch sizes {span}"
        if self.graph_shapes:
            text += (
                f", {self.graph_shapes} CUDA-graph shapes ({self.graph_pool_bytes / 2**30:.2f} "
                f"GiB in their private pools; PyTorch's reserved memory "
                f"{self.gpu_bytes / 2**30:+.2f} GiB over the warm-up)"
            )
        return text


def graph_pool_bytes(segments: list[dict[str, Any]], device: int) -> int:
    """Bytes of ``device``'s allocator segments (``torch.cuda.memory_snapshot()``) that belong to
    a private pool (a CUDA graph's): every pool but the default one, ``(0, 0)``."""
    return sum(
        int(s["total_size"])
        for s in segments
        if s.get("device", device) == device and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
    )


def warm_up_plan(
    max_batch_size: int, block_size: int, max_seq_len: int, prompt_len: int, all_sizes: bool
) -> list[list[int]]:
    """The warm-up's waves, each a list of ``max_new_tokens`` (one per request, all sent
    together); see the module docstring. Blocks beyond ``max_seq_len`` are never asked for:
    a request gets at most the context left after its prompt, and at least one block.

    Raises:
        ValueError: ``max_seq_len`` leaves no block after ``prompt_len`` tokens.
    """
    room = (max_seq_len - prompt_len) // block_size
    if room < 1:
        raise ValueError(
            f"warm-up: a {prompt_len}-token prompt leaves no {block_size}-token block in "
            f"max_seq_len {max_seq_len}"
        )
    if not all_sizes:
        return [[min(2, room) * block_size]]
    if max_batch_size + 1 <= room:
        return [[(i + 2) * block_size for i in range(max_batch_size)]]
    two = min(2, room) * block_size
    return [[two] * n for n in range(max_batch_size, 0, -1)]


def warm_up_engine(eng: Any, tokenizer: Any, *, all_sizes: bool | None = None) -> WarmUp:
    """Run the warm-up's requests through ``eng`` (an :class:`~herald.engine.base.Engine`),
    then reset its counters. ``all_sizes`` (default: when the engine replays CUDA graphs)
    walks every batch size from ``eng.max_batch_size`` down to 1; else one request."""
    if all_sizes is None:
        all_sizes = bool(eng.runner.use_cuda_graph)
    cuda = eng.device.type == "cuda"
    before = torch.cuda.memory_reserved(eng.device) if cuda else 0
    t0 = time.perf_counter()
    b = eng.block_size
    prompt = tokenizer.encode(WARM_UP_PROMPT)[: max(1, eng.max_seq_len - 3 * b)]
    waves = warm_up_plan(eng.max_batch_size, b, eng.max_seq_len, len(prompt), all_sizes)
    for wave in waves:
        params = [
            SamplingParams(max_new_tokens=n, num_denoise_steps=WARM_UP_STEPS, ignore_eos=True)
            for n in wave
        ]
        eng.generate([prompt] * len(wave), params)
    seconds = time.perf_counter() - t0
    sizes = {bs for bs, _ in eng.runner.forwards}
    after = torch.cuda.memory_reserved(eng.device) if cuda else 0
    pools = 0
    if cuda:
        index = torch.device(eng.device).index or 0
        pools = graph_pool_bytes(torch.cuda.memory_snapshot(), index)
    eng.stats = EngineStats()
    shapes = eng.runner.num_graph_shapes
    return WarmUp(seconds, tuple(sorted(sizes)), shapes, after - before, pools)
