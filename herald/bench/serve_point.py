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


class ServedPoints:
    """The throughput points of the served configuration, on the served model ``net`` (engine
    settings ``engine``) at ``steps`` per block. Offloading modes share one CPU pool, sized for
    the largest of ``points`` ((context, batch) pairs), as a model's points share one in the
    throughput benchmark; :meth:`close` frees it."""

    def __init__(
        self, net: Any, config: Any, device: torch.device, engine: EngineConfig, variant: str,
        steps: int, points: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        self.net, self.config, self.device, self.engine = net, config, device, engine
        self.variant, self.steps, self.points = variant, steps, points
        self.pool: Any = None

    def _settings(self) -> Any:
        from herald.bench import throughput_point as tp

        ps = tp.PointSettings(self.net, self.config, self.device, kv_pad=self.engine.kv_pad,
                              dense_kv_pad=self.engine.kv_pad)  # fmt: skip
        off = self.engine.offload
        if off is not None and self.pool is None:
            b = self.config.block_size
            pages = max(n * tp.pages_per_request(c, ps.new_tokens, b) for c, n in self.points)
            num_dense = min(off.num_dense_layers, self.config.num_layers)
            self.pool = tp.new_cpu_pool(self.config, num_dense, pages)
        ps.cpu_pool = self.pool
        return ps

    def measure(self, context: int, batch: int) -> dict[str, Any]:
        """The point at ``context`` and ``batch``: ``status`` (ok, oom, dram or error, as the
        throughput benchmark classifies a failure), ``decode_tokens_per_s`` (None unless ok)
        and ``wall_s``."""
        from herald.bench import throughput_point as tp

        off = self.engine.offload
        budget = off.kv_budget if off is not None else None
        sweep = Sweep("serve", "served", context, self.variant, budget, None, self.steps, (batch,))
        rec: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            m = tp.measure_point(self._settings(), sweep, batch)
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
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        rec["wall_s"] = time.perf_counter() - t0
        return rec

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool = None
