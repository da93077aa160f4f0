"""BailingMoeV2 (LLaDA2) sparse MoE block: sigmoid router, group-limited top-k, shared expert.

docs/MODELS.md §6. Per token ``h`` [H]:

    r = h_f32 @ W_gate_f32.T                      router logits, float32 [E]
    s = sigmoid(r);  s_b = s + expert_bias        expert_bias selects only, never weights
    group score = sum of the top-2 of s_b in each of n_group groups; keep the topk_group best
    idx = top num_experts_per_tok of s_b over the kept groups
    w = s[idx] / (sum + 1e-20) * routed_scaling_factor          (unbiased scores, float32)
    out = sum_k w_k * Expert_{idx_k}(h)  (float32 sum, cast to the model dtype) + SharedExpert(h)

Expert weights are held stacked: ``experts_gate_up`` [E, 2I, H] (gate rows then up rows, the HF
``gate_proj``/``up_proj`` of each expert) and ``experts_down`` [E, H, I]. Three interchangeable
expert paths compute the same thing:

* ``reference``: a loop over the experts that received tokens (host sync; tests and CPU);
* ``grouped_mm``: tokens sorted by expert and two ``torch._grouped_mm`` calls over the stacked
  weights (no host sync; CUDA bf16, sm80+). It also runs on CPU in recent torch, which the tests
  use to compare the paths;
* ``fused``: :mod:`herald.layers.moe_triton`, our Triton kernels (rows aligned per expert on the
  GPU, SwiGLU fused into the gate/up GEMM, the unsort fused into the down GEMM's store).

``impl="auto"`` (default) picks ``fused`` for bf16/fp16 CUDA inputs when Triton is present and
``HERALD_TRITON=all`` (opt-in: not yet measured faster than ``grouped_mm``), else ``grouped_mm``
when available, else the reference.

The routing after the router GEMM runs in one Triton kernel
(:func:`herald.layers.router_triton.route_fused`) for bf16/fp16 CUDA inputs under the default
``HERALD_TRITON=auto`` (measured faster on the H200; ``HERALD_TRITON=0`` turns it off, float32
models use it only with ``all``), else in PyTorch (:func:`route_tokens`).

On CUDA the router's GEMM runs on the bf16 operands with float32 accumulation and output
(``torch.mm(..., out_dtype=float32)``): the products of two bf16 numbers are exact in float32, so
this is the float32 GEMM of the reference up to the order of the sum, without the float32 copy of
the router weights per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from herald.layers.fusion import cuda_compiled
from herald.layers.linear import linear
from herald.layers.mlp import SwiGLUMLP, swiglu
from herald.layers.moe_triton import experts_fused, fused_available
from herald.layers.router_triton import fused_router_available, route_fused

MoEImpl = Literal["auto", "reference", "grouped_mm", "fused"]
MOE_IMPLS: tuple[str, ...] = ("auto", "reference", "grouped_mm", "fused")


@cuda_compiled
def route_tokens(
    router_logits: torch.Tensor,
    expert_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited sigmoid routing (docs/MODELS.md §6).

    Args:
        router_logits: [T, E] float32.
        expert_bias: [E] float32 (selection only).
        top_k: experts per token; n_group / topk_group: groups and groups kept (E % n_group == 0).
        routed_scaling_factor: multiplies the normalised weights.

    Returns:
        (expert ids [T, top_k] int64 in descending biased-score order, weights [T, top_k] float32).
    """
    num_tokens, num_experts = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    biased = scores + expert_bias.float()
    per_group = num_experts // n_group
    grouped = biased.view(num_tokens, n_group, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
    kept = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(per_group, dim=1)  # [T, E]
    masked = biased.masked_fill(~expert_mask, float("-inf"))
    idx = masked.topk(top_k, dim=-1).indices
    weights = scores.gather(1, idx)
    if top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights * routed_scaling_factor


def expert_swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert: [n, H] -> [n, H] with ``w_gate_up`` [2I, H] and ``w_down`` [H, I]."""
    gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w_down)


def experts_reference(
    x: torch.Tensor, idx: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """Every (token, slot) expert output by looping over the experts that were chosen.

    Args:
        x: [T, H]; idx: [T, K] int64; w_gate_up: [E, 2I, H]; w_down: [E, H, I]; same dtype.

    Returns:
        [T, K, H] in ``x.dtype``: row ``[t, k]`` is expert ``idx[t, k]`` applied to ``x[t]``.
        Synchronises with the device (``unique().tolist()``).
    """
    num_tokens, top_k = idx.shape
    out = x.new_empty(num_tokens, top_k, x.shape[-1])
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        out[tok, slot] = expert_swiglu(x[tok], w_gate_up[e], w_down[e])
    return out


def experts_grouped_mm(
    x: torch.Tensor, idx: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`experts_reference`, with two grouped GEMMs and no host sync.

    The T*K (token, slot) rows are sorted by expert (stable), so expert ``e`` owns rows
    ``offs[e-1]:offs[e]``; ``torch._grouped_mm(a [M, K], b [G, K, N], offs=int32 [G])`` multiplies
    each row group by its expert's matrix. The weights are passed as ``transpose(1, 2)`` views
    (column-major, which the CUDA kernel accepts when H and I are multiples of 8 for bf16).
    """
    num_tokens, top_k = idx.shape
    num_experts = w_gate_up.shape[0]
    flat_idx = idx.reshape(-1)
    # (token, slot) rows grouped by expert; int32 keys halve the radix-sort passes.
    order = flat_idx.to(torch.int32).argsort(stable=True)
    xs = x[order // top_k]  # [T*K, H]
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_idx, torch.ones_like(flat_idx, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # end row of each expert's group
    gate_up = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)  # [T*K, 2I]
    ys = torch._grouped_mm(swiglu(gate_up), w_down.transpose(1, 2), offs=offs)  # [T*K, H]
    # Unsort with a row gather (index_select) rather than a scatter of [T*K, H] rows.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return ys.index_select(0, inverse).view(num_tokens, top_k, -1)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """True when the ``grouped_mm`` path suits ``x``: bf16 on a CUDA device of sm80 or newer."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0)


class MoEGate(nn.Module):
    """The router: ``weight`` [E, H] (model dtype) and ``expert_bias`` [E] float32 buffer.

    HF names ``mlp.gate.weight`` / ``mlp.gate.expert_bias``. ``expert_bias`` is kept float32 on
    purpose (the HF README's ``model.to(bfloat16)`` rounds it; docs/MODELS.md §6); do not
    ``.to(dtype)`` a whole model.
    """

    expert_bias: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device)
        )
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device)
        self.register_buffer("expert_bias", bias, persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> router logits [T, E] float32 (float32 accumulation; see the module doc)."""
        if x.is_cuda and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())


class SparseMoE(nn.Module):
    """Routed experts + optional shared expert: [bs, L, H] -> [bs, L, H] (model dtype)."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        num_shared_experts: int = 0,
        impl: MoEImpl = "auto",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_experts % n_group or topk_group > n_group:
            raise ValueError(
                f"num_experts={num_experts} must split into n_group={n_group} equal groups and "
                f"topk_group={topk_group} <= n_group"
            )
        if num_experts_per_tok > (num_experts // n_group) * topk_group:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} exceeds kept experts")
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.impl: MoEImpl = impl
        self.gate = MoEGate(hidden_size, num_experts, dtype=dtype, device=device)
        inter = moe_intermediate_size
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype, device=device)
        )
        self.experts_down = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, dtype=dtype, device=device)
        )
        self.shared_experts: SwiGLUMLP | None = None
        if num_shared_experts > 0:
            self.shared_experts = SwiGLUMLP(
                hidden_size, inter * num_shared_experts, dtype=dtype, device=device
            )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (expert ids [T, K] int64, weights [T, K] float32); see :func:`route_tokens`
        (:func:`~herald.layers.router_triton.route_fused` where it applies)."""
        logits = self.gate(x)
        fused = fused_router_available(logits, self.num_experts, self.n_group, dtype=x.dtype)
        return (route_fused if fused else route_tokens)(
            logits,
            self.gate.expert_bias,
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, weights = self.route(flat)
        y = self.experts_impl(flat)(flat, idx, self.experts_gate_up, self.experts_down)  # [T,K,H]
        out = combine_experts(y, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)

    def experts_impl(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The expert path ``impl`` names for ``x`` (``auto``: the fastest that suits it)."""
        if self.impl == "fused" or (
            self.impl == "auto" and fused_available(x, self.experts_gate_up)
        ):
            return experts_fused
        if self.impl == "grouped_mm" or (self.impl == "auto" and grouped_mm_available(x)):
            return experts_grouped_mm
        return experts_reference

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, groups={self.n_group}/"
            f"{self.topk_group}, scale={self.routed_scaling_factor}, impl={self.impl}"
        )


@cuda_compiled
def combine_experts(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, K, H] expert outputs, [T, K] float32 weights -> [T, H], summed in float32."""
    return (y.float() * weights.unsqueeze(-1)).sum(dim=1).to(y.dtype)
