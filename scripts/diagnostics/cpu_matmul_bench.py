"""bf16 matmuls on the CPU: native bf16 against herald's float32 path (:mod:`herald.layers.linear`).

Two parts, each best-of-N wall time on a fixed number of torch threads:

1. ``F.linear`` for code-sdar's projection shapes, bf16 and fp16 in the input dtype against both
   operands upcast to float32 and the product rounded back, with the share of equal elements;
2. the embedded code-sdar model (bf16) through the engine: the first 600 tokens of
   ``textwrap.py``, 64 new tokens at 3 denoising steps per block, EOS ignored, run twice (the
   second is timed): the prefill step and the mean decode step, for ``HERALD_CPU_MATMUL=native``
   and ``fp32``, dense and ``--mode herald``, each in a fresh process.

    python scripts/diagnostics/cpu_matmul_bench.py --out results/cpu_matmul

Writes ``cpu_matmul.json`` (machine, command, raw numbers) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = ((32, 384, 1152), (32, 384, 1536), (32, 1536, 384), (256, 384, 1152), (32, 384, 8192))
"""(rows, in, out): a decode block's qkv, gate/up and down projections, a prefill chunk's qkv,
the LM head, of code-sdar (hidden 384, 8 query / 2 KV heads of 64, MLP 1536, vocab 8192)."""


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def matmuls(reps: int) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for m, k, n in SHAPES:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            native = _best_ms(lambda x=x, w=w: F.linear(x, w), reps)
            up = _best_ms(lambda x=x, w=w, d=dtype: F.linear(x.float(), w.float()).to(d), reps)
            same = F.linear(x, w) == F.linear(x.float(), w.float()).to(dtype)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "shape": [m, k, n],
                         "native_ms": native, "fp32_ms": up,
                         "equal_fraction": same.float().mean().item()})  # fmt: skip
    return rows


def engine_steps(mode: str) -> dict:
    """Run in a child process: per-step seconds of one request (the second of two runs)."""
    import textwrap

    from herald.config import SamplingParams
    from herald.engines import build_engine, offload_for_mode
    from herald.models.loader import load_model
    from herald.server.defaults import SERVE_DEFAULTS

    model, config, tok = load_model("code-sdar", "cpu", torch.bfloat16)
    with open(textwrap.__file__, encoding="utf-8") as f:
        ids = tok.encode(f.read())[:600]
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=3, ignore_eos=True)
    cfg = SERVE_DEFAULTS.replace(max_batch_size=1, max_seq_len=1024,
                                 offload=offload_for_mode(mode))  # fmt: skip
    eng = build_engine(model, config, cfg)
    try:
        for _ in range(2):
            req = eng.add_request(ids, params)
            times = []
            while eng.has_unfinished():
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
    finally:
        eng.close()
    return {"prefill_ms": times[0] * 1e3, "decode_ms": statistics.mean(times[1:]) * 1e3,
            "steps": len(times), "first_tokens": req.output_ids[:8]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--child", nargs=2, metavar=("MODE", "THREADS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        torch.set_num_threads(int(a.child[1]))
        print(json.dumps(engine_steps(a.child[0])))
        return
    record: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "matmuls": {}, "engine": [],
    }  # fmt: skip
    for threads in a.threads:
        torch.set_num_threads(threads)
        record["matmuls"][threads] = matmuls(a.reps)
        for r in record["matmuls"][threads]:
            print(f"threads {threads} {r['dtype']} {r['shape']}: native {r['native_ms']:.2f} ms, "
                  f"fp32 {r['fp32_ms']:.2f} ms, equal {r['equal_fraction']:.5f}")  # fmt: skip
    for threads in a.threads:
        for mode in ("dense", "herald"):
            for matmul in ("native", "fp32"):
                env = {**os.environ, "HERALD_CPU_MATMUL": matmul}
                cmd = [sys.executable, __file__, "--out", str(a.out), "--child", mode, str(threads)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                row = {"threads": threads, "mode": mode, "matmul": matmul,
                       **json.loads(out.stdout.strip().splitlines()[-1])}  # fmt: skip
                record["engine"].append(row)
                print(f"threads {threads} {mode} {matmul}: prefill {row['prefill_ms']:.0f} ms, "
                      f"decode step {row['decode_ms']:.1f} ms")  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "cpu_matmul.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
