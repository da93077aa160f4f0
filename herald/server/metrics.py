"""ServerMetrics: the Prometheus metrics of one server, in their own registry.

Updated by the engine thread after every step (``prometheus_client`` is thread-safe): requests,
batch size, tokens, step time and, in the offloading modes, each block's main stream, retrieval
stream and block-boundary stall (from ``EngineStats.blocks``). ``GET /metrics`` sets the KV
memory gauges (:meth:`herald.engine.base.Engine.usage`) and renders Prometheus text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from herald.kv.manager import KVUsage

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]


_BLOCK_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Requests, batch size, tokens, step and block timings, KV pool usage (CPU and GPU)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("herald_requests_running", "Requests decoding now", registry=r)
        self.waiting = Gauge("herald_requests_waiting", "Requests queued, not running", registry=r)
        self.generated = Counter(
            "herald_generated_tokens", "Generated tokens (completed blocks)", registry=r
        )
        self.tokens_per_second = Gauge(
            "herald_generation_tokens_per_second",
            "Generated tokens per second over the last 10 s",
            registry=r,
        )
        self.step_seconds = Histogram(
            "herald_engine_step_seconds",
            "Time of one engine step (admission + one batched forward)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.requests = Counter(
            "herald_requests", "HTTP generation requests by outcome", ["outcome"], registry=r
        )
        self.batch_size = Gauge(
            "herald_batch_size", "Rows in the engine's batch after the last step", registry=r
        )
        blocks = {
            "main": ("herald_block_main_stream_seconds", "Main stream time of one block"),
            "retrieval": (
                "herald_block_retrieval_stream_seconds",
                "Retrieval stream time of one block's selection (offloading modes)",
            ),
            "stall": (
                "herald_block_boundary_stall_seconds",
                "Main stream wait for the retrieval stream at a block boundary",
            ),
        }
        self.block = {
            k: Histogram(name, doc, buckets=_BLOCK_BUCKETS, registry=r)
            for k, (name, doc) in blocks.items()
        }
        self.cpu_pages_used = Gauge(
            "herald_cpu_kv_pool_pages_used", "CPU KV pool pages held by requests", registry=r
        )
        self.cpu_pages_total = Gauge(
            "herald_cpu_kv_pool_pages_total", "CPU KV pool pages (0: dense mode)", registry=r
        )
        self.gpu_slots_used = Gauge(
            "herald_gpu_kv_slots_used", "GPU KV slots (dense cache / sparse pool) used", registry=r
        )
        self.gpu_slots_total = Gauge(
            "herald_gpu_kv_slots_total", "GPU KV slots (max running requests)", registry=r
        )
        self.gpu_kv_bytes = Gauge(
            "herald_gpu_kv_bytes", "Bytes of KV memory allocated on the model device", registry=r
        )

    def observe_step(
        self, seconds: float, new_tokens: int, rate: float, running: int, waiting: int,
        batch_size: int,
    ) -> None:  # fmt: skip
        self.step_seconds.observe(seconds)
        self.generated.inc(new_tokens)
        self.tokens_per_second.set(rate)
        self.running.set(running)
        self.waiting.set(waiting)
        self.batch_size.set(batch_size)

    def observe_block(self, main: float, retrieval: float, stall: float) -> None:
        """One completed block's stream timings (seconds)."""
        self.block["main"].observe(main)
        self.block["retrieval"].observe(retrieval)
        self.block["stall"].observe(stall)

    def set_pools(self, usage: KVUsage) -> None:
        self.cpu_pages_used.set(usage.cpu_pages_used)
        self.cpu_pages_total.set(usage.cpu_pages_total)
        self.gpu_slots_used.set(usage.gpu_slots_used)
        self.gpu_slots_total.set(usage.gpu_slots_total)
        self.gpu_kv_bytes.set(usage.gpu_kv_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
