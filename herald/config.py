"""User-facing configuration: how to decode (SamplingParams) and how to run (EngineConfig).

Frozen dataclasses; the attribute docstrings double as CLI help.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (DESIGN §5, model spec §1.4 / §2.4).

    Raises ``ValueError`` from :meth:`validate` on out-of-range values.
    """

    max_new_tokens: int = 256
    """Generated tokens at most (the prompt tail inside the first block does not count)."""
    temperature: float = 0.0
    """0 = greedy argmax (deterministic); > 0 samples from softmax(logits / temperature)."""
    top_k: int = 0
    """Keep the k most likely tokens before sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus filter: keep the smallest prefix of tokens whose cumulative probability > top_p."""
    threshold: float = 0.95
    """Confidence-threshold acceptance: accept every masked position whose confidence is strictly
    greater than this, and at least the single most confident one. Ignored in fixed-steps mode."""
    num_denoise_steps: int | None = None
    """Fixed-steps mode (throughput runs): T denoising steps per block, accepting
    ceil(masks_left / steps_left) most-confident positions per step. None = threshold mode."""
    seed: int | None = None
    """Seed for sampling (temperature > 0); each request owns its generator, so its output does
    not depend on what else is in the batch."""
    ignore_eos: bool = False
    """Keep decoding past EOS until max_new_tokens (throughput runs)."""

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.num_denoise_steps is not None and self.num_denoise_steps <= 0:
            raise ValueError(f"num_denoise_steps must be > 0, got {self.num_denoise_steps}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """How the dense engine runs a batch."""

    max_batch_size: int = 64
    """Requests decoded together in one forward."""
    prefill_chunk_tokens: int = 4096
    """Prompt tokens per prefill forward (rounded down to a multiple of the block size)."""
    use_cuda_graph: bool = False
    """Capture the denoising forward in CUDA graphs (GPU only; uniform-length batches)."""
