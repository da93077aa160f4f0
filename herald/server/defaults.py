"""The settings ``herald serve`` starts from (importable without the web stack)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from herald.config import EngineConfig, SamplingParams

SERVE_DEFAULTS = EngineConfig(max_waiting=64, max_prefill_tokens=4096)
"""A bounded waiting queue and a prefill budget per block boundary, so that a burst of long
prompts neither queues without bound nor stalls the running requests for whole prompts; every
other field (CUDA graphs on, ``kv_pad``) as a benchmark's engine."""


@dataclass(frozen=True)
class DenoiseDefaults:
    """How a request that sets neither ``steps`` nor ``threshold`` denoises its blocks
    (``herald serve --steps / --threshold``).

    A request's own value wins over the server's, as a request's sampling fields win over a
    vLLM or SGLang server's defaults. ``steps`` (fixed-steps mode) uses no threshold, so the
    server's flags, and a request's fields, give one of the two; a request that gives
    ``threshold`` has chosen threshold mode and runs it with its threshold, also on a server
    whose default is fixed steps (:meth:`resolve`)."""

    threshold: float = SamplingParams.threshold
    """Threshold mode: accept every masked position whose confidence is above this, at least
    one per step; in (0, 1]."""
    steps: int | None = None
    """Fixed-steps mode: denoising steps per block (the threshold is not used); None: threshold
    mode."""

    def validate(self) -> None:
        """ValueError naming the field out of range (the engine's own checks of these knobs)."""
        try:
            SamplingParams(
                max_new_tokens=1, threshold=self.threshold, num_denoise_steps=self.steps
            ).validate()
        except ValueError as e:
            raise ValueError(str(e).replace("num_denoise_steps", "steps", 1)) from None

    def resolve(self, threshold: float | None, steps: int | None) -> tuple[float, int | None]:
        """(threshold, steps) of a request that gave ``threshold`` or ``steps`` (None: not
        given; the request refuses both): its own steps; else, with its own threshold, threshold
        mode at it; else the server's."""
        if steps is not None or threshold is not None:
            return (self.threshold if threshold is None else threshold), steps
        return self.threshold, self.steps

    def describe(self) -> str:
        if self.steps is not None:
            return f"{self.steps} denoising steps per block"
        return f"denoising threshold {self.threshold:g}"


DENOISE_DEFAULTS = DenoiseDefaults()

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
