"""ServerMetrics: the Prometheus metrics of one server, in their own registry.

Updated by the engine thread after every step (``prometheus_client`` is thread-safe) and
rendered as Prometheus text by ``GET /metrics``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]


class ServerMetrics:
    """Running / waiting requests, generated tokens, tokens/s and engine step time."""

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

    def observe_step(
        self, seconds: float, new_tokens: int, rate: float, running: int, waiting: int
    ) -> None:
        self.step_seconds.observe(seconds)
        self.generated.inc(new_tokens)
        self.tokens_per_second.set(rate)
        self.running.set(running)
        self.waiting.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
