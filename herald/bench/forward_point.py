"""One point of the forward benchmark: one engine at one context and batch, its forwards timed.

The engine is built as the throughput benchmark builds it (:func:`herald.bench.throughput_point.
build_engine`: synthetic prefill, random KV, a shared random CPU pool for HERALD), every request
is admitted, and one engine step runs the first block's step 0 (HERALD: its draft too). The
engine then sits at step 1 of the block, and each mode's forward is called as the engine calls
it, CUDA-graph replays included (:class:`ForwardCall`):

- ``dense``: ``attn.prepare`` + ``runner.forward`` of the B-token block over the dense cache;
- ``herald``: the offloading core's ``_prepare`` + ``runner.forward``: a main-stream denoising
  forward over the active sparse pool (no retrieval job is in flight at step 1, so nothing else
  runs on the GPU meanwhile);
- ``herald-draft``: the fused draft step, the (batch, 2B) forward of the block and its draft.

A forward rewrites the current tokens' K/V rows with the same values, so it can be repeated.
Time: median over ``reps`` calls after ``warmup`` (CUDA events around each call on CUDA, host
clock on the CPU; the device idle at each start). Then, for MoE models, one eager forward with
hooks counts the distinct experts its routing picks (the floor's weight bytes), and with
``profile`` a few forwards run under torch.profiler (:mod:`herald.bench.forward_profile`).
Last, ``step_blocks`` whole blocks of engine steps are timed (:func:`~herald.bench.
throughput_point.run_blocks`): the step medians include the logits, sampling and host syncs, and
HERALD's main-stream steps overlap its retrieval stream, as when serving.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from herald.attention.sdpa import padded_kv_len
from herald.bench import forward_floor as ff
from herald.bench import throughput_point as tp
from herald.bench.common import random_prompts
from herald.bench.forward_profile import expert_tbps, profile_forward
from herald.bench.forward_report import ctx_label
from herald.bench.throughput_plan import VARIANTS, Sweep
from herald.bench.throughput_run import pool_page_bytes
from herald.config import DEFAULT_KV_PAD, SamplingParams
from herald.models.config import ModelConfig

HERALD_VARIANT = "herald-selected"
"""The throughput benchmark's variant the HERALD points build (the herald preset as served)."""
_GIB = 1 << 30


@dataclass
class Settings:
    """What every point of a run shares."""

    device: torch.device
    warmup: int = 3
    reps: int = 20
    profile: bool = False
    profile_reps: int = 3
    steps: int = 20
    step_blocks: int = 2
    budget: float = 0.05
    selection_threads: int | None = None
    kv_pad: int = DEFAULT_KV_PAD
    dense_kv_pad: int = 0
    hbm_tbps: float = ff.HBM_TBPS
    peak_tflops: float = ff.PEAK_TFLOPS
    dram_reserve_gib: float = 4.0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def new_tokens(self, block_size: int) -> int:
        """Tokens each request decodes at most: its warm-up block, the timed blocks, one more."""
        return (max(1, self.step_blocks) + 2) * block_size


def engine_kind(mode: str) -> str:
    return "dense" if mode == "dense" else "herald"


# -- memory, before anything is allocated ---------------------------------------------------------


def model_bytes(config: ModelConfig) -> int:
    """Every weight of the model (bf16), embedding table and LM head included."""
    g = ff.weight_geometry(config)
    return (
        g.dense_bytes
        + g.all_experts * g.expert_bytes
        + config.vocab_size * g.embedding_row_bytes
        + g.lm_head_bytes
    )


def store_bytes(config: ModelConfig, kind: str, context: int, batch: int, st: Settings) -> int:
    """The engine's KV stores on the model device, as the engines size them."""
    b = config.block_size
    seq = -(-(context + st.new_tokens(b)) // b) * b
    row = 2 * config.num_kv_heads * config.head_dim * ff.BF16 * batch  # K and V, every slot
    if kind == "dense":
        return config.num_layers * row * padded_kv_len(seq, st.dense_kv_pad)
    nd = min(ff.NUM_DENSE_LAYERS, config.num_layers)
    dense = nd * row * padded_kv_len(seq + b, st.kv_pad)
    cap = padded_kv_len(math.ceil(st.budget * seq) + 3 * b, st.kv_pad)
    return dense + 2 * (config.num_layers - nd) * row * cap


def activation_bytes(config: ModelConfig, kind: str, batch: int, cuda: bool) -> int:
    """A rough bound on the rest: the captured graphs' per-layer buffers for each forward shape,
    the MoE block's transient rows, the sampler's float32 logits, and workspaces (2 GiB on
    CUDA: cuBLAS, cuDNN, compiled kernels; 256 MiB on the CPU)."""
    b, h, d = config.block_size, config.hidden_size, config.head_dim
    tokens = batch * b * (3 if kind == "herald" else 1)  # the B and the 2B shapes
    per_layer = (2 * h + (2 * config.num_heads + 2 * config.num_kv_heads) * d) * ff.BF16
    moe = config.num_experts_per_tok * (2 * config.moe_intermediate_size + h)
    ffn = max(moe, 2 * config.intermediate_size) * ff.BF16 * 2
    logits = batch * b * config.vocab_size * 12
    workspace = 2 * _GIB if cuda else _GIB // 4
    return tokens * (config.num_layers * per_layer + ffn) + logits + workspace


def cpu_pool_pages(config: ModelConfig, context: int, batch: int, st: Settings) -> int:
    return batch * tp.pages_per_request(
        context, st.new_tokens(config.block_size), config.block_size
    )


def dram_bytes(config: ModelConfig, pool_pages: int, context: int, batch: int, st: Settings) -> int:
    """HERALD's host memory: the shared CPU pool and the point's pinned staging."""
    b = config.block_size
    cfg = VARIANTS[HERALD_VARIANT].offload_config(st.budget, st.selection_threads)
    seq = context + st.new_tokens(b)
    staging = tp._staging_bytes(cfg, config, batch, seq, st.kv_pad)
    return pool_pages * pool_page_bytes(config) + staging


@dataclass(frozen=True)
class Point:
    """One engine at one context and batch, and the modes timed on it."""

    model: str
    context: int
    batch: int
    modes: tuple[str, ...]

    @property
    def kind(self) -> str:
        return engine_kind(self.modes[0])

    @property
    def label(self) -> str:
        return f"{self.model} {ctx_label(self.context)} bs {self.batch} ({self.kind} engine)"


# -- memory, checked before anything is allocated -------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def _fits(
    label: str, cfg: Any, kind: str, dev: int, host: int, st: Settings, room: dict
) -> str | None:
    """None when a job needing ``dev`` bytes on the model device (besides the weights) and
    ``host`` bytes of DRAM fits, else the reason."""
    w = model_bytes(cfg)
    if st.cuda:
        if room["device"] is not None and w + dev > room["device"]:
            return (f"{label}: needs ~{_gib(w + dev)} of GPU memory (weights {_gib(w)}, KV stores "
                    f"and activations ~{_gib(dev)}), {_gib(room['device'])} free")  # fmt: skip
    else:
        host += w + dev
    need = host + st.dram_reserve_gib * _GIB
    if room["host"] is not None and host and need > room["host"]:
        what = "CPU KV pool, staging, " if kind == "herald" else ""
        return (f"{label}: needs ~{_gib(need)} of host memory ({what}reserve "
                f"{st.dram_reserve_gib:g} GiB), {_gib(room['host'])} available")  # fmt: skip
    return None


def check_memory(
    points: list[Point],
    prefill: list[tuple[str, int]],
    requests: int,
    configs: dict,
    st: Settings,
) -> dict[str, int]:
    """CPU pool pages per model (its largest HERALD point's); ValueError naming every point or
    prefill that would not fit in the device's free memory or the host's available DRAM."""
    avail = tp.mem_available_gib()
    room = {
        "device": torch.cuda.mem_get_info(st.device)[0] if st.cuda else None,
        "host": None if avail is None else avail * _GIB,
    }
    pools: dict[str, int] = {}
    problems = []
    for model, cfg in configs.items():
        mine = [p for p in points if p.model == model]
        pages = [cpu_pool_pages(cfg, p.context, p.batch, st) for p in mine if p.kind == "herald"]
        pools[model] = max(pages, default=0)
        for p in mine:
            dev = store_bytes(cfg, p.kind, p.context, p.batch, st)
            dev += activation_bytes(cfg, p.kind, p.batch, st.cuda)
            host = 0 if p.kind == "dense" else dram_bytes(cfg, pools[model], p.context, p.batch, st)
            problems.append(_fits(p.label, cfg, p.kind, dev, host, st, room))
        for kind, n in prefill:  # (engine kind, prompt tokens)
            temp = cfg.kv_bytes_per_token() * n if kind == "herald" else 0  # the prompt's KV
            dev = store_bytes(cfg, kind, n, requests, st) + temp
            dev += activation_bytes(cfg, kind, requests, st.cuda)
            pp = cpu_pool_pages(cfg, n, requests, st)
            host = 0 if kind == "dense" else dram_bytes(cfg, pp, n, requests, st)
            label = f"{model} prefill {ctx_label(n)} x {requests} {kind}"
            problems.append(_fits(label, cfg, kind, dev, host, st, room))
    bad = [x for x in problems if x]
    if bad:
        raise ValueError(
            "; ".join(bad) + " (estimates; lower --batches, --contexts or --prefill-prompts)"
        )
    return pools


# -- engines and their forwards -------------------------------------------------------------------


def point_settings(model: Any, config: ModelConfig, st: Settings, pool: Any) -> tp.PointSettings:
    return tp.PointSettings(
        model, config, st.device, warmup_blocks=1, timed_blocks=max(1, st.step_blocks),
        kv_pad=st.kv_pad, dense_kv_pad=st.dense_kv_pad, selection_threads=st.selection_threads,
        dram_reserve_gib=st.dram_reserve_gib, cpu_pool=pool,
    )  # fmt: skip


def open_engine(
    ps: tp.PointSettings, name: str, context: int, batch: int, kind: str, st: Settings
) -> tuple[Any, list[Any]]:
    """The point's engine holding ``batch`` requests of ``context`` random tokens, after its
    first step (admission, the first block's step 0)."""
    variant = "dense" if kind == "dense" else HERALD_VARIANT
    budget = None if kind == "dense" else st.budget
    sweep = Sweep("forward", name, context, variant, budget, None, st.steps, (batch,))
    engine, _ = tp.build_engine(ps, sweep, batch)
    try:
        cfg = ps.config
        params = SamplingParams(
            max_new_tokens=ps.new_tokens, num_denoise_steps=st.steps, ignore_eos=True
        )
        prompts = random_prompts(cfg, batch, context, seed=batch)
        reqs = [engine.add_request(p, params) for p in prompts]
        engine.step()
        if len(engine.batch) != batch:
            raise tp.DramBoundError(f"only {len(engine.batch)} of {batch} requests admitted")
    except BaseException:
        engine.close()
        raise
    return engine, reqs


@dataclass
class ForwardCall:
    """One forward exactly as the engine runs it: its attention prepared, then the runner
    (CUDA-graph replay once captured), under inference mode as the engine's step.
    :meth:`eager` runs the model itself instead.

    NOTE: outside inference mode a compiled piece's grad-mode guard fails and it recompiles
    inside the graph capture (the capture is then invalidated: cudaErrorStreamCaptureInvalidated
    on the H200), and the forward would record autograd state the engine never does."""

    engine: Any
    prepare: Callable[[], None]
    ids: torch.Tensor
    positions: torch.Tensor

    @torch.inference_mode()
    def __call__(self) -> torch.Tensor:
        self.prepare()
        out: torch.Tensor = self.engine.runner.forward(self.ids, self.positions, self.engine.attn)
        return out

    @torch.inference_mode()
    def eager(self) -> torch.Tensor:
        self.prepare()
        out: torch.Tensor = self.engine.model(self.ids, self.positions, self.engine.attn)
        return out


def forward_call(engine: Any, mode: str) -> ForwardCall:
    """The ``mode`` forward of ``engine`` at its current step (see the module docstring)."""
    ids, pos = engine.batch.inputs()
    b = engine.block_size
    if mode == "dense":
        starts = engine.batch.starts()
        return ForwardCall(engine, lambda: engine.attn.prepare(starts, b), ids, pos)
    try:  # the offloading core's own entry points (it runs these forwards in _denoise_step)
        prepare, draft, step = engine._prepare, engine._draft, engine._block_step
    except AttributeError as e:
        raise RuntimeError(f"the offloading engine's forward entry points changed: {e}") from e
    if mode == "herald":
        return ForwardCall(engine, prepare, ids, pos)
    if not engine.policy.drafts or step != 1 or draft.shape != ids.shape:
        raise RuntimeError("herald-draft: the engine has no draft at this step (lookahead off?)")
    both = torch.cat([pos, pos], dim=1)
    return ForwardCall(engine, lambda: prepare(2 * b, True), torch.cat([ids, draft], dim=1), both)


def time_forward(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> list:
    """Milliseconds of each of ``reps`` calls, after ``warmup`` calls."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def count_experts(call: ForwardCall) -> int | None:
    """Distinct routed experts one eager forward's routing picks, summed over the MoE layers
    (None for a model without them)."""
    from herald.layers.moe import SparseMoE

    moes = [m for m in call.engine.model.modules() if isinstance(m, SparseMoE)]
    if not moes:
        return None
    hits: list[int] = []

    def hook(module: SparseMoE, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0]
        idx, _ = module.route(x.reshape(-1, x.shape[-1]))
        hits.append(int(idx.unique().numel()))

    handles = [m.register_forward_pre_hook(hook) for m in moes]
    try:
        call.eager()
    finally:
        for h in handles:
            h.remove()
    return sum(hits)


# -- a point --------------------------------------------------------------------------------------


def measure_mode(engine: Any, name: str, mode: str, context: int, st: Settings) -> dict[str, Any]:
    """Time, floor and (with ``st.profile``) the kernel breakdown of one mode's forward."""
    config, batch = engine.config, len(engine.batch)
    call = forward_call(engine, mode)
    times = time_forward(call, st.device, st.warmup, st.reps)
    hit = count_experts(call) if config.is_moe else None
    nd = getattr(engine, "num_dense", ff.NUM_DENSE_LAYERS)
    budget = None if mode == "dense" else st.budget
    shape = ff.ForwardShape(mode, context, batch, config.block_size, budget, nd)
    fl = ff.floor(config, shape, experts_hit=hit, hbm_tbps=st.hbm_tbps, peak_tflops=st.peak_tflops)
    med = statistics.median(times)
    rec: dict[str, Any] = {
        "kind": "forward", "status": "ok", "model": name, "mode": mode, "context": context,
        "batch": batch, "budget": budget, "block_size": config.block_size,
        "device": st.device.type, "length": shape.length, "reps": st.reps, "warmup": st.warmup,
        "forward_ms": med, "forward_ms_min": min(times),
        "forward_ms_all": [round(t, 4) for t in times],
        "cuda_graph": bool(engine.runner.use_cuda_graph), "kv_pad": engine.kv_pad,
        "floor": fl, "forward_over_floor": med / fl["floor_ms"],
    }  # fmt: skip
    if mode != "dense":
        rec["pool_rows"] = max(engine.pool_prefix())  # selected + last block, as the floor's
        rec["num_dense_layers"] = nd
    target = ff.target_for(name, mode, context, batch, budget)
    if target is not None:
        limit = target.limit_ms(fl["floor_ms"])
        rec["target"] = {"text": target.describe(fl["floor_ms"]), "limit_ms": limit,
                         "met": med <= limit}  # fmt: skip
    if st.profile:
        prof = profile_forward(call, st.device, st.profile_reps)
        prof["expert_tbps"] = expert_tbps(prof, fl["expert_bytes"])
        rec["profile"] = prof
    return rec


_STEP_KEY = {"dense": "forward_median_s", "herald": "forward_median_s",
             "herald-draft": "step1_median_s"}  # fmt: skip


def measure_point(
    ps: tp.PointSettings, name: str, context: int, batch: int, modes: list[str], st: Settings
) -> list[dict[str, Any]]:
    """Every mode of one engine kind (``modes`` share it) at one context and batch: one record
    per mode. Raises what the engine raises (out of memory included) after closing it."""
    kind = engine_kind(modes[0])
    assert all(engine_kind(m) == kind for m in modes)
    if st.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(st.device)
    engine: Any = None
    t0 = time.perf_counter()
    try:
        engine, reqs = open_engine(ps, name, context, batch, kind, st)
        setup = time.perf_counter() - t0
        recs = [measure_mode(engine, name, mode, context, st) for mode in modes]
        if st.step_blocks:
            blocks = tp.run_blocks(engine, reqs, ps, st.steps)
            for rec in recs:
                step = blocks.get(_STEP_KEY[rec["mode"]])
                rec["step_ms"] = None if step is None else step * 1e3
                rec["steps"] = st.steps
                rec["step_blocks"] = blocks["timed_blocks"]
        for rec in recs:
            rec["engine_setup_seconds"] = setup
            if st.cuda:
                rec["peak_gpu_gib"] = torch.cuda.max_memory_allocated(st.device) / _GIB
        return recs
    finally:
        if engine is not None:
            engine.close()
        engine = None
        gc.collect()
        if st.cuda:
            torch.cuda.empty_cache()


def failed_records(
    name: str, context: int, batch: int, modes: list[str], st: Settings, exc: BaseException
) -> list[dict[str, Any]]:
    """The records of a point that failed: ``oom`` (GPU memory), ``dram`` or ``error``."""
    status = tp.classify_failure(exc)
    return [
        {"kind": "forward", "status": status, "model": name, "mode": m, "context": context,
         "batch": batch, "budget": None if m == "dense" else st.budget,
         "device": st.device.type, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        for m in modes
    ]  # fmt: skip
