"""The floor of one decode forward from the bytes it must read and the FLOPs it must do, and the
acceptance targets the forward benchmark prints next to its measurements.

One forward of ``batch`` rows of L tokens each (L = B for a denoising step, 2B for HERALD's fused
draft step: the block and its draft at the same positions) reads, at least once:

- **weights** (bf16): every weight the forward multiplies whatever the routing (attention
  projections, norms, the dense FFN layers, the router, the shared experts, the final norm), the
  embedding rows of its tokens, and the routed experts it hits. The expert count is stated in
  ``experts_basis``: ``measured`` (the distinct experts the forward's own routing picked, summed
  over the MoE layers), ``uniform`` (the expectation E x (1 - (1 - K/E)^T) per layer for T tokens
  routed uniformly, when not measured) or ``all`` (every expert: the upper bound, also recorded
  as ``*_all_experts``). The LM head is not part of the forward (the engine computes logits at
  the masked positions afterwards, in the sampler).
- **KV** (bf16): per layer and row, the rows the block attends to plus its own L new rows. Dense:
  the whole prefix. HERALD: the prefix in the first ``num_dense_layers`` layers, and in the
  others the sparse pool's rows: k = min(ceil(budget x prefix), prefix - B) selected rows plus
  the last completed block (the pool's padding is overhead, not floor).

FLOPs: 2 per matrix parameter per token (the routed experts: K of them per token), and attention
4 x heads x head_dim per query and key it sees (QK^T and PV; each query sees the prefix rows and
its own block of B). Activations, norms and element-wise work are left out (well under 1% of the
bytes at these sizes).

floor = max(bytes / HBM bandwidth, FLOPs / peak). The defaults are the H200's: 4.3 TB/s (what
large copies achieve; 4.8 TB/s nominal) and 790 TFLOP/s (bf16 dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from herald.bench.ceilings import budget_rows
from herald.models.config import ModelConfig

HBM_TBPS = 4.3
"""HBM bandwidth the floor assumes, TB/s (the H200's achievable; 4.8 nominal)."""
PEAK_TFLOPS = 790.0
"""bf16 dense peak the floor assumes, TFLOP/s (the H200)."""
BF16 = 2
NUM_DENSE_LAYERS = 2
"""Layers HERALD keeps dense on the GPU (the offloading engines' default)."""
MODES = ("dense", "herald", "herald-draft")
"""What a forward-benchmark point times: the dense engine's forward, HERALD's main-stream
denoising forward over its sparse pool, HERALD's fused draft step (2B tokens)."""


@dataclass(frozen=True)
class WeightGeometry:
    """A model's weights as a forward reads them (bytes at 2 per parameter; the router's float32
    ``expert_bias`` counted at 4)."""

    dense_bytes: int
    """Read by every forward: attention, norms, dense FFN layers, router, shared experts."""
    dense_matmul_params: int
    """Parameters of the matrices every token multiplies (2 FLOPs each per token)."""
    expert_params: int
    """Parameters of one routed expert (gate, up, down)."""
    moe_layers: int
    num_experts: int
    top_k: int
    embedding_row_bytes: int
    lm_head_bytes: int
    """Not read by the forward (recorded for reference)."""

    @property
    def expert_bytes(self) -> int:
        return self.expert_params * BF16

    @property
    def all_experts(self) -> int:
        """Routed experts over every MoE layer."""
        return self.moe_layers * self.num_experts


@cache
def _geometry(config: ModelConfig) -> WeightGeometry:
    from herald.models.registry import weight_specs

    dense_bytes = dense_params = expert_params = lm_head = embed_row = 0
    first: tuple[str, str] | None = None
    moe_layers: set[str] = set()
    for spec in weight_specs(config):
        if spec.target == "embed_tokens.weight":
            embed_row = spec.shape[1] * BF16
        elif spec.target == "lm_head.weight":
            lm_head = spec.numel * BF16
        elif ".mlp.experts." in spec.name:
            layer, rest = spec.name.split(".mlp.experts.")
            key = (layer, rest.split(".")[0])
            first = first or key
            moe_layers.add(layer)
            if key == first:  # one expert's tensors: every routed expert has the same shapes
                expert_params += spec.numel
        else:
            size = 4 if spec.name.endswith("expert_bias") else BF16
            dense_bytes += spec.numel * size
            if len(spec.shape) == 2:
                dense_params += spec.numel
    return WeightGeometry(
        dense_bytes=dense_bytes,
        dense_matmul_params=dense_params,
        expert_params=expert_params,
        moe_layers=len(moe_layers),
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        embedding_row_bytes=embed_row,
        lm_head_bytes=lm_head,
    )


def weight_geometry(config: ModelConfig) -> WeightGeometry:
    """The :class:`WeightGeometry` of ``config``, from its checkpoint's tensor list (no weights
    are built)."""
    return _geometry(config)


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts that ``tokens`` tokens hit in one layer when each picks ``top_k`` of
    ``num_experts`` uniformly: E x (1 - (1 - K/E)^T)."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ForwardShape:
    """One point's forward: the mode, the committed prefix and the batch."""

    mode: str
    context: int
    """Prompt tokens per row; the prefix is its whole blocks (the first decoded block holds the
    prompt's tail)."""
    batch: int
    block_size: int
    budget: float | None = None
    num_dense_layers: int = NUM_DENSE_LAYERS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; one of {', '.join(MODES)}")
        if self.mode != "dense" and not (self.budget and 0 < self.budget <= 1):
            raise ValueError(f"mode {self.mode} needs a budget in (0, 1], got {self.budget}")

    @property
    def length(self) -> int:
        """Tokens per row in the forward."""
        return 2 * self.block_size if self.mode == "herald-draft" else self.block_size

    @property
    def tokens(self) -> int:
        return self.batch * self.length

    @property
    def prefix(self) -> int:
        return self.context // self.block_size * self.block_size

    def k_rows(self) -> int:
        """Selected rows per KV head in a sparse layer (the offloading engines' budget rule)."""
        assert self.budget is not None
        last = self.block_size if self.prefix >= self.block_size else 0
        return min(budget_rows(self.budget, self.prefix), self.prefix - last)

    def prefix_rows(self, num_layers: int) -> list[int]:
        """Per layer: the KV rows before the current tokens that every row attends to."""
        if self.mode == "dense":
            return [self.prefix] * num_layers
        nd = min(self.num_dense_layers, num_layers)
        last = self.block_size if self.prefix >= self.block_size else 0
        return [self.prefix] * nd + [self.k_rows() + last] * (num_layers - nd)


def kv_bytes(config: ModelConfig, shape: ForwardShape) -> int:
    """K and V bytes the forward reads (and writes, for its own L rows), all layers and rows."""
    per_row = 2 * config.num_kv_heads * config.head_dim * BF16
    rows = sum(r + shape.length for r in shape.prefix_rows(config.num_layers))
    return rows * per_row * shape.batch


def forward_flops(config: ModelConfig, shape: ForwardShape) -> int:
    """Matrix FLOPs of the forward (see the module docstring)."""
    g, t = weight_geometry(config), shape.tokens
    mm = 2 * t * (g.dense_matmul_params + g.moe_layers * g.top_k * g.expert_params)
    per_key = 4 * config.num_heads * config.head_dim
    keys = sum(r + shape.block_size for r in shape.prefix_rows(config.num_layers))
    return mm + t * per_key * keys


def experts_for(config: ModelConfig, shape: ForwardShape, measured: int | None) -> tuple[int, str]:
    """(routed experts read over every MoE layer, basis): the measured count when given, else
    the uniform-routing expectation (rounded up per layer)."""
    g = weight_geometry(config)
    if measured is not None:
        return measured, "measured"
    per_layer = math.ceil(expected_experts_hit(g.num_experts, g.top_k, shape.tokens) - 1e-9)
    return per_layer * g.moe_layers, "uniform"


def floor(
    config: ModelConfig,
    shape: ForwardShape,
    *,
    experts_hit: int | None = None,
    hbm_tbps: float = HBM_TBPS,
    peak_tflops: float = PEAK_TFLOPS,
) -> dict[str, Any]:
    """Bytes, FLOPs and the floor of one forward (times in ms); ``experts_hit``: the measured
    distinct routed experts summed over the MoE layers, if known."""
    g = weight_geometry(config)
    hit, basis = experts_for(config, shape, experts_hit)
    base = g.dense_bytes + shape.tokens * g.embedding_row_bytes
    weights = base + hit * g.expert_bytes
    weights_all = base + g.all_experts * g.expert_bytes
    kv = kv_bytes(config, shape)
    flops = forward_flops(config, shape)
    bw, peak = hbm_tbps * 1e12, peak_tflops * 1e12
    memory_ms = (weights + kv) / bw * 1e3
    compute_ms = flops / peak * 1e3
    memory_all_ms = (weights_all + kv) / bw * 1e3
    return {
        "tokens": shape.tokens,
        "weight_bytes": weights,
        "weight_bytes_all_experts": weights_all,
        "expert_bytes": hit * g.expert_bytes,
        "experts_hit": hit,
        "experts_total": g.all_experts,
        "experts_basis": basis,
        "kv_bytes": kv,
        "flops": flops,
        "memory_ms": memory_ms,
        "compute_ms": compute_ms,
        "floor_ms": max(memory_ms, compute_ms),
        "floor_all_experts_ms": max(memory_all_ms, compute_ms),
        "bound": "memory" if memory_ms >= compute_ms else "compute",
        "hbm_tbps": hbm_tbps,
        "peak_tflops": peak_tflops,
    }


# -- acceptance targets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A forward-time target: at most ``ms``, or at most ``floor_ratio`` x the point's floor."""

    ms: float | None = None
    floor_ratio: float | None = None

    def limit_ms(self, floor_ms: float) -> float:
        if self.ms is not None:
            return self.ms
        assert self.floor_ratio is not None
        return self.floor_ratio * floor_ms

    def describe(self, floor_ms: float) -> str:
        if self.ms is not None:
            return f"<= {self.ms:g} ms"
        return f"<= {self.floor_ratio:g}x floor ({self.limit_ms(floor_ms):.1f} ms)"


TARGET_BUDGET = 0.05
"""The budget of the HERALD targets."""
TARGETS: dict[tuple[str, str, int, int], Target] = {
    ("llada2-mini", "dense", 32768, 32): Target(ms=21.0),
    ("llada2-mini", "dense", 2048, 80): Target(ms=14.0),
    ("llada2-mini", "herald", 32768, 80): Target(ms=16.0),
    ("llada2-mini", "herald-draft", 32768, 80): Target(ms=26.0),
    ("sdar-8b-chat", "dense", 32768, 12): Target(floor_ratio=1.3),
    ("sdar-8b-chat", "herald", 32768, 24): Target(floor_ratio=1.3),
}
"""(model, mode, context, batch) -> the forward's acceptance target (HERALD points at
:data:`TARGET_BUDGET`)."""
PREFILL_TARGETS = {"llada2-mini": 60_000.0, "sdar-8b-chat": 20_000.0}
"""Prefill tokens/s a batch of prompts must reach at :data:`PREFILL_TARGET_PROMPTS` tokens."""
PREFILL_TARGET_PROMPTS = (16384, 32768)
EXPERT_TBPS_TARGET = 4.0
"""TB/s of expert weight bytes the expert GEMMs must stream at >= :data:`EXPERT_TARGET_TOKENS`."""
EXPERT_TARGET_TOKENS = 1024


def target_for(
    model: str, mode: str, context: int, batch: int, budget: float | None
) -> Target | None:
    """The acceptance target of a point, or None."""
    if mode != "dense" and (budget is None or abs(budget - TARGET_BUDGET) > 1e-9):
        return None
    return TARGETS.get((model, mode, context, batch))


def prefill_target(model: str, prompt_tokens: int) -> float | None:
    """The prefill tokens/s target at this prompt length, or None."""
    if prompt_tokens not in PREFILL_TARGET_PROMPTS:
        return None
    return PREFILL_TARGETS.get(model)


def target_points(models: list[str], modes: list[str]) -> list[tuple[str, str, int, int]]:
    """The targets' points of ``models`` and ``modes`` (model, mode, context, batch), in order."""
    return [k for k in TARGETS if k[0] in models and k[1] in modes]
