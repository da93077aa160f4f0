"""Bounded load test of ``herald serve`` over loopback: throughput and latency percentiles.

Starts the real server (uvicorn, 127.0.0.1, a free port) in this process, sends a fixed number of
streaming completions with a fixed concurrency and a hard deadline, and writes ``serve.json`` and
a README to ``--out``::

    python -m herald.bench.serve_load --out results/serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn

from herald.server.launch import build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    app = build_app(
        args.model,
        device=args.device,
        dtype=dtype,
        max_batch_size=args.max_batch_size,
        max_seq_len=1024,
        max_waiting=max(64, args.requests),
    )
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t_start = time.monotonic()
    while not server.started:
        if time.monotonic() - t_start > 60 or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        results, wall = asyncio.run(_load(f"http://127.0.0.1:{port}", args))
    finally:
        server.should_exit = True
        thread.join(timeout=15)
    lat = [r["latency"] for r in results]
    ttfb = [r["ttfb"] for r in results]
    tokens = sum(int(r["tokens"]) for r in results)
    lat_s = {f"p{q}": _pct(lat, q) for q in (50, 90, 99)} | {"mean": statistics.mean(lat)}
    fb = {f"p{q}": _pct(ttfb, q) for q in (50, 90, 99)}
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "completed": len(results),
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "latency_s": lat_s,
        "first_block_s": fb,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "README.md").write_text(
        f"# herald serve load test ({summary['date']})\n\n"
        f"Command: `python -m herald.bench.serve_load --out {args.out}` "
        f"({args.requests} streaming requests, concurrency {args.concurrency}, max_tokens "
        f"{args.max_tokens}, steps {args.steps}, model {args.model} on {args.device}; loopback).\n"
        f"Machine: {summary['machine']}.\n\n"
        f"| completed | wall s | tokens/s | req/s | latency p50 / p90 / p99 s | first block p50 / "
        f"p90 / p99 s |\n| --- | --- | --- | --- | --- | --- |\n"
        f"| {len(results)} | {wall:.2f} | {summary['tokens_per_s']:.1f} | "
        f"{summary['requests_per_s']:.2f} | {lat_s['p50']:.3f} / {lat_s['p90']:.3f} / "
        f"{lat_s['p99']:.3f} | {fb['p50']:.3f} / {fb['p90']:.3f} / {fb['p99']:.3f} |\n\n"
        "The embedded model has random weights and is tiny: the numbers measure the serving path "
        "(HTTP, SSE, engine thread, continuous batching), not a real model's speed.\n"
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
