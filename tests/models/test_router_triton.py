"""The fused router (herald.layers.router_triton): LLaDA2's group-limited top-k in one Triton
kernel, against the PyTorch routing, in the Triton interpreter (CPU) and on the GPU at
LLaDA2.0-mini's shapes, with batch invariance and CUDA-graph replay."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from herald.layers.moe import route_tokens
from herald.layers.moe_triton import triton_available
from herald.layers.router_triton import fused_router_available, route_fused

# (experts, groups, groups kept, top_k): LLaDA2.0-mini, tiny-llada2, small odd cases.
SHAPES = [(256, 8, 4, 8), (32, 8, 4, 8), (8, 2, 1, 2), (16, 1, 1, 1), (64, 4, 2, 6)]

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from herald.layers.moe import SparseMoE, route_tokens
    from herald.layers.router_triton import fused_router_available, route_fused
    torch.manual_seed(0)
    for E, G, kept, K in SHAPES:
        for T in (1, 5, 37):
            x = torch.randn(T, E) * 2
            b = torch.randn(E) * 0.1
            assert fused_router_available(x, E, G, dtype=torch.float32)  # under HERALD_TRITON=all
            args = dict(top_k=K, n_group=G, topk_group=kept, routed_scaling_factor=2.5)
            i1, w1 = route_fused(x, b, **args)
            i0, w0 = route_tokens(x, b, **args)
            assert i1.dtype == torch.int64 and w1.dtype == torch.float32
            assert torch.equal(i0, i1), (E, G, kept, K, T)
            assert (w0 - w1).abs().max().item() < 1e-6, (E, G, kept, K, T)
    # The MoE block routes through it when it applies.
    moe = SparseMoE(16, 8, 32, 8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5)
        moe.gate.expert_bias.normal_(0, 0.1)
    h = torch.randn(9, 16)
    ref = route_tokens(moe.gate(h), moe.gate.expert_bias, top_k=8, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5)
    got = moe.route(h)
    assert torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1], atol=1e-6)
    print("ok")
    """
).replace("SHAPES", repr(SHAPES))


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_fused_router_equals_the_pytorch_routing_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HERALD_TRITON": "all"}
    res = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_fused_router_applies_only_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("HERALD_TRITON", "all")
    cpu = torch.zeros(4, 256)  # router logits are float32 whatever the model's dtype
    assert not fused_router_available(cpu, 256, 8, dtype=bf16)  # CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for dtype in (bf16, fp16, fp32):  # all: every model dtype
        assert fused_router_available(cpu, 256, 8, dtype=dtype) == triton_available()
    assert not fused_router_available(cpu, 96, 8, dtype=bf16)  # not a power of two
    assert not fused_router_available(cpu, 256, 6, dtype=bf16)
    assert not fused_router_available(cpu, 8, 8, dtype=bf16)  # one expert per group
    monkeypatch.setenv("HERALD_TRITON", "auto")  # the default: on for bf16/fp16 models
    assert fused_router_available(cpu, 256, 8, dtype=bf16) == triton_available()
    assert fused_router_available(cpu, 256, 8, dtype=fp16) == triton_available()
    assert not fused_router_available(cpu, 256, 8, dtype=fp32)  # float32 reference runs: all
    monkeypatch.delenv("HERALD_TRITON")  # unset is auto
    assert fused_router_available(cpu, 256, 8, dtype=bf16) == triton_available()
    monkeypatch.setenv("HERALD_TRITON", "0")  # off
    for dtype in (bf16, fp16, fp32):
        assert not fused_router_available(cpu, 256, 8, dtype=dtype)


def test_moe_block_routes_through_the_fused_router_by_default_for_half_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SparseMoE.route passes the model's dtype: under the default ``auto`` a bf16 block takes the
    fused router, a float32 block the PyTorch routing; ``0`` turns it off. (A stand-in records
    the calls, so no kernel runs outside the interpreter.)"""
    import herald.layers.moe as moe_mod

    calls: list[int] = []

    def spy(logits: torch.Tensor, bias: torch.Tensor, **kw: object) -> object:
        calls.append(logits.shape[0])
        return route_tokens(logits, bias, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(moe_mod, "route_fused", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets CPU tensors pass the device check
    monkeypatch.delenv("HERALD_TRITON", raising=False)
    for dtype, mode, fused in (
        (torch.bfloat16, "auto", True),
        (torch.float32, "auto", False),
        (torch.float32, "all", True),
        (torch.bfloat16, "0", False),
    ):
        monkeypatch.setenv("HERALD_TRITON", mode)
        moe = moe_mod.SparseMoE(16, 8, 32, 8, n_group=8, topk_group=4, dtype=dtype)
        with torch.no_grad():
            moe.gate.weight.normal_(0, 0.5)
        calls.clear()
        idx, _ = moe.route(torch.randn(5, 16, dtype=dtype))
        assert idx.shape == (5, 8)
        assert calls == ([5] if fused and triton_available() else []), (dtype, mode)


def _llada_logits(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, 256, generator=g, device="cuda") * 2
    return x, torch.randn(256, generator=g, device="cuda") * 0.1


ARGS: dict[str, Any] = {"top_k": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}


@pytest.mark.gpu
def test_fused_router_equals_the_pytorch_routing_on_cuda() -> None:
    for tokens in (1, 32, 1024, 2560, 5120):
        x, b = _llada_logits(tokens, tokens)
        i1, w1 = route_fused(x, b, **ARGS)
        i0, w0 = route_tokens(x, b, **ARGS)
        assert torch.equal(i0, i1), tokens
        assert (w0 - w1).abs().max().item() < 1e-6, tokens


@pytest.mark.gpu
def test_fused_router_is_batch_invariant_and_replays_in_a_cuda_graph() -> None:
    x, b = _llada_logits(2560, 0)
    full = route_fused(x, b, **ARGS)
    for lo, hi in ((0, 1), (7, 1031), (2048, 2560)):
        part = route_fused(x[lo:hi], b, **ARGS)
        assert torch.equal(part[0], full[0][lo:hi]) and torch.equal(part[1], full[1][lo:hi])
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = route_fused(x, b, **ARGS)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        new, _ = _llada_logits(2560, seed)
        x.copy_(new)
        graph.replay()
        ref = route_fused(x, b, **ARGS)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), seed
