"""One point of the throughput benchmark: one engine at one batch size, timed over a few blocks.

The engine is built for the point, every request is admitted at once with a synthetic prefill
(random KV: decode speed does not depend on KV values, and a real 32 x 32K-token prefill takes
over a minute), then it decodes ``warmup`` blocks (one-time costs: CUDA graph capture,
torch.compile of new shapes, the first block's prefill) and ``timed`` blocks, B = 32 tokens per
block in fixed T steps, EOS ignored. Decode throughput = tokens generated in the timed blocks /
their wall time (host clock between block boundaries, main stream synchronised).

A mixed point (:attr:`~herald.bench.throughput_plan.Sweep.contexts`, ``--mixed-contexts``) admits
the same prompts cut to :func:`~herald.bench.throughput_plan.mixed_context_lengths`, so each row
has its own KV length, as a server's requests do; its engine, sizes (sequence length, CPU pool
pages, the DRAM check: all from the longest, ``context``) and schedule are the uniform point's.

Some one-time costs fall inside the timed blocks however many blocks warm up, and a serving
process pays them once, not per block; points of such engines **rehearse**
(:attr:`~herald.bench.throughput_plan.Variant.rehearses`): they decode the same requests' warm-up
and timed blocks once, abort them, admit them again and time the second pass
(``rec["rehearsal"]`` keeps the first pass's numbers). On the H200:
- dense: its attention key length grows by one block per block (its ``kv_pad`` is 0: a uniform
  batch needs no mask), and each new length costs an attention plan (40-70 ms in a block's
  first step);
- the draft lookahead (HERALD): its (batch, 2B) forward runs once per block, eagerly the first
  time and captured into a CUDA graph the second, i.e. in the first timed block (about 60 ms
  in its step 1).
The other offloading modes attend over pools of a fixed padded length with forwards of one
shape, which the warm-up block runs twice or more.

For offloading modes the CPU full KV pool is shared by every point of a model (allocated, filled
with random values and pinned once, see :func:`new_cpu_pool`); the pages a request is given hold
those random values, which is all the synthetic prefill needs on the CPU side.

A point that does not fit raises; :func:`classify_failure` names it ``oom`` (GPU memory),
``dram`` (CPU pool or DRAM) or ``error``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from herald.attention.sdpa import padded_kv_len
from herald.bench.ceilings import KVGeometry, budget_rows
from herald.bench.common import random_prompts
from herald.bench.throughput_plan import MIXED, VARIANTS, Sweep, mixed_context_lengths
from herald.config import DEFAULT_KV_PAD, EngineConfig, OffloadConfig, SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.hooks import EngineHooks, SyntheticPrefill
from herald.engine.request import Request
from herald.kv.cpu_pool import CpuKVPool, CpuPoolFullError
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig
from herald.offload.engine import OffloadEngine
from herald.offload.selection.cpu import gather_selected, select_topk

_GIB = 1 << 30


class DramBoundError(RuntimeError):
    """The point needs more CPU memory (pool pages or staging) than there is."""


def classify_failure(exc: BaseException) -> str:
    """``oom`` for GPU memory (any exception in the cause chain), ``dram`` for CPU pool / DRAM /
    pinning, ``error`` otherwise."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, torch.OutOfMemoryError) or "CUDA out of memory" in text:
            return "oom"
        if "CUBLAS_STATUS_ALLOC_FAILED" in text or "CUDNN_STATUS_ALLOC_FAILED" in text:
            return "oom"
        if isinstance(seen, CpuPoolFullError | DramBoundError | MemoryError):
            return "dram"
        if "DefaultCPUAllocator" in text or "cudaHostRegister" in text:
            return "dram"
        seen = seen.__cause__ or seen.__context__
    return "error"


def mem_available_gib() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


# -- the CPU pool ---------------------------------------------------------------------------------


def fill_random_(t: torch.Tensor, seed: int = 0, chunk: int = 1 << 25) -> None:
    """Fill a contiguous tensor with N(0, 1) values: one random chunk tiled by copies (a random
    number per element of a 100 GiB pool would take minutes; speed needs no fresh values)."""
    flat = t.view(-1)
    g = torch.Generator().manual_seed(seed)
    # an odd chunk length, so that pages and heads do not all see the same values
    n = min(flat.numel(), chunk - 7)
    src = torch.randn(n, generator=g).to(t.dtype)
    for i in range(0, flat.numel(), n):
        m = min(n, flat.numel() - i)
        flat[i : i + m].copy_(src[:m])


def new_cpu_pool(config: ModelConfig, num_dense: int, num_pages: int) -> CpuKVPool:
    """A CPU KV pool of ``num_pages`` pages (B tokens each) for the model's offloaded layers,
    filled with random values; pinned when CUDA is available (the pool itself decides)."""
    pool = CpuKVPool(
        config.num_layers - num_dense,
        config.num_kv_heads,
        config.head_dim,
        config.block_size,
        num_pages,
    )
    fill_random_(pool.storage)
    return pool


def pages_per_request(context: int, new_tokens: int, block_size: int) -> int:
    """CPU pool pages one request takes (:meth:`KVManager.pages_needed`): its canvas in
    whole blocks, plus the draft / scratch page."""
    return math.ceil((context + new_tokens) / block_size) + 1


# -- engines ------------------------------------------------------------------------------------


@dataclass
class PointSettings:
    """What every point of a run shares."""

    model: BlockDiffusionLM
    config: ModelConfig
    device: torch.device
    warmup_blocks: int = 1
    timed_blocks: int = 2
    slow_block_s: float = 15.0
    """Time only one block when a warm-up block took longer than this (slow baselines)."""
    offload_cuda_graph: bool = True
    kv_pad: int = DEFAULT_KV_PAD
    """The offloading engines' kv_pad."""
    dense_kv_pad: int = 0
    """The dense engine's (uniform batches: no mask needed, the faster dense)."""
    real_prefill: bool = False
    selection_threads: int | None = None
    dram_reserve_gib: float = 4.0
    """DRAM kept free beyond the point's staging buffers."""
    cpu_pool: CpuKVPool | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def new_tokens(self) -> int:
        # one block more than decoded, so that no request finishes inside the timed window
        return (self.warmup_blocks + self.timed_blocks + 1) * self.config.block_size


def kv_geometry(config: ModelConfig, num_dense: int) -> KVGeometry:
    return KVGeometry(config.num_layers - num_dense, config.num_kv_heads, config.head_dim)


def _staging_bytes(
    cfg: OffloadConfig, config: ModelConfig, batch: int, seq: int, kv_pad: int
) -> int:
    """Pinned host staging (bytes, bf16) an offloading engine allocates for ``batch`` requests
    of ``seq`` tokens: the block hand-off's, [L', 2, slots, Hkv, B, D]; with the representative
    query, the retrieval worker's, one [2, slots, Hkv, capacity, D] per offloaded layer (the
    sparse pool's capacity, k_cap + 3B padded to ``kv_pad``); with CPU-gathered rows (InfiniGen,
    MAGE with CPU selection), one layer's, [2, slots, Hkv, <= k_cap + 3B, D], reused layer after
    layer (``OffloadEngine.gather_and_write``); MAGE with GPU selection fetches whole pages
    without staging. An upper bound; a test checks it against what each engine pins (on the
    CPU: with the GPU fetch, ``HERALD_FETCH``, the retrieval worker pins only the positions,
    int32, so on CUDA this bounds it from far above)."""
    b = config.block_size
    k_cap = math.ceil(cfg.kv_budget * (-(-seq // b) * b))
    layers = config.num_layers - min(cfg.num_dense_layers, config.num_layers)
    if cfg.selection_queries == "representative":
        gathered = layers * padded_kv_len(k_cap + 3 * b, kv_pad)
    elif cfg.selection_queries == "block" and cfg.selection_device == "gpu":
        gathered = 0
    else:
        gathered = k_cap + 3 * b
    per_row = 2 * batch * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    return (layers * b + gathered) * per_row


def build_engine(ps: PointSettings, sweep: Sweep, batch: int) -> tuple[Any, OffloadConfig | None]:
    """The point's engine (not yet holding requests); raises DramBoundError up front when the
    CPU pool or DRAM cannot hold the batch."""
    seq = sweep.context + ps.new_tokens
    var = VARIANTS[sweep.variant]
    if not var.offload:
        hooks = None if ps.real_prefill else EngineHooks(synthetic_prefill=SyntheticPrefill())
        ecfg = EngineConfig(max_batch_size=batch, max_seq_len=seq, kv_pad=ps.dense_kv_pad)
        return DenseEngine(ps.model, ps.config, ecfg, hooks), None
    assert sweep.budget is not None and ps.cpu_pool is not None
    cfg = var.offload_config(sweep.budget, ps.selection_threads)
    need = batch * pages_per_request(sweep.context, ps.new_tokens, ps.config.block_size)
    if need > ps.cpu_pool.num_free_pages:
        raise DramBoundError(
            f"CPU pool holds {ps.cpu_pool.num_pages} pages "
            f"({ps.cpu_pool.nbytes / _GIB:.1f} GiB), batch {batch} needs {need}"
        )
    avail = mem_available_gib()
    staging = _staging_bytes(cfg, ps.config, batch, seq, ps.kv_pad) / _GIB
    if avail is not None and staging + ps.dram_reserve_gib > avail:
        raise DramBoundError(
            f"pinned staging {staging:.1f} GiB + reserve {ps.dram_reserve_gib:.0f} GiB > "
            f"{avail:.1f} GiB of DRAM available"
        )
    # Synthetic prefill: the pool pages already hold random values (new_cpu_pool), so only the
    # GPU side (dense layers' KV, first block's sparse pool) is filled per request.
    hooks = None
    if not ps.real_prefill:
        hooks = EngineHooks(synthetic_prefill=SyntheticPrefill(cpu_pages=False))
    ecfg = EngineConfig(
        max_batch_size=batch, max_seq_len=seq, use_cuda_graph=ps.offload_cuda_graph,
        kv_pad=ps.kv_pad, offload=cfg,
    )  # fmt: skip
    offload_engine = OffloadEngine(ps.model, ps.config, ecfg, hooks, cpu_pool=ps.cpu_pool)
    return offload_engine, cfg


# -- timing -------------------------------------------------------------------------------------


def _sync_main(device: torch.device) -> Callable[[], None]:
    if device.type != "cuda":
        return lambda: None
    # NOTE: the main stream only: a device-wide synchronize would also wait for the retrieval
    # stream's copies and perturb the overlap being measured.
    return lambda: torch.cuda.current_stream(device).synchronize()


def run_blocks(engine: Any, reqs: list[Request], ps: PointSettings, steps: int) -> dict[str, Any]:
    """Step ``engine`` through the warm-up and timed blocks; per-step host times and block
    boundaries. The first step admits (prefills) every request."""
    b = ps.config.block_size
    first = reqs[0]
    start0 = first.layout.first_block_start
    sync = _sync_main(ps.device)
    # a rehearsed point's engine ran one pass before: its prefill time and its blocks' stats
    prefill0 = engine.stats.prefill_seconds
    blocks0 = len(engine.stats.blocks)
    warm, target = ps.warmup_blocks, ps.warmup_blocks + ps.timed_blocks
    marks: list[float] = []  # host clock at each block boundary
    tokens: list[int] = []  # generated tokens so far, at each boundary
    blocks: list[list[float]] = []
    cur: list[float] = []
    t_begin = time.perf_counter()
    max_steps = (target + 1) * (steps + 2) * 2
    num_steps = 0
    while len(marks) < target:
        t0 = time.perf_counter()
        engine.step()
        cur.append(time.perf_counter() - t0)
        num_steps += 1
        if num_steps == 1 and len(engine.batch) != len(reqs):
            raise DramBoundError(f"only {len(engine.batch)} of {len(reqs)} requests admitted")
        if (first.block_start - start0) // b > len(marks):
            sync()
            marks.append(time.perf_counter())
            tokens.append(sum(len(r.output_ids) for r in reqs))
            blocks.append(cur)
            cur = []
            if len(marks) == warm and target - warm > 1:
                prev = marks[-2] if warm > 1 else t_begin + engine.stats.prefill_seconds - prefill0
                if marks[-1] - prev > ps.slow_block_s:
                    target = warm + 1
        if num_steps > max_steps:
            raise RuntimeError(f"no block completed in {num_steps} steps")
    timed = blocks[warm:]
    plain = [x for blk in timed for x in blk[2:-1]] or [x for blk in timed for x in blk]
    out: dict[str, Any] = {
        "timed_blocks": len(timed),
        "decode_seconds": marks[-1] - marks[warm - 1],
        "generated_tokens": tokens[-1] - tokens[warm - 1],
        "block_seconds": [marks[i] - marks[i - 1] for i in range(warm, len(marks))],
        "warmup_seconds": marks[warm - 1] - t_begin,
        "steps_per_block": [len(blk) for blk in timed],
        "step_seconds": [[round(x, 5) for x in blk] for blk in timed],
        "forward_median_s": statistics.median(plain),
        "step0_median_s": statistics.median(blk[0] for blk in timed),
        "step1_median_s": statistics.median(blk[1] for blk in timed if len(blk) > 1)
        if all(len(blk) > 1 for blk in timed)
        else None,
        "commit_median_s": statistics.median(blk[-1] for blk in timed),
    }
    out["decode_tokens_per_s"] = out["generated_tokens"] / out["decode_seconds"]
    stats_blocks = engine.stats.blocks  # offloading engines time their lockstep blocks
    if stats_blocks:
        mine = stats_blocks[blocks0 + warm : blocks0 + warm + len(timed)]
        out["block_main_s"] = [x.main for x in mine]
        out["block_retrieval_s"] = [x.retrieval for x in mine]
        out["block_stall_s"] = [x.stall for x in mine]
        if all(getattr(x, "retrieval_start", None) is not None for x in mine):
            out["block_retrieval_start_s"] = [x.retrieval_start for x in mine]
            out["block_retrieval_end_s"] = [x.retrieval_end for x in mine]
        if all(getattr(x, "retrieval_layers", None) for x in mine):
            # the retrieval stream's host seconds per block, summed over the offloaded layers:
            # query to host, CPU kernel, gather + copies
            out["block_retrieval_parts_s"] = [dict(x.retrieval_layers) for x in mine]
    return out


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_selection(
    pool: CpuKVPool,
    config: ModelConfig,
    batch: int,
    context: int | list[int],
    n_q: int,
    budget: float,
    output_mode: str,
    threads: int | None,
    reps: int = 2,
) -> dict[str, Any] | None:
    """The CPU selection kernel and the gather of its rows for one offloaded layer of ``batch``
    requests of ``context`` tokens (one per request, or the same for all) plus a B-token tail
    (as HERALD's draft), on the pool's own random pages; ``block_s`` = (select + gather) x
    offloaded layers; ``k_rows``: the longest request's budget. None if the pool is too small."""
    b, d = config.block_size, config.head_dim
    npgs = [c // b for c in (context if isinstance(context, list) else [context] * batch)]
    npg = max(npgs)
    if batch * (npg + 1) > pool.num_pages:
        return None
    table = torch.arange(batch * (npg + 1), dtype=torch.int32).view(batch, npg + 1)
    seq = torch.tensor([n * b + b for n in npgs], dtype=torch.int32)
    tail = torch.full((batch,), b, dtype=torch.int32)
    k = max(1, budget_rows(budget, npg * b))
    bud = torch.tensor([max(1, budget_rows(budget, n * b)) for n in npgs], dtype=torch.int32)
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, n_q, config.num_heads, d, generator=g).bfloat16()
    kp, vp = pool.k_pages(0), pool.v_pages(0)
    res = select_topk(
        q, kp, vp, table, seq, bud, tail_lens=tail, output_mode=output_mode, num_threads=threads
    )

    def sel() -> object:
        return select_topk(
            q, kp, vp, table, seq, bud, tail_lens=tail, output_mode=output_mode,
            num_threads=threads,
        )  # fmt: skip

    t_sel = _best(sel, reps)
    out = torch.empty(2, batch, config.num_kv_heads, res.indices.shape[-1], d, dtype=kp.dtype)

    def gather() -> object:
        return gather_selected(
            kp, vp, table, res.indices, res.num_selected, out=out, num_threads=threads
        )

    t_gather = _best(gather, reps)
    return {
        "n_q": n_q,
        "output_mode": output_mode,
        "k_rows": k,
        "layer_select_s": t_sel,
        "layer_gather_s": t_gather,
        "num_layers": pool.num_layers,
        "block_s": (t_sel + t_gather) * pool.num_layers,
    }


_REHEARSAL_KEYS = ("decode_tokens_per_s", "step0_median_s", "forward_median_s", "decode_seconds")


def measure_point(ps: PointSettings, sweep: Sweep, batch: int) -> dict[str, Any]:
    """Build, fill and time one point; the record's measured fields (the caller adds the rest).

    Raises whatever the engine raises (out of memory included); the engine is closed and freed
    before the exception leaves.
    """
    import gc

    var = VARIANTS[sweep.variant]
    b = ps.config.block_size
    if ps.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ps.device)
    lengths = mixed_context_lengths(sweep.context, batch, b)
    rec: dict[str, Any] = {}
    t0 = time.perf_counter()
    engine: Any = None
    try:
        engine, cfg = build_engine(ps, sweep, batch)
        rec["engine_setup_seconds"] = time.perf_counter() - t0
        if cfg is not None:
            rec["output_mode"] = cfg.output_mode
            rec["selection"] = {
                "device": cfg.selection_device,
                "queries": cfg.selection_queries,
                "lookahead": cfg.lookahead,
            }
            rec["num_dense_layers"] = engine.num_dense
            rec["gpu_pool_gib"] = engine.pool.num_bytes / _GIB
            rec["selection_threads"] = getattr(engine, "selection_threads", ps.selection_threads)
        params = SamplingParams(
            max_new_tokens=ps.new_tokens, num_denoise_steps=sweep.steps, ignore_eos=True
        )
        prompts = random_prompts(ps.config, batch, sweep.context, seed=batch)
        if sweep.contexts == MIXED:  # the same tokens, each prompt cut to its own length
            prompts = [p[:n] for p, n in zip(prompts, lengths, strict=True)]
        reqs = [engine.add_request(p, params) for p in prompts]
        if var.rehearses:
            # see the module docstring: the timed pass must not pay one-time costs
            first = run_blocks(engine, reqs, ps, sweep.steps)
            rec["rehearsal"] = {k: first[k] for k in _REHEARSAL_KEYS}
            for r in reqs:
                engine.abort(r)
            reqs = [engine.add_request(p, params) for p in prompts]
        prefill0, ptok0 = engine.stats.prefill_seconds, engine.stats.num_prefill_tokens
        rec.update(run_blocks(engine, reqs, ps, sweep.steps))
        rec["prefill_seconds"] = engine.stats.prefill_seconds - prefill0
        rec["prefill_tokens"] = engine.stats.num_prefill_tokens - ptok0
        if ps.cuda:
            rec["peak_gpu_gib"] = torch.cuda.max_memory_allocated(ps.device) / _GIB
    finally:
        if engine is not None and hasattr(engine, "close"):
            engine.close()
        engine = None
        gc.collect()
        if ps.cuda:
            torch.cuda.empty_cache()
    n_q = var.cpu_selection_queries(b)
    if n_q is not None and ps.cpu_pool is not None and sweep.budget is not None:
        rec["selection_kernel"] = time_selection(
            ps.cpu_pool,
            ps.config,
            batch,
            lengths if sweep.contexts == MIXED else sweep.context,
            n_q,
            sweep.budget,
            rec.get("output_mode", "full"),
            rec.get("selection_threads", ps.selection_threads),
        )
    return rec
