"""The BailingMoeV2 MoE block (docs/MODELS.md §6): routing, reference path, grouped-GEMM path."""

from __future__ import annotations

import pytest
import torch
from naive import moe_token

from herald.layers.moe import (
    SparseMoE,
    experts_grouped_mm,
    experts_reference,
    grouped_mm_available,
    route_tokens,
)


def _moe(
    seed: int = 0, *, hidden: int = 64, inter: int = 16, experts: int = 32, dtype=torch.float32
) -> SparseMoE:
    moe = SparseMoE(
        hidden, inter, experts, 8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        num_shared_experts=1, impl="reference", dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        moe.gate.expert_bias.copy_(torch.randn(experts, generator=g) * 0.05)
    return moe


def _naive(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    inter = moe.experts_down.shape[-1]
    experts = [
        (moe.experts_gate_up[e, :inter], moe.experts_gate_up[e, inter:], moe.experts_down[e])
        for e in range(moe.num_experts)
    ]
    assert moe.shared_experts is not None
    si = moe.shared_experts.intermediate_size
    gu = moe.shared_experts.gate_up_proj.weight
    shared = (gu[:si], gu[si:], moe.shared_experts.down_proj.weight)
    flat = x.reshape(-1, x.shape[-1])
    out = [
        moe_token(
            t,
            moe.gate.weight,
            moe.gate.expert_bias,
            experts,
            shared,
            n_group=8,
            topk_group=4,
            top_k=8,
            scale=2.5,
        )  # fmt: skip
        for t in flat
    ]
    return torch.stack(out).view(x.shape)


@torch.no_grad()
def test_reference_moe_matches_naive_per_token_loop() -> None:
    moe = _moe()
    x = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(moe(x), _naive(moe, x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_routing_weights_use_unbiased_scores_and_groups_are_limited() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(50, 32, generator=g)
    bias = torch.zeros(32)
    bias[3] = 10.0  # expert 3 always selected, yet weighted by its unbiased score
    idx, w = route_tokens(logits, bias, top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    assert idx.shape == (50, 8) and w.dtype == torch.float32
    assert (idx[:, 0] == 3).all()
    s = torch.sigmoid(logits)
    expected = s.gather(1, idx)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(w, expected)
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.5))
    groups = idx // 4
    assert all(len(set(row.tolist())) <= 4 for row in groups)
    assert all(len(set(row.tolist())) == 8 for row in idx)


@torch.no_grad()
def test_expert_bias_changes_selection() -> None:
    moe = _moe(1)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    idx0, _ = moe.route(x)
    moe.gate.expert_bias.fill_(0.0)
    moe.gate.expert_bias[idx0[0, 0]] = -100.0
    idx1, _ = moe.route(x)
    assert idx0[0, 0] not in idx1[0].tolist()


def _grouped_mm_runs_on_cpu() -> bool:
    try:
        a, b = torch.randn(4, 8), torch.randn(2, 8, 8)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _grouped_mm_runs_on_cpu(), reason="torch._grouped_mm unavailable on CPU")
@torch.no_grad()
def test_grouped_mm_path_matches_reference_on_cpu() -> None:
    moe = _moe(3)
    x = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(4))
    flat = x.reshape(-1, 64)
    idx, _ = moe.route(flat)
    ref = experts_reference(flat, idx, moe.experts_gate_up, moe.experts_down)
    fast = experts_grouped_mm(flat, idx, moe.experts_gate_up, moe.experts_down)
    assert torch.allclose(ref, fast, atol=1e-5, rtol=1e-5)
    for tokens in (1, 3, 111):  # 1 token: 24 of 32 experts get no rows (empty groups)
        xt = x.reshape(-1, 64)[:tokens]
        moe.impl = "grouped_mm"
        out_fast = moe(xt)
        moe.impl = "reference"
        assert torch.allclose(out_fast, moe(xt), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@torch.no_grad()
def test_grouped_mm_path_matches_reference_on_cuda_full_size_shapes() -> None:
    """LLaDA2.0-mini MoE shapes (H 2048, I 512, E 256, top-8), bf16 on the GPU."""
    torch.manual_seed(0)
    moe = _moe(0, hidden=2048, inter=512, experts=256, dtype=torch.bfloat16).cuda()
    for tokens in (1, 32, 1024, 4096):
        x = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
        assert grouped_mm_available(x)
        moe.impl = "reference"
        ref = moe(x)
        moe.impl = "auto"  # must pick grouped_mm on bf16 CUDA
        fast = moe(x)
        err = (fast.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err < 2e-2, (tokens, err)
        flat = x.view(-1, 2048)
        idx, _ = moe.route(flat)
        a = experts_reference(flat, idx, moe.experts_gate_up, moe.experts_down).float()
        b = experts_grouped_mm(flat, idx, moe.experts_gate_up, moe.experts_down).float()
        assert ((a - b).abs().max() / a.abs().max()) < 2e-2
