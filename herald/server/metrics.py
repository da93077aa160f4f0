"""ServerMetrics: the Prometheus metrics of one server, in their own registry.

Updated by the engine thread after every step (``prometheus_client`` is thread-safe): requests,
batch size, generated and prompt tokens and their rates, the engine's prefill and decode seconds
(from ``EngineStats``), step time and, in the offloading modes, each block's main stream,
retrieval stream and block-boundary stall (from ``EngineStats.blocks``); per request, as its
blocks are pushed to it: time to first token, time between its blocks, end-to-end latency.
``GET /metrics`` sets the KV memory gauges (:meth:`herald.engine.base.Engine.usage`) and renders
Prometheus text. Counters are rendered with a ``_total`` suffix (``herald_prompt_tokens_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from herald.kv.manager import KVUsage

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]


_BLOCK_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 60.0, 120.0)  # fmt: skip
"""Per-request latencies: 1 ms to 120 s (above: the +Inf bucket)."""


class ServerMetrics:
    """Requests, batch size, tokens, prefill / decode time, step, block and per-request
    timings, KV pool usage (CPU and GPU)."""

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
            "Generated tokens in the last 10 s over 10 s (over the time since the first step when "
            "shorter)",
            registry=r,
        )
        self._add_prefill_and_request_metrics(r)
        self.step_seconds = Histogram(
            "herald_engine_step_seconds",
            "Time of one engine step (admission + one batched forward)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.requests = Counter(
            "herald_requests",
            "HTTP generation requests by outcome (ok, error, aborted, rejected: 503, invalid: 400)",
            ["outcome"],
            registry=r,
        )
        self.batch_size = Gauge(
            "herald_batch_size", "Rows in the engine's batch after the last step", registry=r
        )
        self.batch_rows = Counter(
            "herald_batch_rows",
            "Rows of the engine's decode forwards, summed (over herald_decode_forwards: the mean "
            "batch size)",
            registry=r,
        )
        self.forwards = Counter(
            "herald_decode_forwards",
            "The engine's decode forwards (one per step that ran one)",
            registry=r,
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

    def _add_prefill_and_request_metrics(self, r: CollectorRegistry) -> None:
        """Prompt tokens and their rate, engine prefill / decode seconds, per-request latencies."""
        self.prompt_tokens = Counter(
            "herald_prompt_tokens",
            "Prompt tokens of the requests that joined the batch",
            registry=r,
        )
        self.prefill_tokens_per_second = Gauge(
            "herald_prefill_tokens_per_second",
            "Prompt tokens of the requests that joined the batch in the last 10 s over 10 s",
            registry=r,
        )
        self.prefill_seconds = Counter(
            "herald_prefill_seconds", "Engine seconds spent prefilling prompts", registry=r
        )
        self.decode_seconds = Counter(
            "herald_decode_seconds", "Engine seconds spent in decode forwards", registry=r
        )
        self.idle_seconds = Counter(
            "herald_engine_idle_seconds",
            "Engine thread seconds with nothing to run (no request queued or running)",
            registry=r,
        )
        self.publish_seconds = Counter(
            "herald_engine_publish_seconds",
            "Engine thread seconds spent handing steps' tokens to the HTTP side and metrics",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "herald_time_to_first_token_seconds",
            "Per request: submitted to its first tokens pushed (its first block)",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.time_per_output_block = Histogram(
            "herald_time_per_output_block_seconds",
            "Per request: time between two consecutive pushes of its blocks",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "herald_e2e_request_latency_seconds",
            "Per request: submitted to finished (stop or length; not errors or aborts)",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )

    def observe_step(
        self, seconds: float, new_tokens: int, rate: float, running: int, waiting: int,
        batch_size: int, *, prompt_tokens: int, prompt_rate: float, prefill_seconds: float,
        decode_seconds: float, batch_rows: int = 0, forwards: int = 0,
    ) -> None:  # fmt: skip
        """One engine step: its time, the tokens it generated and prefilled, the engine seconds
        it added to prefill and decode (all >= 0) and the trailing rates (tokens/s)."""
        self.step_seconds.observe(seconds)
        self.generated.inc(new_tokens)
        self.tokens_per_second.set(rate)
        self.prompt_tokens.inc(prompt_tokens)
        self.prefill_tokens_per_second.set(prompt_rate)
        self.prefill_seconds.inc(prefill_seconds)
        self.decode_seconds.inc(decode_seconds)
        self.running.set(running)
        self.waiting.set(waiting)
        self.batch_size.set(batch_size)
        self.batch_rows.inc(batch_rows)
        self.forwards.inc(forwards)

    def observe_push(self, since_submit: float, since_last_push: float | None) -> None:
        """A request's tokens were pushed: ``since_last_push`` None for its first push (time to
        first token ``since_submit``), else the time since its previous one (seconds)."""
        if since_last_push is None:
            self.time_to_first_token.observe(since_submit)
        else:
            self.time_per_output_block.observe(since_last_push)

    def observe_finished(self, since_submit: float) -> None:
        """A request finished by stop or length ``since_submit`` seconds after its submit."""
        self.e2e_request_latency.observe(since_submit)

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
