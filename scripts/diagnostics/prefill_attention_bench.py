"""Prefill attention on the GPU: herald's block-causal Triton kernel, over a sweep of its launch
parameters, against the SDPA path prefill chunks take by default (a per-query mask, K/V expanded
to the query heads). One layer's attention over a whole prompt, in the engines' chunks (4,096
tokens: each chunk's queries see every earlier chunk and their own blocks), bf16, block 32.

    python3 scripts/diagnostics/prefill_attention_bench.py --out $OUT/prefill_attention.json

Heads: LLaDA2.0-mini (16 query, 4 KV, 128 dim) and SDAR-8B-Chat (32 query, 8 KV, 128 dim).
Prints one line per (model, prompt, path): milliseconds per layer and prompt (median of the
repetitions), TFLOP/s of the visible scores (4 x head_dim x query heads x visible keys, summed
over the queries), the largest difference from the SDPA path; writes them as JSON with the best
tile per prompt length.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch

from herald.attention.block_kernel import PREFILL_TILE, block_attention
from herald.attention.masks import block_causal_chunk_mask
from herald.attention.sdpa import sdpa_gqa
from herald.bench.forward_point import time_forward

MAX_ERR = 2e-2
"""Largest difference from the SDPA path a measured tile may have (bf16 outputs of unit-scale
attention); a tile past it is recorded as wrong and never the best."""
HEADS = {"llada2-mini": (16, 4, 128), "sdar-8b-chat": (32, 8, 128)}
BLOCK = 32


def _prompt_attention(q, k, v, chunk: int, path) -> torch.Tensor:
    """The prompt's attention, chunk by chunk (each written into ``k``/``v`` beforehand)."""
    outs = []
    for s in range(0, q.shape[1], chunk):
        e = min(q.shape[1], s + chunk)
        outs.append(path(q[:, s:e], s))
    return torch.cat(outs, dim=1)


def _visible_flops(length: int, hq: int, d: int) -> float:
    """4 x head_dim x query heads x the keys each query sees (its block and every earlier one)."""
    visible = sum((t // BLOCK + 1) * BLOCK for t in range(length))
    return 4.0 * d * hq * visible


def _paths(k: torch.Tensor, v: torch.Tensor, tiles: list[dict[str, int]]) -> dict[str, Any]:
    """The SDPA path and one Triton path per tile: ``path(q_chunk, start)``."""
    dev = k.device

    def sdpa(qc: torch.Tensor, s: int) -> torch.Tensor:
        e = s + qc.shape[1]
        mask = block_causal_chunk_mask(s, qc.shape[1], BLOCK, e, dev)
        return sdpa_gqa(qc, k[:, :, :e], v[:, :, :e], mask)

    def triton(tile: dict[str, int]) -> Any:
        def path(qc: torch.Tensor, s: int) -> torch.Tensor:
            prefix = torch.tensor([s], device=dev, dtype=torch.int32)
            return block_attention(qc, k, v, prefix, causal_block=BLOCK, **tile)

        return path

    paths: dict[str, Any] = {"sdpa": sdpa}
    for t in tiles:
        paths["triton r{rows} n{block_n} w{num_warps} s{num_stages}".format(**t)] = triton(t)
    return paths


def _measure(model: str, length: int, tiles: list[dict[str, int]], a: Any) -> list[dict]:
    """Every path at one head shape and prompt length (module docstring)."""
    hq, hkv, d = HEADS[model]
    dev = torch.device(a.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(length)
    k = torch.randn(1, hkv, length, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(1, hkv, length, d, device=dev, dtype=dt, generator=g)
    q = torch.randn(1, length, hq, d, device=dev, dtype=dt, generator=g)
    flops = _visible_flops(length, hq, d)
    paths = _paths(k, v, tiles)
    ref = _prompt_attention(q, k, v, a.chunk, paths["sdpa"]).float()
    records = []
    for name, path in paths.items():
        rec: dict[str, Any] = {"model": model, "prompt": length, "chunk": a.chunk, "path": name}
        try:
            err = (_prompt_attention(q, k, v, a.chunk, path).float() - ref).abs().max().item()
            times = time_forward(
                lambda p=path: _prompt_attention(q, k, v, a.chunk, p), dev, warmup=1, reps=a.reps
            )
            ms = sorted(times)[len(times) // 2]
            ok = err < MAX_ERR  # a NaN error is not ok either
            rec.update(ms=ms, tflops=flops / ms / 1e9, max_err=err if ok else str(err))
            rec["status"] = "ok" if ok else f"wrong: max |diff| {err} from the SDPA path"
            line = f"{ms:8.3f} ms, {flops / ms / 1e9:6.1f} TFLOP/s, max |diff| {err:.2e}"
        except Exception as exc:  # a tile that does not fit the card's shared memory
            rec.update(status=f"failed: {type(exc).__name__}: {str(exc)[:200]}")
            line = rec["status"]
        print(f"{model} {length:>6} {name:>26}: {line}", flush=True)
        records.append(rec)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="4096,16384,32768", help="prompt lengths, commas")
    ap.add_argument("--models", default=",".join(HEADS), help="head shapes, commas")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the default tile")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tiles = [dict(PREFILL_TILE)]
    if not a.quick:
        for rows, bn, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
            t = {"rows": rows, "block_n": bn, "num_warps": warps, "num_stages": stages}
            if t not in tiles:
                tiles.append(t)
    records = []
    for model in a.models.split(","):
        for length in (int(x) for x in a.prompts.split(",")):
            records += _measure(model, length, tiles, a)
    best: dict[str, dict] = {}
    sdpa_ms: dict[str, float] = {}
    for r in records:
        key = f"{r['model']} {r['prompt']}"
        if r["status"] != "ok":
            continue
        if r["path"] == "sdpa":
            sdpa_ms[key] = r["ms"]
        elif key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for key, r in best.items():
        ratio = sdpa_ms[key] / r["ms"] if key in sdpa_ms else float("nan")
        print(f"best {key}: {r['path']} {r['ms']:.3f} ms ({ratio:.2f}x sdpa)")
    if a.out:
        gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
        meta = {"gpu": gpu, "torch": torch.__version__}
        with open(a.out, "w") as f:
            json.dump({**meta, "records": records, "best": best}, f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
