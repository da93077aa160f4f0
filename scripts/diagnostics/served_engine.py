"""A server's load on the engine alone: closed-loop clients driving ``Engine.add_request`` and
``Engine.step`` in one thread, with no HTTP, no event loop and no other process.

``herald bench serve`` measures what a client of ``herald serve`` gets; when that falls short of
``herald bench throughput``, this script says whether the engine under a server's arrivals
(requests joining at every block boundary, real prefill, rows at mixed positions) is the cause,
or the server around it. It builds the engine as ``herald serve`` does (its defaults, the same
warm-up), keeps ``--concurrency`` requests in flight until ``--requests`` have finished, and
writes one JSON record: the engine's prefill and decode seconds, the seconds its joins took
(the prompt's KV to the CPU pool and the first block's selection, timed around
``Engine._join``), each block's main / retrieval / stall seconds and batch, and the generated
tokens per decode second.

    python scripts/diagnostics/served_engine.py --model llada2-mini --device cuda \\
        --mode herald --prompt-tokens 16256 --concurrency 32 --requests 64 --out served.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from herald.bench.common import random_prompts
from herald.config import SamplingParams
from herald.engines import build_engine, offload_for_mode
from herald.models.loader import load_model
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.warmup import warm_up_engine


def _timed(stats: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stats[name] = stats.get(name, 0.0) + time.perf_counter() - t0
            stats[name + "_calls"] = stats.get(name + "_calls", 0) + 1

    return wrapper


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = None if args.mode == "dense" else torch.bfloat16  # offloading modes run bf16
    model, config, tokenizer = load_model(
        args.model, device=device, dtype=dtype, random_init_seed=0
    )
    ecfg = SERVE_DEFAULTS.replace(
        max_batch_size=args.concurrency,
        max_seq_len=args.prompt_tokens + args.max_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        max_waiting=max(SERVE_DEFAULTS.max_waiting, args.concurrency),
        offload=offload_for_mode(args.mode),
    )
    eng = build_engine(model, config, ecfg)
    t0 = time.perf_counter()
    warm_up_engine(eng, tokenizer)
    warm_s = time.perf_counter() - t0
    timers: dict[str, float] = {}
    eng._join = _timed(timers, "join", eng._join)  # type: ignore[method-assign]
    eng._prefill = _timed(timers, "prefill_chunks", eng._prefill)  # type: ignore[method-assign]
    prompts = random_prompts(config, args.requests, args.prompt_tokens, seed=1)
    params = SamplingParams(
        max_new_tokens=args.max_tokens, num_denoise_steps=args.steps, ignore_eos=True
    )
    pending, live, done = list(prompts), 0, 0
    t_start = time.perf_counter()
    steps = 0
    while done < args.requests:
        while pending and live < args.concurrency:
            eng.add_request(pending.pop(), params)
            live += 1
        finished = eng.step()
        steps += 1
        done += len(finished)
        live -= len(finished)
    wall = time.perf_counter() - t_start
    st = eng.stats
    blocks = [
        dict(main=b.main, retrieval=b.retrieval, stall=b.stall, batch=b.batch, steps=b.steps,
             layers=b.retrieval_layers)
        for b in st.blocks
    ]  # fmt: skip
    eng.close()
    join = timers.get("join", 0.0)
    decode = st.decode_seconds
    return dict(
        model=args.model, mode=args.mode, prompt_tokens=args.prompt_tokens,
        concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
        steps=args.steps, max_prefill_tokens=args.max_prefill_tokens,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        warm_up_s=warm_s, wall_s=wall, engine_steps=steps,
        generated_tokens=st.num_generated_tokens, prefill_s=st.prefill_seconds,
        decode_s=decode, timers=timers,
        decode_tokens_per_s=st.num_generated_tokens / decode if decode else None,
        mean_batch=st.num_batch_rows / max(st.num_forwards, 1),
        blocks=blocks,
        main_s=sum(b["main"] for b in blocks), stall_s=sum(b["stall"] for b in blocks),
        join_s=join,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llada2-mini")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default="herald")
    ap.add_argument("--prompt-tokens", type=int, default=16256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-prefill-tokens", type=int, default=65536)
    ap.add_argument("--out", type=Path, default=None, help="JSON file to write (default: stdout)")
    args = ap.parse_args(argv)
    rec = run(args)
    short = {k: v for k, v in rec.items() if k != "blocks"}
    print(json.dumps(short, indent=1))
    for i, b in enumerate(rec["blocks"]):
        print(f"block {i}: batch {b['batch']}, main {b['main']:.3f} s, retrieval "
              f"{b['retrieval']:.3f} s, stall {b['stall']:.3f} s, steps {b['steps']}")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
