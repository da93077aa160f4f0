"""The settings ``herald serve`` starts from (importable without the web stack)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from herald.config import EngineConfig

SERVE_DEFAULTS = EngineConfig(max_waiting=64, max_prefill_tokens=4096)
"""A bounded waiting queue and a prefill budget per block boundary, so that a burst of long
prompts neither queues without bound nor stalls the running requests for whole prompts; every
other field (CUDA graphs on, ``kv_pad``) as a benchmark's engine."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class FrontLimits:
    """What a client may send, and how slowly, before the server gives up on its connection.

    Applied by :mod:`herald.server.front` in front of the routes."""

    header_timeout_s: float = 10.0
    """Seconds a connection may take to send a request's headers, counted from the connection
    (or, on a kept-alive connection, from the request's first byte); then it is closed."""
    body_timeout_s: float = 30.0
    """Seconds a request may take to send its body once its headers have arrived; then it gets
    a 408 and the connection is closed."""
    keep_alive_timeout_s: float = 5.0
    """Seconds an idle kept-alive connection stays open between requests."""
    shutdown_timeout_s: float = 30.0
    """Seconds a shutdown (SIGINT, SIGTERM) waits for the requests in flight to finish; then
    their connections are closed and their requests aborted."""
    max_body_bytes: int = 16 * 1024**2
    """Largest request body accepted (413 above it), checked from Content-Length before the body
    is read, and counted while a chunked body is read."""

    def validate(self) -> None:
        """ValueError naming the field that is not a finite positive number."""
        for name in (
            "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "shutdown_timeout_s"
        ):  # fmt: skip
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")


FRONT_DEFAULTS = FrontLimits()
