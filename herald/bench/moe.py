"""One LLaDA2.0-mini MoE block on the GPU: the grouped-GEMM path against the fused Triton path,
per token count, with the expert GEMMs' weight bandwidth, and the routing after the router GEMM
in PyTorch against the fused router kernel; optionally a sweep of the fused GEMMs' tile configs.

``python -m herald.bench.moe [--tokens 32,1024,2560,4096] [--sweep] [--out DIR]``

Weight bytes of a call: every expert that received a row is read once (3 x H x I x 2 bytes);
TB/s is those bytes over the kernel time. Timing: CUDA events around ``--iters`` back-to-back
calls, after warm-up, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from herald.bench.common import append_jsonl
from herald.layers.moe import SparseMoE, experts_grouped_mm, route_tokens
from herald.layers.moe_triton import DOWN_CONFIG, GATE_UP_CONFIG, TileConfig, experts_fused
from herald.layers.router_triton import route_fused


def _time_ms(fn: Callable[[], object], iters: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def _moe(hidden: int, inter: int, experts: int) -> SparseMoE:
    moe = SparseMoE(
        hidden, inter, experts, 8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        num_shared_experts=1, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


def measure(moe: SparseMoE, tokens: int, iters: int, repeats: int) -> dict[str, float | int]:
    """Times of the whole block per path, and of the experts alone, for ``tokens`` tokens."""
    x = torch.randn(tokens, moe.experts_gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    idx, _ = moe.route(x)
    hit = int(idx.unique().numel())
    inter, hidden = moe.experts_down.shape[2], moe.experts_down.shape[1]
    weight_bytes = hit * 3 * hidden * inter * 2
    wgu, wd = moe.experts_gate_up, moe.experts_down
    rec: dict[str, float | int] = {
        "tokens": tokens,
        "experts_hit": hit,
        "weight_bytes": weight_bytes,
    }
    paths: tuple[tuple[str, Callable[..., torch.Tensor]], ...] = (
        ("grouped_mm", experts_grouped_mm),
        ("fused", experts_fused),
    )
    for name, fn in paths:
        rec[f"{name}_experts_ms"] = _time_ms(functools.partial(fn, x, idx, wgu, wd), iters, repeats)
        rec[f"{name}_experts_tbps"] = weight_bytes / rec[f"{name}_experts_ms"] / 1e9
        moe.impl = name  # type: ignore[assignment]
        rec[f"{name}_block_ms"] = _time_ms(lambda: moe(x), iters, repeats)
    moe.impl = "auto"
    rec.update(measure_router(moe, x, iters, repeats))
    return rec


def measure_router(
    moe: SparseMoE, x: torch.Tensor, iters: int, repeats: int
) -> dict[str, float | int]:
    """The routing after the router GEMM: PyTorch (route_tokens, compiled) against the fused
    Triton kernel, and whether their choices agree."""
    logits = moe.gate(x)
    torch_route = functools.partial(
        route_tokens, logits, moe.gate.expert_bias, top_k=moe.top_k, n_group=moe.n_group,
        topk_group=moe.topk_group, routed_scaling_factor=moe.routed_scaling_factor,
    )  # fmt: skip
    fused_route = functools.partial(route_fused, *torch_route.args, **torch_route.keywords)
    ref, got = torch_route(), fused_route()
    return {
        "router_torch_ms": _time_ms(torch_route, iters, repeats),
        "router_fused_ms": _time_ms(fused_route, iters, repeats),
        "router_gemm_ms": _time_ms(lambda: moe.gate(x), iters, repeats),
        "router_tokens_differ": int((ref[0] != got[0]).any(dim=1).sum().item()),
    }


def sweep(moe: SparseMoE, tokens: int, iters: int, repeats: int) -> list[dict[str, object]]:
    """Every gate/up config with the default down config, then every down config."""
    x = torch.randn(tokens, moe.experts_gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    idx, _ = moe.route(x)
    grid = [
        TileConfig(block_n=n, num_warps=w, num_stages=s)
        for n, w, s in itertools.product((64, 128, 256), (4, 8), (3, 4))
    ]
    out: list[dict[str, object]] = []
    for which in ("gate_up", "down"):
        for cfg in grid:
            kw = {"gate_up_config": cfg} if which == "gate_up" else {"down_config": cfg}
            call = functools.partial(
                experts_fused, x, idx, moe.experts_gate_up, moe.experts_down, **kw
            )
            try:
                ms = _time_ms(call, iters, repeats)
            except Exception as exc:  # out of shared memory or registers for this tile
                out.append(
                    {"tokens": tokens, "gemm": which, "config": vars(cfg), "error": str(exc)[:200]}
                )
                continue
            out.append({"tokens": tokens, "gemm": which, "config": vars(cfg), "ms": ms})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m herald.bench.moe", description=__doc__)
    p.add_argument("--tokens", default="32,256,1024,2560,4096", help="comma-separated token counts")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also sweep the fused GEMMs' tiles")
    p.add_argument("--out", type=Path, default=None, help="write moe.jsonl here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    moe = _moe(a.hidden, a.inter, a.experts)
    print(f"defaults: gate_up {GATE_UP_CONFIG}, down {DOWN_CONFIG}")
    records: list[dict[str, object]] = []
    with torch.no_grad():
        for t in (int(s) for s in a.tokens.split(",")):
            rec = measure(moe, t, a.iters, a.repeats)
            records.append({"kind": "point", **rec})
            print(
                f"T {t:5d} hit {rec['experts_hit']:3d}  experts: grouped_mm "
                f"{rec['grouped_mm_experts_ms']:.3f} ms ({rec['grouped_mm_experts_tbps']:.2f} TB/s)"
                f"  fused {rec['fused_experts_ms']:.3f} ms ({rec['fused_experts_tbps']:.2f} TB/s)"
                f"  block: grouped_mm {rec['grouped_mm_block_ms']:.3f} fused "
                f"{rec['fused_block_ms']:.3f} ms  routing: torch {rec['router_torch_ms']:.3f} "
                f"fused {rec['router_fused_ms']:.3f} ms (gemm {rec['router_gemm_ms']:.3f}, "
                f"{rec['router_tokens_differ']} tokens differ)"
            )
            if a.sweep:
                rows = sweep(moe, t, a.iters, a.repeats)
                records += [{"kind": "sweep", **r} for r in rows]
                for which in ("gate_up", "down"):
                    ok = [r for r in rows if r["gemm"] == which and "ms" in r]
                    best = sorted(ok, key=lambda r: float(r["ms"]))[:3]  # type: ignore[arg-type]
                    print(
                        f"  best {which}: "
                        + "; ".join(f"{r['config']} {r['ms']:.3f}" for r in best)
                    )
    if a.out is not None:
        append_jsonl(a.out / "moe.jsonl", records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
