"""Bounded load test of ``herald serve`` over loopback: throughput and latency percentiles.

Starts the real server (uvicorn, 127.0.0.1, a free port) in this process, sends a fixed number of
streaming completions with a fixed concurrency and a hard deadline, and writes ``serve.json``
(``--mode dense``) or ``serve-<mode>.json`` to ``--out``, then a README with one row per JSON file
found there::

    python -m herald.bench.serve_load --out results/serve
    python -m herald.bench.serve_load --out results/serve --mode herald
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from herald.config import OffloadConfig
from herald.engines import MODES
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.launch import bound_url, build_app, make_server, reserve_port


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def _one(c: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids", [])
            if ids and first is None:
                first = time.perf_counter() - t0
            tokens += len(ids)
    return {"latency": time.perf_counter() - t0, "ttfb": first or float("nan"), "tokens": tokens}


async def _load(url: str, args: argparse.Namespace) -> tuple[list[dict[str, float]], float]:
    sem = asyncio.Semaphore(args.concurrency)

    async def run(i: int, c: httpx.AsyncClient) -> dict[str, float]:
        body = {"prompt": f"load test request {i}: " + "x" * args.prompt_chars,
                "max_tokens": args.max_tokens, "steps": args.steps, "stream": True}  # fmt: skip
        async with sem:
            return await _one(c, body)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.deadline)) as c:
        tasks = [run(i, c) for i in range(args.requests)]
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.deadline)
    return list(results), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-sdar")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="fixed-steps mode, steps per block")
    p.add_argument("--prompt-chars", type=int, default=64)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--mode", default="dense", choices=list(MODES))
    p.add_argument("--kv-budget", type=float, default=None, help="offloading modes (preset's)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    # Offloading modes run bf16; dense runs fp32 on the CPU (as herald generate does).
    dtype = torch.float32 if args.device == "cpu" and args.mode == "dense" else torch.bfloat16
    offload = None
    if args.mode != "dense":
        extra = {} if args.kv_budget is None else {"kv_budget": args.kv_budget}
        offload = OffloadConfig.for_mode(args.mode, **extra)
    engine = SERVE_DEFAULTS.replace(
        max_batch_size=args.max_batch_size,
        max_seq_len=1024,
        max_waiting=max(64, args.requests),
        offload=offload,
    )
    sock = reserve_port("127.0.0.1", 0)  # as herald serve: bound first, a port nobody holds
    app = build_app(args.model, engine, device=args.device, dtype=dtype)
    server = make_server(app, sock, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t_start = time.monotonic()
    while not server.started:
        if time.monotonic() - t_start > args.deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    load_avg = os.getloadavg()[0]  # the machine is shared: other work skews the numbers
    try:
        results, wall = asyncio.run(_load(bound_url(sock), args))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    lat = [r["latency"] for r in results]
    ttfb = [r["ttfb"] for r in results]
    tokens = sum(int(r["tokens"]) for r in results)
    lat_s = {f"p{q}": _pct(lat, q) for q in (50, 90, 99)} | {"mean": statistics.mean(lat)}
    fb = {f"p{q}": _pct(ttfb, q) for q in (50, 90, 99)}
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "kv_budget": offload.kv_budget if offload is not None else 1.0,
        "dtype": str(dtype).removeprefix("torch."),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_avg_1min_at_start": load_avg,
        "completed": len(results),
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "latency_s": lat_s,
        "first_block_s": fb,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve.json" if args.mode == "dense" else f"serve-{args.mode}.json"
    (args.out / name).write_text(json.dumps(summary, indent=2) + "\n")
    _write_readme(args.out)
    print(json.dumps(summary, indent=2))
    return 0


def _row(s: dict[str, Any]) -> str:
    c, lat, fb = s["config"], s["latency_s"], s["first_block_s"]
    mode = c.get("mode", "dense")
    load = s.get("load_avg_1min_at_start")
    return (
        f"| {mode} | {s.get('kv_budget', 1.0)} | {s.get('dtype', 'float32')} | {s['date']} | "
        f"{'?' if load is None else f'{load:.1f}'} | "
        f"{s['completed']} | {s['wall_s']:.2f} | {s['tokens_per_s']:.1f} | "
        f"{s['requests_per_s']:.2f} | {lat['p50']:.3f} / {lat['p90']:.3f} / {lat['p99']:.3f} | "
        f"{fb['p50']:.3f} / {fb['p90']:.3f} / {fb['p99']:.3f} |"
    )


def _write_readme(out: Path) -> None:
    """README of every ``serve*.json`` in ``out`` (dense first), one table row each."""
    files = sorted(out.glob("serve*.json"), key=lambda f: (f.name != "serve.json", f.name))
    runs = [json.loads(f.read_text()) for f in files]
    if not runs:
        return
    c = runs[0]["config"]
    rows = "\n".join(_row(s) for s in runs)
    (out / "README.md").write_text(
        "# herald serve load test\n\n"
        f"Command: `python -m herald.bench.serve_load --out {out} [--mode MODE]` "
        f"({c['requests']} streaming requests, concurrency {c['concurrency']}, max batch "
        f"{c['max_batch_size']}, max_tokens {c['max_tokens']}, steps {c['steps']}, model "
        f"{c['model']} on {c['device']}; loopback). Each row is one run, one JSON file here.\n"
        f"Machine: {runs[0]['machine']}.\n\n"
        "| mode | kv budget | dtype | date | load avg | completed | wall s | tokens/s | req/s | "
        "latency p50 / p90 / p99 s | first block p50 / p90 / p99 s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"{rows}\n\n"
        "The embedded model has random weights and is tiny: the numbers measure the serving path "
        "(HTTP, SSE, engine thread, continuous batching; in the offloading modes also the CPU "
        "pool hand-offs, the selection on the retrieval thread and the lockstep blocks), not a "
        "real model's speed. Offloading modes run bf16, dense fp32: on this CPU they are not a "
        "like-for-like speed comparison. The machine is shared: 'load avg' is its 1-minute load "
        "average when the run started (above the 2 cores, other work took CPU time from it).\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
