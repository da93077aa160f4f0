"""Where the offload engine's main stream spends its time (a diagnostic, not a benchmark).

Runs the HERALD engine at size with random prefill (no prompt forward) and prints, per block, the
main / retrieval / stall times and when the retrieval job ran; per step, the host time of each
phase; and, for one steady block, torch.profiler's top operators by device and by host time.

``python -m herald.bench.profile_offload --out /tmp/prof`` (defaults: LLaDA2.0-mini, 32K, batch 32,
5%, T = 20, CUDA graphs on). ``--threads 14,16`` repeats the run per selection thread count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from herald.bench.common import random_prompts
from herald.config import DEFAULT_KV_PAD, OFFLOAD_MODES, EngineConfig, OffloadConfig, SamplingParams
from herald.engine.hooks import EngineHooks, SyntheticPrefill
from herald.offload.engine import OffloadEngine


def _run(args: argparse.Namespace, model, config, threads: int | None, out: Path) -> dict:
    chosen = {"output_mode": args.output_mode} if args.output_mode else {}
    cfg = OffloadConfig.for_mode(
        args.mode, kv_budget=args.budget, selection_threads=threads, **chosen
    )
    seq = args.context + args.blocks * config.block_size
    t0 = time.perf_counter()
    ecfg = EngineConfig(
        max_batch_size=args.batch, max_seq_len=seq, kv_pad=args.kv_pad,
        use_cuda_graph=not args.eager, offload=cfg,
    )  # fmt: skip
    eng = OffloadEngine(model, config, ecfg, EngineHooks(synthetic_prefill=SyntheticPrefill()))
    print(f"[threads={eng.selection_threads}] engine {time.perf_counter() - t0:.1f} s", flush=True)
    (prompt,) = random_prompts(config, 1, args.context, seed=0)
    params = SamplingParams(
        max_new_tokens=args.blocks * config.block_size,
        num_denoise_steps=args.steps,
        ignore_eos=True,
    )
    for _ in range(args.batch):
        eng.add_request(prompt, params)
    steps: list[dict] = []
    prof_block = args.blocks - 2
    prof = None
    profiled = args.no_profile
    while eng.has_unfinished():
        label = f"{'commit' if eng._in_commit else 'denoise'}{eng._block_step}"
        blk = len(eng.stats.blocks)
        if blk == prof_block and label == "denoise0" and not profiled:
            prof = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            prof.__enter__()
        t = time.perf_counter()
        eng.step()
        steps.append({"block": blk, "phase": label, "s": time.perf_counter() - t})
        if prof is not None and len(eng.stats.blocks) > prof_block:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                table = prof.key_averages().table(sort_by=key, row_limit=30)
                (out / f"prof_t{eng.selection_threads}_{key}.txt").write_text(table)
            prof, profiled = None, True
    eng.close()
    blocks = [vars(b) for b in eng.stats.blocks]
    by_phase: dict[str, list[float]] = {}
    for s in steps:
        if s["block"] >= 1:
            by_phase.setdefault(s["phase"], []).append(s["s"])
    res = {
        "threads": eng.selection_threads,
        "prefill_s": eng.stats.prefill_seconds,
        "decode_tok_s": eng.stats.num_generated_tokens / eng.stats.decode_seconds,
        "blocks": blocks,
        "median_step_ms": {k: 1e3 * statistics.median(v) for k, v in by_phase.items()},
        "slow_steps": [
            {**x, "ms": round(1e3 * x["s"], 1)} for x in steps if x["s"] > 0.05 and x["block"]
        ],
    }
    print(json.dumps({k: v for k, v in res.items() if k != "blocks"}, indent=1))
    for b in blocks:
        print(
            "  main {main:.3f} retr {retrieval:.3f} stall {stall:.3f} submit {retrieval_submit} "
            "start {retrieval_start} end {retrieval_end} steps {steps} layers "
            "{retrieval_layers}".format(**b)
        )
    return res


def main(argv: list[str] | None = None) -> int:
    from herald.models.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("/tmp/profile_offload"))
    ap.add_argument("--preset", default="llada2-mini")
    ap.add_argument("--mode", default="herald", choices=list(OFFLOAD_MODES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--output-mode", choices=["full", "selected"], help="default: the mode's preset"
    )
    ap.add_argument("--threads", default="", help="comma-separated selection thread counts")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--kv-pad", type=int, default=DEFAULT_KV_PAD, help="OffloadEngine kv_pad (0 = off)"
    )
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, config, _ = load_model(
        args.preset, device=args.device, dtype=torch.bfloat16, random_init_seed=0, block_size=32
    )
    runs = []
    counts: list[int | None] = [int(x) for x in args.threads.split(",") if x]
    for th in counts or [None]:
        runs.append(_run(args, model, config, th, args.out))
    (args.out / "profile_offload.json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
