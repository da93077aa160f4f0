"""LLaDA2's group-limited router top-k in one Triton kernel (docs/MODELS.md §6).

:func:`herald.layers.moe.route_tokens` computes it in PyTorch: a sigmoid, the bias, a top-2 per
group, a top-k over the groups, a mask, a top-k over the experts, a gather and the normalisation;
on CUDA three ``topk`` launches and several elementwise ones per MoE layer (the H200 profile's
router/top-k category, which also holds the experts' sort, took 1.9-2.9 ms of a LLaDA2.0-mini
forward at 1,024-2,560 tokens, results/forward/). Here one program
holds a few tokens' E router logits in registers and does all of it: the choice by K argmax
passes (so the experts come out in descending biased order, as ``topk`` returns them), the
weights from the unbiased scores.

Same results as :func:`~herald.layers.moe.route_tokens` up to ties (here the lower expert or
group wins; ``topk`` leaves tie order unspecified) and the float32 rounding of the sigmoid and
of the weights' sum. Per token, so batch invariant; no host sync, static shapes (graph safe).
E and the group count must be powers of two, with at least two experts per group (LLaDA2.0-mini:
256 experts in 8 groups of 32); :func:`fused_router_available` says when this path applies.

On by default (``HERALD_TRITON=auto``) for bf16/fp16 models on CUDA: on the H200 at
LLaDA2.0-mini's shapes it took 0.029-0.045 ms against 0.18-0.28 ms for the PyTorch routing at
32-4,096 tokens, with no token routed differently (``python -m herald.bench.moe``).
``HERALD_TRITON=0`` turns it off; float32 models (the reference runs) use it only with ``all``.
"""

from __future__ import annotations

import torch

from herald.layers.moe_triton import interpreting, triton_enabled

BLOCK_T = 16
"""Tokens per program: 16 x 256 float32 scores per live tensor, in registers."""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fused_router_available(
    logits: torch.Tensor, num_experts: int, n_group: int, *, dtype: torch.dtype
) -> bool:
    """True when the fused router suits these logits: CUDA (or the Triton interpreter on the
    CPU), Triton enabled (``HERALD_TRITON`` not ``0``; for a model ``dtype`` other than
    bf16/fp16, i.e. float32 reference runs, only ``all``), and power-of-two counts of experts and
    groups with at least two experts per group. ``dtype`` is the model's (the MoE input's): the
    logits are float32 whatever it is."""
    half = dtype in (torch.bfloat16, torch.float16)
    if not (logits.is_cuda or interpreting()) or not triton_enabled(everywhere=not half):
        return False
    return _pow2(num_experts) and _pow2(n_group) and num_experts >= 2 * n_group


def route_fused(
    router_logits: torch.Tensor,
    expert_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`herald.layers.moe.route_tokens`: [T, E] float32 logits ->
    (expert ids [T, top_k] int64, weights [T, top_k] float32)."""
    import triton

    from herald.layers._router_kernel import group_limited_topk

    logits = router_logits.float().contiguous()
    num_tokens, num_experts = logits.shape
    idx = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return idx, weights
    group_limited_topk[(triton.cdiv(num_tokens, BLOCK_T),)](
        logits, expert_bias.float().contiguous(), idx, weights, num_tokens,
        float(routed_scaling_factor), E=num_experts, G=n_group, TOPK_GROUP=topk_group,
        K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=BLOCK_T, num_warps=4,
    )  # fmt: skip
    return idx, weights
