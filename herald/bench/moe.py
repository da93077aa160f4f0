"""One LLaDA2.0-mini MoE block on the GPU: the grouped-GEMM path against the fused Triton path,
per token count, with the expert GEMMs' weight bandwidth, and the routing after the router GEMM
in PyTorch against the fused router kernel; optionally a sweep of the fused GEMMs' tile configs,
each GEMM timed alone (``--sweep-block-m`` / ``--sweep-block-k`` pick the tiles that fix the
numerics; the block_n, warp and stage values of ``--sweep-block-n`` / ``--sweep-warps`` /
``--sweep-stages`` are swept for each). The fused path runs with its defaults,
the per-token-count launch configs of :data:`herald.layers.moe_triton.TILE_TABLE`.

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
from herald.layers.moe_triton import (
    TILE_TABLE,
    TileConfig,
    align_by_expert,
    experts_fused,
    launch_down,
    launch_gate_up,
)
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


H200_SMEM_BYTES = 232_448
"""The H200's shared memory per block (227 KiB): the sweep skips, and the tuned table avoids,
configs whose pipeline needs more."""


def sweep_grid(
    block_ms: list[int],
    block_ks: list[int],
    block_ns: tuple[int, ...] | list[int] = (64, 128, 256),
    warps: tuple[int, ...] | list[int] = (4, 8),
    stages: tuple[int, ...] | list[int] = (3, 4, 5),
) -> list[TileConfig]:
    """Tile configs to try: every (block_m, block_k) asked for, with each block_n, warp count and
    pipeline depth given (by default block_n 64/128/256, 4 or 8 warps and 3-5 stages)."""
    return [
        TileConfig(block_n=n, num_warps=w, num_stages=s, block_m=m, block_k=k)
        for m, k, n, w, s in itertools.product(block_ms, block_ks, block_ns, warps, stages)
    ]


def smem_bytes(cfg: TileConfig, gemm: str) -> int:
    """Shared memory of a config's pipeline: per stage the A tile and one (down) or two (gate and
    up) weight tiles, bf16."""
    weights = 2 if gemm == "gate_up" else 1
    return cfg.num_stages * (cfg.block_m * cfg.block_k + weights * cfg.block_k * cfg.block_n) * 2


def sweep(
    moe: SparseMoE, tokens: int, iters: int, repeats: int, grid: list[TileConfig]
) -> list[dict[str, object]]:
    """Each fused GEMM timed alone (its launch only, the alignment done once per block_m) for
    every config of ``grid`` that fits in shared memory, with its weight bandwidth; and the
    alignment itself, by sort and by count, timed once per block_m (``gemm`` "align")."""
    x = torch.randn(tokens, moe.experts_gate_up.shape[2], device="cuda", dtype=torch.bfloat16)
    idx, _ = moe.route(x)
    wgu, wd = moe.experts_gate_up, moe.experts_down
    hit = int(idx.unique().numel())
    hidden, inter = wd.shape[1], wd.shape[2]
    gemm_bytes = {"gate_up": hit * 2 * inter * hidden * 2, "down": hit * hidden * inter * 2}
    top_k = idx.shape[1]
    out: list[dict[str, object]] = []
    aligned: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for cfg in grid:
        if cfg.block_m not in aligned:
            rows, tile_expert = align_by_expert(idx, wgu.shape[0], cfg.block_m)
            act = launch_gate_up(x, wgu, rows, tile_expert, top_k, _fill_config(cfg))
            aligned[cfg.block_m] = (rows, tile_expert, act)
            for method in ("sort", "count"):
                align = functools.partial(
                    align_by_expert, idx, wgu.shape[0], cfg.block_m, method=method
                )
                ms = _time_ms(align, iters, repeats)
                key = {"tokens": tokens, "gemm": "align", "method": method, "block_m": cfg.block_m}
                out.append({**key, "ms": ms})
        rows, tile_expert, act = aligned[cfg.block_m]
        calls = {
            "gate_up": functools.partial(launch_gate_up, x, wgu, rows, tile_expert, top_k, cfg),
            "down": functools.partial(launch_down, act, wd, rows, tile_expert, idx.numel(), cfg),
        }
        for gemm, call in calls.items():
            rec: dict[str, object] = {"tokens": tokens, "gemm": gemm, "config": vars(cfg)}
            if smem_bytes(cfg, gemm) > H200_SMEM_BYTES:
                continue
            try:
                ms = _time_ms(call, iters, repeats)
            except Exception as exc:  # out of shared memory or registers for this tile
                out.append({**rec, "error": str(exc)[:200]})
                continue
            out.append({**rec, "ms": ms, "tbps": gemm_bytes[gemm] / ms / 1e9})
    return out


def _fill_config(cfg: TileConfig) -> TileConfig:
    """The default gate/up launch with ``cfg``'s block_m and block_k (to fill ``act``)."""
    return TileConfig(
        block_n=64, num_warps=4, num_stages=3, block_m=cfg.block_m, block_k=cfg.block_k
    )


def summarize_sweep(rows: list[dict[str, object]]) -> list[str]:
    """Lines: per GEMM the three fastest configs, then per (block_m, block_k), which fix the
    numerics and so must be one choice for every token count, the best time of each GEMM."""
    lines = []
    best: dict[str, dict[tuple[int, int], float]] = {}
    ok = [r for r in rows if "ms" in r]
    for gemm in ("gate_up", "down"):
        mine = sorted((r for r in ok if r["gemm"] == gemm), key=lambda r: float(r["ms"]))  # type: ignore[arg-type]
        lines.append(
            f"  best {gemm}: "
            + "; ".join(
                f"{_cfg_str(r['config'])} {r['ms']:.3f} ms {r['tbps']:.2f} TB/s" for r in mine[:3]
            )
        )
        by_mk: dict[tuple[int, int], float] = {}
        for r in mine:
            c = r["config"]
            assert isinstance(c, dict)
            key = (int(c["block_m"]), int(c["block_k"]))
            by_mk.setdefault(key, float(r["ms"]))  # type: ignore[arg-type]
        lines.append(
            f"  {gemm} best per (block_m, block_k): "
            + ", ".join(f"{m}x{k} {ms:.3f}" for (m, k), ms in sorted(by_mk.items()))
        )
        best[gemm] = by_mk
    align = [r for r in ok if r["gemm"] == "align"]
    if align:
        lines.append(
            "  alignment per block_m: "
            + ", ".join(
                f"{r['block_m']} {r.get('method', 'sort')} {r['ms']:.3f}"
                for r in sorted(align, key=lambda r: (str(r["block_m"]), str(r.get("method"))))
            )
        )
    both = {mk: ms + best["down"][mk] for mk, ms in best["gate_up"].items() if mk in best["down"]}
    lines.append(
        "  both GEMMs, best per (block_m, block_k): "
        + ", ".join(f"{m}x{k} {ms:.3f}" for (m, k), ms in sorted(both.items(), key=lambda x: x[1]))
    )
    return lines


def _cfg_str(c: object) -> str:
    assert isinstance(c, dict)
    return f"m{c['block_m']} k{c['block_k']} n{c['block_n']} w{c['num_warps']} s{c['num_stages']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m herald.bench.moe", description=__doc__)
    p.add_argument("--tokens", default="32,256,1024,2560,4096", help="comma-separated token counts")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also sweep the fused GEMMs' tiles")
    p.add_argument("--sweep-block-m", default="16,32,64", help="block_m values of the sweep")
    p.add_argument("--sweep-block-k", default="64,128", help="block_k values of the sweep")
    p.add_argument("--sweep-block-n", default="64,128,256", help="block_n values of the sweep")
    p.add_argument("--sweep-warps", default="4,8", help="warp counts of the sweep")
    p.add_argument("--sweep-stages", default="3,4,5", help="pipeline depths of the sweep")
    p.add_argument("--out", type=Path, default=None, help="write moe.jsonl here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    moe = _moe(a.hidden, a.inter, a.experts)
    lower = 0
    for limit, gate_up, down in TILE_TABLE:
        span = f"T {lower + 1}..{limit}" if limit is not None else f"T > {lower}"
        print(f"fused tiles {span}: gate_up {_cfg_str(vars(gate_up))}, down {_cfg_str(vars(down))}")
        lower = limit if limit is not None else lower
    with torch.no_grad():
        for t in (int(s) for s in a.tokens.split(",")):
            rec = measure(moe, t, a.iters, a.repeats)
            records: list[dict[str, object]] = [{"kind": "point", **rec}]
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
                grid = sweep_grid(
                    _ints(a.sweep_block_m),
                    _ints(a.sweep_block_k),
                    _ints(a.sweep_block_n),
                    _ints(a.sweep_warps),
                    _ints(a.sweep_stages),
                )
                rows = sweep(moe, t, a.iters, a.repeats, grid)
                records += [{"kind": "sweep", **r} for r in rows]
                for line in summarize_sweep(rows):
                    print(line)
            if a.out is not None:  # per token count: a run cut short keeps what it measured
                append_jsonl(a.out / "moe.jsonl", records)
    return 0


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


if __name__ == "__main__":
    raise SystemExit(main())
