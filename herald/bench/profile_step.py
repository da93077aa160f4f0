"""Profile dense denoising forwards of a full-size random model (GPU): top kernels by CUDA time.

``python -m herald.bench.profile_step --preset llada2-mini --context 16384 --batch 32``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from herald.config import EngineConfig, SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.hooks import EngineHooks, SyntheticPrefill
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


def new_shape_probe(bs: int = 32, hkv: int = 4, g: int = 4, s0: int = 16384) -> None:
    """First-call vs repeat time of folded SDPA as the KV length grows by one block, per backend.

    cuDNN builds an execution plan per new shape; a decode step sees a new KV length every block.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(bs, hkv, g * 32, 128, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(bs, hkv, s0 + 4096, 128, device="cuda", dtype=torch.bfloat16)
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        times = []
        try:
            with sdpa_kernel(backend):
                for i in range(1, 6):
                    k = big[:, :, : s0 + 32 * i]
                    for _rep in range(2):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        F.scaled_dot_product_attention(q, k, k)
                        torch.cuda.synchronize()
                        times.append(round((time.perf_counter() - t0) * 1e3, 3))
            print(f"sdpa {name}: first/repeat ms per new length: {times}")
        except RuntimeError as e:
            print(f"sdpa {name}: unavailable ({str(e)[:80]})")


def moe_probe(
    tokens: int = 1024, top_k: int = 8, e: int = 256, h: int = 2048, i: int = 512
) -> None:
    """grouped_mm on the two weight layouts: [E, N, K] viewed transposed vs [E, K, N] contiguous."""
    x = torch.randn(tokens * top_k, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    wt = w.transpose(1, 2).contiguous()
    counts = torch.full((e,), tokens * top_k // e, dtype=torch.int32, device="cuda")
    offs = counts.cumsum(0, dtype=torch.int32)
    for name, b in (("transposed view", w.transpose(1, 2)), ("contiguous [E,K,N]", wt)):
        for _ in range(3):
            torch._grouped_mm(x, b, offs=offs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            torch._grouped_mm(x, b, offs=offs)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 20
        print(f"grouped_mm gate_up {name}: {dt * 1e3:.3f} ms, {w.numel() * 2 / dt / 1e12:.2f} TB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None, help="write the full profile table here")
    ap.add_argument("--probe-only", action="store_true", help="only the SDPA new-shape probe")
    args = ap.parse_args()
    if args.probe_only:
        new_shape_probe()
        return
    model, config, _ = load_model(
        args.preset, device="cuda", dtype=torch.bfloat16, random_init_seed=0, block_size=32
    )
    sdpa_probe(args.batch, config.num_kv_heads, config.num_queries_per_kv, args.context)
    if config.is_moe:
        moe_probe()
    eng = DenseEngine(
        model,
        config,
        EngineConfig(max_batch_size=args.batch, max_seq_len=args.context + 128),
        EngineHooks(synthetic_prefill=SyntheticPrefill()),
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
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=110
    )
    if args.out:
        Path(args.out).write_text(table)
    print(table[:6000])
    t = eng.stats.step_seconds[-args.steps :]
    print(f"step wall ms: {[round(x * 1e3, 1) for x in t]}")


if __name__ == "__main__":
    main()
