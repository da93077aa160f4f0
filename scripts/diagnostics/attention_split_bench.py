"""Decode attention over a dense 32K cache on the GPU: herald's Triton block attention with the
keys split in chunks (several chunk sizes, and unsplit) against the SDPA path the dense engine
takes by default (GQA folded, cuDNN where PyTorch picks it). LLaDA2.0-mini heads (16 query,
4 KV, 128 dim), a 32-token block per row at the end of each row's keys, bf16.

    python3 scripts/diagnostics/attention_split_bench.py --out $OUT/attention_split.json

Prints one line per path (median ms over the repetitions, the K/V bytes read per call over that
time) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from herald.attention.block_kernel import block_attention
from herald.attention.sdpa import sdpa_folded
from herald.bench.forward_point import time_forward


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``reps`` calls after one warm-up call."""
    times = time_forward(fn, torch.device("cuda"), warmup=1, reps=reps)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev, dt, b = torch.device("cuda"), torch.bfloat16, 32
    cap = a.context + b
    k = torch.randn(a.batch, 4, cap, 128, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(a.batch, b, 16, 128, device=dev, dtype=dt)
    prefix = torch.full((a.batch,), a.context - b, device=dev, dtype=torch.int32)
    kv_len = a.context
    nbytes = 2 * a.batch * 4 * kv_len * 128 * 2
    paths = {"sdpa_folded": lambda: sdpa_folded(q, k[:, :, :kv_len], v[:, :, :kv_len], None)}
    for split in (0, 2048, 4096, 8192):
        paths[f"triton_split_{split}"] = lambda s=split: block_attention(
            q, k, v, prefix, split_keys=s
        )
    ref = paths["sdpa_folded"]().float()
    rows = []
    for name, fn in paths.items():
        ms = _time(fn, a.reps)
        err = (fn().float() - ref).abs().max().item()
        rows.append({"path": name, "ms": ms, "tb_per_s": nbytes / ms / 1e9, "max_err": err})
        print(f"{name:>20}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s, max |diff| {err:.2e}")
    if a.out:
        meta = {"gpu": torch.cuda.get_device_name(), "batch": a.batch, "context": a.context}
        with open(a.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
