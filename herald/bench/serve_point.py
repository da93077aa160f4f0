"""The ``herald bench throughput`` figure beside a ``herald bench serve`` level.

The throughput benchmark's point (:func:`herald.bench.throughput_point.measure_point`) for the
served configuration: the served model itself (same weights and dtype, measured once the server
has stopped), the throughput variant whose engine settings equal the server's (dense, or the
offloading mode with the same :class:`~herald.config.OffloadConfig`), the level's prompt length
as the context, its concurrency as the batch, the same steps per block and the server's
``kv_pad``. What differs is what the throughput benchmark is: every request admitted at once
with a synthetic prefill, decode throughput over timed blocks, no HTTP.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch

from herald.bench.throughput_plan import VARIANTS, Sweep
from herald.config import EngineConfig, OffloadConfig


def throughput_variant(mode: str, offload: OffloadConfig | None) -> str | None:
    """The throughput variant whose engine is the served one, None when there is none."""
    plain = None if offload is None else dataclasses.replace(
        offload, cpu_kv_gb=None, cpu_kv_tokens=None
    )  # fmt: skip
    for name, var in VARIANTS.items():
        if var.mode != mode:
            continue
        if plain is None:
            return name
        if var.offload_config(plain.kv_budget, plain.selection_threads) == plain:
            return name
    return None


def throughput_command(
    model: str, device: str, variant: str, budget: float | None, context: int,
    batches: list[int], steps: int, kv_pad: int,
) -> str:  # fmt: skip
    """The ``herald bench throughput`` command that measures the same points on its own."""
    cmd = f"herald bench throughput --device {device} --model {model} --context {context} "
    cmd += f"--mode {variant} "
    if budget is not None:
        cmd += f"--kv-budget {budget:g} "
    batch_list = ",".join(map(str, batches))
    return cmd + (
        f"--batches {batch_list} --steps {steps} --kv-pad {kv_pad} --dense-kv-pad {kv_pad} "
        "--out OUT/throughput"
    )


def measure_point(
    net: Any, config: Any, device: torch.device, engine: EngineConfig,
    variant: str, context: int, batch: int, steps: int,
) -> dict[str, Any]:  # fmt: skip
    """The throughput point at ``context`` and ``batch`` on the served model ``net`` (engine
    settings ``engine``): ``status`` (ok, oom, dram or error, as the throughput benchmark
    classifies a failure), ``decode_tokens_per_s`` (None unless ok) and ``wall_s``."""
    from herald.bench import throughput_point as tp

    budget = engine.offload.kv_budget if engine.offload is not None else None
    ps = tp.PointSettings(net, config, device, kv_pad=engine.kv_pad, dense_kv_pad=engine.kv_pad)
    sweep = Sweep("serve", "served", context, variant, budget, None, steps, (batch,))
    rec: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        if engine.offload is not None:
            pages = batch * tp.pages_per_request(context, ps.new_tokens, config.block_size)
            num_dense = min(engine.offload.num_dense_layers, config.num_layers)
            ps.cpu_pool = tp.new_cpu_pool(config, num_dense, pages)
        m = tp.measure_point(ps, sweep, batch)
        rec |= {
            "status": "ok",
            "decode_tokens_per_s": m["decode_tokens_per_s"],
            "forward_median_s": m["forward_median_s"],
            "timed_blocks": m["timed_blocks"],
        }
    except Exception as e:  # noqa: BLE001  (recorded as the throughput benchmark records it)
        rec |= {"status": tp.classify_failure(e), "decode_tokens_per_s": None,
                "error": f"{type(e).__name__}: {str(e)[:300]}"}  # fmt: skip
    finally:
        if ps.cpu_pool is not None:
            ps.cpu_pool.close()
        ps.cpu_pool = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rec["wall_s"] = time.perf_counter() - t0
    return rec
