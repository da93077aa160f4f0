"""The start-up memory check of ``herald serve``: the engine's worst moment, once, before clients.

Under load a server reaches a peak that the warm-up's short requests never do: a full batch of
requests near ``max_seq_len`` decoding (every batch size's CUDA graphs held) while prompts of a
whole prefill budget go through the prefill forwards beside it. An engine whose weights, KV slots
and graphs fit can still run out of GPU memory there, first under load, failing the requests it
runs. vLLM and SGLang size their KV cache from a profile run at start-up for this reason; herald's
KV slots are sized by the flags, so the check runs that moment itself and refuses a configuration
that does not fit it (:class:`PeakCheckFailed`, naming the flags that lower it).

What :func:`check_peak` runs (every request ignores EOS and denoises a block in
:data:`~herald.server.warmup.WARM_UP_STEPS` steps):

1. ``max_batch_size - k`` filler requests with prompts a few blocks short of ``max_seq_len``
   join the batch at one boundary with random KV in place of their prompt forwards
   (:class:`~herald.engine.hooks.SyntheticPrefill`: the KV's values do not change the memory a
   step takes), and decode;
2. ``k`` requests of ``max_seq_len - B`` prompt tokens, as many as one boundary's prefill budget
   holds (at most the free slots), go through the real prefill forwards beside them and join:
   the batch is then full at its longest;
3. once those finished their block, the fillers are aborted; the engine is left empty, its
   counters reset.

On CUDA the peak is PyTorch's peak reserved memory during the run plus what it did not allocate
(the CUDA context, other processes). A filler the CPU KV pool cannot hold beside the others is
left out, as a server would keep it waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from herald.config import SamplingParams
from herald.engine.hooks import SyntheticPrefill
from herald.engine.request import Request, RequestStatus
from herald.engine.stats import EngineStats
from herald.kv.manager import RequestTooLarge
from herald.server.warmup import WARM_UP_PROMPT, WARM_UP_STEPS

log = logging.getLogger(__name__)

LOW_HEADROOM = 0.03
"""A peak within this fraction of the card's memory is logged as a warning: fragmentation under
load can take the rest."""


class PeakCheckFailed(ValueError):
    """The configuration ran out of GPU memory at its start-up peak (the message says what ran
    and which flags lower it)."""


@dataclass(frozen=True)
class PeakRun:
    """What the check ran: ``batch`` requests at once, the longest of ``context`` tokens,
    ``prefill_tokens`` prompt tokens through the real prefill beside them."""

    batch: int
    context: int
    prefill_tokens: int

    def describe(self) -> str:
        return (
            f"{self.batch} request(s) of up to {self.context:,} tokens at once, "
            f"{self.prefill_tokens:,} prompt tokens prefilled beside them"
        )


@dataclass(frozen=True)
class PeakCheck:
    """The check's outcome: what ran, how long it took, and on CUDA the peak GPU memory and the
    card's total (bytes; 0 on the CPU, where it is not measured)."""

    run: PeakRun
    seconds: float
    peak_bytes: int
    total_bytes: int

    @property
    def headroom(self) -> float:
        """Fraction of the card's memory left at the peak (1.0 when not measured)."""
        return 1.0 if not self.total_bytes else 1.0 - self.peak_bytes / self.total_bytes

    def describe(self) -> str:
        text = f"{self.run.describe()}: {self.seconds:.1f} s"
        if self.total_bytes:
            text += (
                f", peak {self.peak_bytes / 2**30:.1f} of {self.total_bytes / 2**30:.1f} GiB of "
                "GPU memory"
            )
        return text


def plan_peak(
    max_batch_size: int, block_size: int, max_seq_len: int, max_prefill_tokens: int | None
) -> tuple[int, int, int, int]:
    """``(fillers, filler_prompt, filler_new, real_prompt)``: the sizes of :func:`check_peak`'s
    requests (see the module docstring); ``k = max_batch_size - fillers`` real requests of
    ``real_prompt`` tokens, each generating one block. The fillers generate blocks enough to
    outlast the real requests' prefill (one boundary per budget's worth, plus two), as far as
    ``max_seq_len`` allows."""
    b = block_size
    real = max(1, max_seq_len - b)
    budget = max_prefill_tokens
    k = 1 if budget is None else min(max_batch_size, max(1, math.ceil(budget / real)))
    boundaries = 1 if budget is None else math.ceil(k * real / max(b, budget)) + 1
    new = min((boundaries + 2) * b, max(b, (max_seq_len - 1) // b * b))
    return max_batch_size - k, max(1, max_seq_len - new), new, real


def check_peak(eng: Any, tokenizer: Any) -> PeakCheck:
    """Run the engine's serving peak once (module docstring) and measure it.

    Raises:
        PeakCheckFailed: it ran out of GPU memory; the engine is left empty and usable.
    """
    b, cuda, dev = eng.block_size, eng.device.type == "cuda", eng.device
    fillers, filler_len, filler_new, real_len = plan_peak(
        eng.max_batch_size, b, eng.max_seq_len, eng.max_prefill_tokens
    )
    seed = tokenizer.encode(WARM_UP_PROMPT) or [0]
    tokens = (seed * (eng.max_seq_len // len(seed) + 1))[: eng.max_seq_len]
    total = others = 0
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        others = total - free - torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    reqs: list[Request] = []
    real: list[Request] = []
    rows = 0
    try:
        reqs = _add(eng, tokens[:filler_len], filler_new, fillers)
        # the fillers join at once: no prefill budget for their (synthetic) prompts
        hooks, budget = eng.hooks, eng.scheduler.max_prefill_tokens
        eng.hooks = dataclasses.replace(hooks, synthetic_prefill=SyntheticPrefill(cpu_pages=False))
        eng.scheduler.max_prefill_tokens = None
        try:
            eng.step()
        finally:
            eng.hooks, eng.scheduler.max_prefill_tokens = hooks, budget
        rows = eng.num_running
        for r in reqs:  # the pool could not hold it beside the others: a server keeps it waiting
            if r.status == RequestStatus.WAITING:
                eng.abort(r)
        real = _add(eng, tokens[:real_len], b, eng.max_batch_size - fillers)
        reqs += real
        while not all(r.status.finished for r in real):
            eng.step()
            rows = max(rows, eng.num_running)
        for r in reqs:
            eng.abort(r)
        while eng.has_unfinished():
            eng.step()
    except RuntimeError as e:  # torch.OutOfMemoryError, or a library's failed allocation
        if not is_out_of_memory(e):
            raise
        # step() failed the requests it ran and freed their KV; the rest leave the queue
        for r in reqs:
            eng.abort(r)
        eng.scheduler.take_aborts()
        peak = torch.cuda.max_memory_reserved(dev) + others if cuda else 0
        if cuda:
            torch.cuda.empty_cache()
        eng.stats = EngineStats()
        raise PeakCheckFailed(_failure(eng, real_len, len(real), peak, total, e)) from None
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_reserved(dev) + others if cuda else 0
    eng.stats = EngineStats()
    prompts = [len(r.prompt_ids) for r in real]
    run = PeakRun(rows, max(prompts, default=0) + b, sum(prompts))
    return PeakCheck(run, seconds, peak, total)


def is_out_of_memory(e: BaseException) -> bool:
    """``e`` says the GPU ran out of memory: PyTorch's allocator (``torch.OutOfMemoryError``) or
    a library's own allocation (cuBLAS, cuDNN: a RuntimeError saying so)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)
    )


def _add(eng: Any, prompt: list[int], new: int, n: int) -> list[Request]:
    """``n`` requests of ``prompt`` generating ``new`` tokens (fewer when the CPU KV pool cannot
    hold them: a shorter prompt, halved until it fits)."""
    params = SamplingParams(max_new_tokens=new, num_denoise_steps=WARM_UP_STEPS, ignore_eos=True)
    out: list[Request] = []
    while len(out) < n:
        try:
            out.append(eng.add_request(prompt, params))
        except RequestTooLarge:
            if len(prompt) <= 1:
                break
            prompt = prompt[: len(prompt) // 2]
    return out


def _failure(eng: Any, real_len: int, n_real: int, peak: int, total: int, e: Exception) -> str:
    budget = eng.max_prefill_tokens
    where = "; ".join(str(e).split(". ")[:2])
    return (
        f"out of GPU memory at the start-up memory check: {eng.max_batch_size} requests of up to "
        f"{eng.max_seq_len:,} tokens running (--max-batch-size {eng.max_batch_size}, "
        f"--max-seq-len {eng.max_seq_len}) while {max(1, n_real)} prompt(s) of {real_len:,} "
        f"tokens are prefilled beside them (--max-prefill-tokens "
        f"{'unbounded' if budget is None else budget}) need more than this card has"
        + (f" (peak {peak / 2**30:.1f} of {total / 2**30:.1f} GiB before failing)" if total else "")
        + f": lower one of those flags ({where})"
    )
