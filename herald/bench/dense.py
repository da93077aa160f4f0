"""Dense decode throughput at the paper's Dense batch sizes (Table II of HERALD §VI-C).

Full-size architectures with random bf16 weights built directly on the GPU (speed does not depend
on weight values). Each case prefills ``batch`` prompts of ``context`` random tokens, then decodes
with B = 32 (the model's block size is overridden to 32 for SDAR, as in the paper), fixed T = 20
denoising steps per block, EOS ignored. Decode throughput = generated tokens / decode wall time
(prefill excluded, reported separately). Steady-state throughput uses the median forward time:
``batch * B / ((T + 1) * median_forward)`` (T denoising forwards + 1 commit forward per block).

Run on the GPU machine: ``python -m herald.bench.dense --out results/dense``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from herald.bench.common import (
    cap_gpu_memory,
    command_line,
    machine_info,
    random_prompts,
    write_json,
)
from herald.config import DEFAULT_KV_PAD, EngineConfig, SamplingParams
from herald.engine.dense import DenseEngine

# (preset, context tokens, batch) from the paper's Table II Dense column, and its tokens/s (H100).
PAPER_DENSE = [
    ("llada2-mini", 16384, 32, 1864.0),
    ("llada2-mini", 32768, 16, 1168.0),
    ("sdar-8b-chat", 16384, 15, 754.0),
    ("sdar-8b-chat", 32768, 8, 458.0),
]


def run_case(
    model: Any,
    config: Any,
    context: int,
    batch: int,
    new_tokens: int,
    steps: int,
    seed: int,
    kv_pad: int = DEFAULT_KV_PAD,
) -> dict[str, Any]:
    prompts = random_prompts(config, batch, context, seed)
    ecfg = EngineConfig(
        max_batch_size=batch, max_seq_len=context + new_tokens, check_finite=True, kv_pad=kv_pad
    )
    engine = DenseEngine(model, config, ecfg)
    params = SamplingParams(max_new_tokens=new_tokens, num_denoise_steps=steps, ignore_eos=True)
    # Warm-up at the measured batch size (CUDA-graph capture, cuDNN plans), as a server does once
    # at start-up; then reset the counters.
    b = config.block_size
    engine.generate(
        [p[:b] for p in prompts],
        SamplingParams(max_new_tokens=b, ignore_eos=True, num_denoise_steps=2),
    )
    engine.stats = type(engine.stats)()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    st = engine.stats
    gen = sum(len(r.output_ids) for r in reqs)
    fwd = st.step_seconds
    med = statistics.median(fwd)
    out = {
        "context": context,
        "batch": batch,
        "kv_pad": kv_pad,
        "new_tokens_per_request": new_tokens,
        "block_size": b,
        "num_denoise_steps": steps,
        "generated_tokens": gen,
        "decode_seconds": st.decode_seconds,
        "decode_tokens_per_s": gen / st.decode_seconds,
        "steady_tokens_per_s": batch * b / ((steps + 1) * med),
        "median_forward_ms": med * 1e3,
        "min_forward_ms": min(fwd) * 1e3,
        "num_forwards": len(fwd),
        "prefill_seconds": st.prefill_seconds,
        "prefill_tokens": st.num_prefill_tokens,
        "prefill_tokens_per_s": st.num_prefill_tokens / max(st.prefill_seconds, 1e-9),
        "wall_seconds": wall,
        "nonfinite_forwards": st.num_nonfinite_steps,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kv_cache_gib": engine.cache.num_bytes / 2**30,
        "steps_per_block": reqs[0].steps_per_block,
        "mean_forward_ms": statistics.fmean(fwd) * 1e3,
        "forward_ms": [round(x * 1e3, 2) for x in fwd],
    }
    del engine, reqs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def write_report(json_path: Path) -> Path:
    """Write README.md next to ``json_path``: the table, the paper's figures, and the analysis."""
    import json

    d = json.loads(json_path.read_text())
    m = d["machine"]
    cap = d.get("gpu_memory_cap_gb")
    lines = [
        "# Dense decode throughput (HERALD §VI-C)",
        "",
        f"`{d['command']}` on {m['date_utc']}: {m.get('gpu')} ({m.get('gpu_memory_gib')} GiB"
        f"{f', capped at {cap} GB' if cap else ''}), {m.get('cpu_model')} x{m.get('cpu_count')}, "
        f"torch {m['torch']}, CUDA {m.get('cuda')}.",
        "",
        "Full-size architectures with random bf16 weights; B = 32, fixed T = 20 denoising steps "
        "per block plus one commit forward, EOS ignored, real prefill of random-token prompts "
        "(excluded from decode time). Decode tokens/s = generated tokens / decode wall time after "
        "a warm-up at the same batch size (CUDA-graph capture); steady = batch x B / (21 x median "
        "forward).",
        "",
        "| model | context | batch | decode tok/s | steady tok/s | paper Dense (H100) | ratio "
        "| median forward ms | prefill tok/s | peak GPU GiB | KV GiB | non-finite |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in d["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['preset']} | {r['context']} | {r['batch']} | {r['status']} |")
            continue
        lines.append(
            f"| {r['preset']} | {r['context']} | {r['batch']} | {r['decode_tokens_per_s']:.0f} "
            f"| {r['steady_tokens_per_s']:.0f} | {r['paper_h100_tokens_per_s']:.0f} "
            f"| {r['ratio_vs_paper']:.2f}x | {r['median_forward_ms']:.1f} "
            f"| {r['prefill_tokens_per_s']:.0f} | {r['peak_gpu_memory_gib']:.1f} "
            f"| {r['kv_cache_gib']:.1f} | {r['nonfinite_forwards']} |"
        )
    ok = [r for r in d["results"] if r["status"] == "ok"]
    met = [r for r in ok if r["ratio_vs_paper"] >= 1.0]
    missed = [r for r in ok if r["ratio_vs_paper"] < 1.0]
    lines += ["", "## Against the target (at least the paper's Dense figure, same batch)", ""]
    for r in met:
        lines.append(f"- {r['preset']} {r['context']}: met, {r['ratio_vs_paper']:.2f}x")
    for r in missed:
        lines.append(
            f"- {r['preset']} {r['context']}: **missed by "
            f"{(1 - r['ratio_vs_paper']) * 100:.0f}%** ({r['ratio_vs_paper']:.2f}x)"
        )
    lines += ["", PROFILE_NOTES]
    out = json_path.parent / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out


PROFILE_NOTES = """## Where a LLaDA2.0-mini forward goes (profile of 2026-11-30)

`python -m herald.bench.profile_step --preset llada2-mini --context 16384 --batch 32`, before the
element-wise fusion, per forward: the MoE expert GEMMs (`torch._grouped_mm`; all 256 experts'
weights, 1.6 GB/layer, are read every forward) ~10.5 ms at ~3.1 TB/s; exact attention (cuDNN)
~5.4 ms, at the HBM floor for 21 GB of K/V; ~14 ms of small kernels. Fusing RMSNorm, RoPE,
SwiGLU and the MoE router/combine with torch.compile cut the median forward from ~31 to ~25 ms.
What remains: the grouped GEMM at ~70% of HBM bandwidth (a fused MoE kernel reading each expert
once at full bandwidth would save ~3 ms), the fp32 router GEMM (fp32 as the model defines it), the
sampling pass over 157K-vocabulary fp32 logits, and the 21st (commit) forward per block.

## Caveats

- The paper's figures are from an H100 (3.35 TB/s HBM); this is an H200 (4.8 TB/s). Decoding at
  these batch sizes is largely memory-bound, so "meets the paper" on the H200 is not a
  like-for-like win over the paper's system.
- Decode tokens/s is below the steady rate (median forward) by 6-21%. Known parts: the first
  step of each block samples all B masked positions over the full vocabulary. Suspected, not yet
  measured: cuDNN building a new attention plan for every new KV length, i.e. once per block
  (`python -m herald.bench.profile_step --probe-only` measures it). The larger gap on
  LLaDA2.0-mini 16K is not explained yet.
- The committed `dense.json` comes from the run before the per-forward times (`forward_ms`)
  were added to the script; the next run records them.
- The llada2-mini preset's config says `max_position_embeddings` 16384 (the dFactory training
  config); the model card states a 32K context, which the 32K rows use (RoPE extended).
"""


def main(argv: list[str] | None = None) -> int:
    from herald.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("results/dense"))
    ap.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--gpu-memory-gb", type=float, default=None, help="cap GPU memory (GB)")
    ap.add_argument("--only", default=None, help="comma list of presets to run")
    ap.add_argument("--contexts", default=None, help="comma list of contexts to run")
    ap.add_argument("--kv-pad", type=int, default=DEFAULT_KV_PAD, help="DenseEngine kv_pad")
    ap.add_argument("--report", type=Path, default=None, help="only rewrite README.md from JSON")
    args = ap.parse_args(argv)
    if args.report is not None:
        print(f"wrote {write_report(args.report)}")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    cap_gpu_memory(args.gpu_memory_gb)
    results: list[dict[str, Any]] = []
    cases = [c for c in PAPER_DENSE if args.only is None or c[0] in args.only.split(",")]
    if args.contexts:
        cases = [c for c in cases if str(c[1]) in args.contexts.split(",")]
    for preset in dict.fromkeys(c[0] for c in cases):
        t0 = time.perf_counter()
        model, config, _ = load_model(
            preset,
            device="cuda",
            dtype=torch.bfloat16,
            random_init_seed=0,
            block_size=args.block_size,
        )
        print(f"[{preset}] built random model in {time.perf_counter() - t0:.1f} s", flush=True)
        for _, ctx, bs, paper in (c for c in cases if c[0] == preset):
            try:
                r = run_case(
                    model, config, ctx, bs, args.new_tokens, args.steps, ctx + bs, args.kv_pad
                )
                r["status"] = "ok"
            except torch.OutOfMemoryError as e:
                r = {"context": ctx, "batch": bs, "status": f"oom: {str(e)[:200]}"}
                torch.cuda.empty_cache()
            r.update(preset=preset, paper_h100_tokens_per_s=paper)
            if r["status"] == "ok":
                r["ratio_vs_paper"] = r["decode_tokens_per_s"] / paper
            results.append(r)
            print(
                f"[{preset} {ctx} bs{bs}] {r.get('decode_tokens_per_s', 0):.0f} tok/s "
                f"(paper {paper:.0f}), median fwd {r.get('median_forward_ms', 0):.1f} ms, "
                f"peak {r.get('peak_gpu_memory_gib', 0):.1f} GiB, {r['status']}",
                flush=True,
            )
        del model
        gc.collect()
        torch.cuda.empty_cache()
    payload = {
        "command": command_line(),
        "machine": machine_info(),
        "gpu_memory_cap_gb": args.gpu_memory_gb,
        "results": results,
    }
    name = "dense" if args.gpu_memory_gb is None else f"dense_cap{int(args.gpu_memory_gb)}gb"
    write_json(args.out / f"{name}.json", payload)
    write_report(args.out / f"{name}.json")
    print("\npreset        context  batch  tok/s  paper  ratio  fwd_ms  peakGiB")
    for r in results:
        if r["status"] == "ok":
            print(
                f"{r['preset']:<13} {r['context']:>7} {r['batch']:>6} "
                f"{r['decode_tokens_per_s']:>6.0f} {r['paper_h100_tokens_per_s']:>6.0f} "
                f"{r['ratio_vs_paper']:>6.2f} {r['median_forward_ms']:>7.1f} "
                f"{r['peak_gpu_memory_gib']:>8.1f}"
            )
        else:
            print(f"{r['preset']:<13} {r['context']:>7} {r['batch']:>6}  {r['status']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
