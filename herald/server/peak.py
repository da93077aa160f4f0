"""The start-up memory check of ``herald serve``: the engine's worst moment, once, before clients.

Under load a server reaches a peak that the warm-up's short requests never do: a full batch of
requests near ``max_seq_len`` decoding (every batch size's CUDA graphs held) while prompts of a
whole prefill budget go through the prefill forwards beside it. An engine whose weights, KV slots
and graphs fit can still run out of GPU memory there, first under load, failing the requests it
runs. vLLM and SGLang size their KV cache from a profile run at start-up for this reason; herald's
KV slots are sized by the flags, so the check runs that moment itself and refuses a configuration
that does not fit it (:class:`PeakCheckFailed`, naming the flags that lower it).

What :func:`check_peak` runs (:func:`plan_peak` gives the sizes; every request ignores EOS):

1. ``max_batch_size - k`` filler requests with prompts four blocks short of ``max_seq_len`` join
   the batch at one boundary with random KV in place of their prompt forwards
   (:class:`~herald.engine.hooks.SyntheticPrefill`: the KV's values do not change the memory a
   step takes), and decode;
2. ``k`` requests of ``max_seq_len - B`` prompt tokens, as many as one boundary's prefill budget
   holds (at most the free slots), go through the real prefill forwards beside them and join:
   the batch is then full at its longest. Each block takes enough denoising steps (at least
   :data:`~herald.server.warmup.WARM_UP_STEPS`) for their whole prefill to fit in one block's
   boundaries, so the fillers outlast it with their long prompts (a small budget against a long
   context needs more than ``B`` steps: then the fillers' prompts are shorter);
3. once those finished their block, the fillers are aborted; the engine is left empty, its
   counters reset.

On CUDA the peak is PyTorch's peak reserved memory during the run plus what it did not allocate
(the CUDA context, other processes), against the card's memory. Under ``--gpu-memory-utilization``
(:func:`cap_gpu_memory`: PyTorch's allocator refuses to reserve past a fraction of the card) the
peak is PyTorch's reserved memory alone, against that cap, wherever the cap is the lower limit of
the two. In an offloading mode the fillers leave the real requests' CPU pages free: a batch the
pool cannot hold is a batch the server never runs either.
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
"""A peak within this fraction of the card's memory (or of the cap) is logged as a warning:
fragmentation under load can take the rest."""

CAP_FLAG = "--gpu-memory-utilization"
"""The ``herald serve`` flag that caps PyTorch's allocator at a fraction of the GPU's memory."""


class PeakCheckFailed(ValueError):
    """The configuration ran out of GPU memory at its start-up peak (the message says what ran
    and which flags lower it)."""


@dataclass(frozen=True)
class PeakRun:
    """What the check ran: at most ``batch`` requests at once, the longest of ``context``
    tokens, ``prefill_tokens`` prompt tokens through the real prefill while ``beside`` requests
    ran."""

    batch: int
    context: int
    prefill_tokens: int
    beside: int

    def describe(self) -> str:
        if not self.batch:
            return "no request could run (no block after a prompt, or no CPU pages)"
        return (
            f"{self.batch} request(s) of up to {self.context:,} tokens at once, "
            f"{self.prefill_tokens:,} prompt tokens prefilled beside {self.beside} running"
        )


@dataclass(frozen=True)
class PeakCheck:
    """The check's outcome: what ran, how long it took, and on CUDA the peak GPU memory and the
    card's total (bytes; 0 on the CPU, where it is not measured). ``capped``: the limit was
    ``--gpu-memory-utilization``'s, ``total_bytes`` that cap and ``peak_bytes`` what PyTorch's
    allocator reserved."""

    run: PeakRun
    seconds: float
    peak_bytes: int
    total_bytes: int
    capped: bool = False

    @property
    def headroom(self) -> float:
        """Fraction of the card's memory (of the cap) left at the peak (1.0 when not
        measured)."""
        return 1.0 if not self.total_bytes else 1.0 - self.peak_bytes / self.total_bytes

    def describe(self) -> str:
        text = f"{self.run.describe()}: {self.seconds:.1f} s"
        if self.total_bytes:
            text += f", {_peak_of(self.peak_bytes, self.total_bytes, self.capped)}"
        return text


def _peak_of(peak: int, total: int, capped: bool) -> str:
    limit = f"allowed by {CAP_FLAG}" if capped else "of GPU memory"
    return f"peak {peak / 2**30:.1f} of {total / 2**30:.1f} GiB {limit}"


def check_memory_fraction(fraction: float | None, device: torch.device | str) -> None:
    """ValueError naming ``--gpu-memory-utilization`` when ``fraction`` is outside (0, 1] (nan
    included) or given for a device other than CUDA (None: no cap, always fine)."""
    if fraction is None:
        return
    if not 0 < fraction <= 1:
        raise ValueError(f"{CAP_FLAG} must be in (0, 1], got {fraction:g}")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"{CAP_FLAG} limits GPU memory only, and the device here is {dev}: give it with "
            "--device cuda, on a machine with a CUDA GPU"
        )


def cap_gpu_memory(fraction: float | None, device: torch.device | str) -> int | None:
    """Cap what this process's PyTorch allocator may reserve on the CUDA ``device`` at
    ``fraction`` of the card's total memory (``torch.cuda.set_per_process_memory_fraction``):
    past it an allocation raises ``torch.OutOfMemoryError`` as on a full card. The cap holds for
    the whole process and whatever allocates after it (weights, KV, CUDA graphs, activations);
    the CUDA context and other processes are outside it. Returns the cap in bytes; None (no
    cap, nothing changed) when ``fraction`` is None. ValueError as :func:`check_memory_fraction`.
    """
    check_memory_fraction(fraction, device)
    if fraction is None:
        return None
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    return int(fraction * torch.cuda.mem_get_info(index)[1])


@dataclass(frozen=True)
class PeakPlan:
    """The sizes of :func:`check_peak`'s requests (module docstring)."""

    fillers: int
    filler_prompt: int
    filler_new: int
    real: int
    """Real requests, ``k``."""
    real_prompt: int
    steps: int
    """Denoising steps per block, of every request."""


def plan_peak(
    max_batch_size: int, block_size: int, max_seq_len: int, max_prefill_tokens: int | None
) -> PeakPlan:
    """The check's sizes: ``k`` real requests of ``max_seq_len - B`` tokens (one boundary's
    budget, at most the slots), each generating one block; ``n`` = the boundaries their prefill
    takes at one budget per boundary (the dense engine's are its forwards); ``steps`` = ``n +
    1`` (at least the warm-up's, at most ``B``: a block spans the prefill); the fillers generate
    ``ceil((n + 1) / steps) + 3`` blocks (the block they join in, the prefill's, the real
    requests' block, one to spare), as far as ``max_seq_len`` allows."""
    b = block_size
    real = max(1, max_seq_len - b)
    budget = max_prefill_tokens
    k = 1 if budget is None else min(max_batch_size, max(1, math.ceil(budget / real)))
    n = 1 if budget is None else math.ceil(k * real / max(b, budget))
    steps = min(b, max(WARM_UP_STEPS, n + 1))
    new = min((math.ceil((n + 1) / steps) + 3) * b, max(b, (max_seq_len - 1) // b * b))
    return PeakPlan(max_batch_size - k, max(1, max_seq_len - new), new, k, real, steps)


def check_peak(eng: Any, tokenizer: Any, limit_bytes: int | None = None) -> PeakCheck:
    """Run the engine's serving peak once (module docstring) and measure it; ``limit_bytes``:
    the cap :func:`cap_gpu_memory` set (None: none).

    Raises:
        PeakCheckFailed: it ran out of GPU memory; the engine is left empty and usable.
    """
    b, cuda, dev = eng.block_size, eng.device.type == "cuda", eng.device
    plan = plan_peak(eng.max_batch_size, b, eng.max_seq_len, eng.max_prefill_tokens)
    fillers = _fillers_the_pool_holds(eng, plan)
    seed = tokenizer.encode(WARM_UP_PROMPT) or [0]
    tokens = (seed * (eng.max_seq_len // len(seed) + 1))[: eng.max_seq_len]
    others, total, capped = _memory_limit(dev, limit_bytes) if cuda else (0, 0, False)
    t0 = time.perf_counter()
    reqs: list[Request] = []
    real: list[Request] = []
    rows = beside = 0
    try:
        reqs = _add(eng, tokens[: plan.filler_prompt], plan.filler_new, fillers, plan.steps)
        # the fillers join at once: no prefill budget for their (synthetic) prompts
        hooks, budget = eng.hooks, eng.scheduler.max_prefill_tokens
        eng.hooks = dataclasses.replace(hooks, synthetic_prefill=SyntheticPrefill(cpu_pages=False))
        eng.scheduler.max_prefill_tokens = None
        try:
            rows = _step_rows(eng)
        finally:
            eng.hooks, eng.scheduler.max_prefill_tokens = hooks, budget
        for r in reqs:  # the pool could not hold it beside the others: a server keeps it waiting
            if r.status == RequestStatus.WAITING:
                eng.abort(r)
        beside = eng.num_running
        real = _add(eng, tokens[: plan.real_prompt], b, plan.real, plan.steps)
        reqs += real
        while not all(r.status.finished for r in real):
            rows = max(rows, _step_rows(eng))
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
        peak = _peak(dev, others) if cuda else 0
        if cuda:
            torch.cuda.empty_cache()
        eng.stats = EngineStats()
        fillers_ran = len(reqs) - len(real)
        raise PeakCheckFailed(
            _failure(eng, plan, fillers_ran, bool(real), peak, total, e, capped=capped)
        ) from None
    seconds = time.perf_counter() - t0
    peak = _peak(dev, others) if cuda else 0
    eng.stats = EngineStats()
    prompts = [len(r.prompt_ids) for r in real]
    ran = max([*prompts, *(len(r.prompt_ids) for r in reqs if r.output_ids)], default=-b) + b
    run = PeakRun(rows, ran if rows else 0, sum(prompts) if rows else 0, beside)
    return PeakCheck(run, seconds, peak, total, capped)


def _memory_limit(dev: torch.device, limit_bytes: int | None) -> tuple[int, int, bool]:
    """Before the run: (the memory PyTorch did not reserve, the limit, capped?), and the peak
    statistics reset. The limit is the card's total (PyTorch's reserved memory plus the rest
    reaches it) or, where it is lower, the allocator's cap ``limit_bytes`` (its reserved memory
    alone reaches that: the rest then counts as 0)."""
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    others = total - free - torch.cuda.memory_reserved(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    if limit_bytes is not None and limit_bytes < total - others:
        return 0, limit_bytes, True
    return others, total, False


def _peak(dev: torch.device, others: int) -> int:
    """The run's peak in bytes: PyTorch's peak reserved memory since :func:`_memory_limit`,
    plus ``others`` (what :func:`_memory_limit` counts beside it)."""
    return torch.cuda.max_memory_reserved(dev) + others


def _step_rows(eng: Any) -> int:
    """One step; the rows its decode forward ran (the engine's counters: a step runs one)."""
    st = eng.stats
    rows, forwards = st.num_batch_rows, st.num_forwards
    eng.step()
    return (st.num_batch_rows - rows) // max(1, st.num_forwards - forwards)


def _fillers_the_pool_holds(eng: Any, plan: PeakPlan) -> int:
    """The plan's fillers, fewer where the CPU KV pool cannot hold them and the real requests
    together (dense: no pool)."""
    pages = eng.usage().cpu_pages_total
    if not pages:
        return plan.fillers
    need = eng.kv.pages_needed
    left = pages - plan.real * need(plan.real_prompt, eng.block_size)
    return max(0, min(plan.fillers, left // max(1, need(plan.filler_prompt, plan.filler_new))))


def is_out_of_memory(e: BaseException | None) -> bool:
    """``e``, or an error it was raised from (the retrieval stream's failure wraps its cause),
    says the GPU ran out of memory: PyTorch's allocator (``torch.OutOfMemoryError``) or a
    library's own allocation (cuBLAS, cuDNN: a RuntimeError saying so)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, torch.OutOfMemoryError) or (
            isinstance(e, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def _add(eng: Any, prompt: list[int], new: int, n: int, steps: int) -> list[Request]:
    """``n`` requests of ``prompt`` generating ``new`` tokens in ``steps`` per block (a shorter
    prompt, halved until it fits, when the CPU KV pool cannot hold it at all)."""
    params = SamplingParams(max_new_tokens=new, num_denoise_steps=steps, ignore_eos=True)
    out: list[Request] = []
    while len(out) < n:
        try:
            out.append(eng.add_request(prompt, params))
        except RequestTooLarge:
            if len(prompt) <= 1:
                break
            prompt = prompt[: len(prompt) // 2]
    return out


def _failure(
    eng: Any,
    plan: PeakPlan,
    fillers: int,
    prefilling: bool,
    peak: int,
    total: int,
    e: Exception,
    *,
    capped: bool = False,
) -> str:
    """The refusal: what ran when memory ran out, and the flags that lower it (and under a cap
    below the card's memory, the flag that raises the cap)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    why = ". ".join(first.split(". ")[:2])
    seq = f"--max-batch-size {eng.max_batch_size}, --max-seq-len {eng.max_seq_len}"
    if not prefilling:  # the fillers' first step: the prefill budget plays no part
        what = f"{fillers} requests of up to {eng.max_seq_len:,} tokens decoding ({seq})"
        flags = "lower --max-batch-size or --max-seq-len"
    else:
        budget = eng.max_prefill_tokens
        what = (
            f"{plan.real} prompt(s) of {plan.real_prompt:,} tokens prefilled (--max-prefill-tokens "
            f"{'unbounded' if budget is None else budget}) beside {fillers} requests of up to "
            f"{eng.max_seq_len:,} tokens decoding ({seq})"
        )
        flags = "lower --max-batch-size, --max-seq-len or --max-prefill-tokens"
    if capped:
        flags += f", or raise {CAP_FLAG}"
    held = f" ({_peak_of(peak, total, capped)})" if total else ""
    return f"out of GPU memory at the start-up memory check, with {what}{held}: {flags} ({why})"
