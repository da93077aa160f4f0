"""The engine settings ``herald serve`` starts from (importable without the web stack)."""

from __future__ import annotations

from herald.config import EngineConfig

SERVE_DEFAULTS = EngineConfig(max_waiting=64, max_prefill_tokens=4096)
"""A bounded waiting queue and a prefill budget per block boundary, so that a burst of long
prompts neither queues without bound nor stalls the running requests for whole prompts; every
other field (CUDA graphs on, ``kv_pad``) as a benchmark's engine."""
