"""Profile dense denoising forwards of a full-size random model (GPU): top kernels by CUDA time.

``python -m herald.bench.profile_step --preset llada2-mini --context 16384 --batch 32``
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from herald.config import SamplingParams
from herald.engine.dense import DenseEngine
from herald.models.loader import load_model


def sdpa_probe(bs: int, hkv: int, g: int, s: int, d: int = 128) -> None:
    q = torch.randn(bs, hkv, g * 32, d, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(bs, hkv, s + 4096, d, device="cuda", dtype=torch.bfloat16)
    view = big[:, :, :s]
    cont = view.contiguous()
    for name, k in (("strided view", view), ("contiguous", cont)):
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            F.scaled_dot_product_attention(q, k, k)
        torch.cuda.synchronize()
        print(
            f"sdpa folded bs{bs} hkv{hkv} S{s} {name}: {(time.perf_counter() - t0) / 20e-3:.3f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model, config, _ = load_model(
        args.preset, device="cuda", dtype=torch.bfloat16, random_init_seed=0, block_size=32
    )
    sdpa_probe(args.batch, config.num_kv_heads, config.num_queries_per_kv, args.context)
    eng = DenseEngine(
        model,
        config,
        max_batch_size=args.batch,
        max_seq_len=args.context + 128,
        random_prefill=True,
    )
    prompts = torch.randint(0, 1000, (args.batch, args.context)).tolist()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=96, num_denoise_steps=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
    )
    t = eng.stats.step_seconds[-args.steps :]
    print(f"step wall ms: {[round(x * 1e3, 1) for x in t]}")


if __name__ == "__main__":
    main()
