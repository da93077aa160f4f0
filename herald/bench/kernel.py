"""Selection-kernel benchmark (the fused CPU kernel of HERALD §IV-B4): throughput vs queries.

Run on the GPU machine's CPU::

    python -m herald.bench.kernel --out results/kernel          # ~2-5 minutes on 16 cores
    python -m herald.bench.kernel --smoke --out /tmp/kernel      # tiny sizes, seconds
    python -m herald.bench.kernel --report results/kernel        # README + plot from kernel.json

In one run: DRAM read bandwidth (torch sum over a 4 GiB bf16 array and the library's own read
probe; all threads and one thread), a correctness check of every path
(:mod:`herald.bench.kernel_paths`: AVX-512 fp32-FMA, AVX-512 vdpbf16ps, portable, PyTorch
fallback, naive PyTorch) against the float64 reference, then
selection time for n_q in 1..32 at 16K/32K prefix, LLaDA2.0-mini (4 KV heads) and SDAR-8B (8 KV
heads) shapes (G = 4, D = 128, page 32), both output modes, 5% budget, one layer of a batch whose
K is >= 1 GiB, beside the naive PyTorch path (gather, bf16 matmul, softmax, topk) on the same
threads; plus a prefetch sweep, the ISA variants, one-thread rate and the gather. Writes
kernel.json (raw numbers, command, machine), README.md (tables, targets met/missed) and
kernel.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from herald.bench.kernel_paths import check_paths, naive_select
from herald.bench.kernel_report import (
    BUDGET,
    PAGE,
    SHAPES,
    TARGET_BW_FRAC,
    TARGET_SPEEDUP,
    log,
    write_report,
)
from herald.env import overridden, settings, usable_cpus
from herald.offload.selection import _kernel
from herald.offload.selection.cpu import gather_selected, kernel_info, select_topk


def _all_threads() -> int:
    """The kernel benchmark's threads: ``HERALD_SELECTION_THREADS``, else every usable CPU."""
    return settings().selection_threads or usable_cpus()


def timed(fn: Callable[[], object], min_reps: int, max_reps: int, budget_s: float) -> list[float]:
    """One warm-up call, then at least min_reps timed calls (more while under budget_s)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (
        len(times) < min_reps or time.perf_counter() - start < budget_s
    ):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": sys.version.split()[0]}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in cpuinfo.splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        flags = next(
            (ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")),
            [],
        )
        info["cpu_flags"] = sorted({f for f in flags if f.startswith(("avx", "amx", "fma"))})
        mem = next(
            ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")
        )
        info["mem_total_gib"] = round(int(mem.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    info["cpu_count"] = os.cpu_count()
    info["threads_used"] = _all_threads()
    info["torch"] = torch.__version__
    info["kernel"] = kernel_info()
    return info


def dram_bandwidth(gib: float, threads: int) -> dict[str, float]:
    """GB/s reading a gib-sized bf16 array: torch sum and the native probe, all threads and 1."""
    x = torch.empty(int(gib * 2**30) // 4 * 2, dtype=torch.bfloat16)  # even: viewed as float32
    x.fill_(1.0)
    xf = x.view(torch.float32)  # same bytes; float32 sum is torch's fastest full read
    nbytes = x.numel() * 2
    out: dict[str, float] = {}
    lib = _kernel.load_native()
    for n in (threads, 1):
        torch.set_num_threads(n)
        reps = 6 if n > 1 else 3
        t = min(timed(lambda: xf.sum(), reps, reps, 0))
        out[f"torch_sum_{'all' if n > 1 else '1'}_gbs"] = nbytes / t / 1e9
        if lib is not None:
            probe = lib.lib.herald_read_probe
            t = min(timed(partial(probe, x.data_ptr(), nbytes, n), reps, reps, 0))
            out[f"native_probe_{'all' if n > 1 else '1'}_gbs"] = nbytes / t / 1e9
    torch.set_num_threads(threads)
    out["reference_gbs"] = max(v for k, v in out.items() if "_all_" in k)
    out["reference_1_gbs"] = max(v for k, v in out.items() if k.endswith("_1_gbs"))
    return out


class Workload:
    """One layer of a batch: K/V pools of >= k_bytes each, random pages per request."""

    def __init__(self, k_bytes: int) -> None:
        self.k_bytes = k_bytes
        self.k_flat = torch.empty(k_bytes // 2, dtype=torch.bfloat16).normal_()
        self.v_flat = torch.empty(k_bytes // 2, dtype=torch.bfloat16).normal_()

    def make(self, shape: str, s: int, n_q: int, seed: int = 0) -> dict[str, Any]:
        hkv, grp, d = SHAPES[shape]
        slab = hkv * PAGE * d
        num_pages = self.k_flat.numel() // slab
        npg = (s + PAGE - 1) // PAGE
        n_req = max(1, num_pages // npg)
        g = torch.Generator().manual_seed(seed)
        k = self.k_flat[: num_pages * slab].view(num_pages, hkv, PAGE, d)
        v = self.v_flat[: num_pages * slab].view(num_pages, hkv, PAGE, d)
        pt = torch.randperm(num_pages, generator=g)[: n_req * npg].view(n_req, npg).int()
        q = torch.randn(n_req, n_q, hkv * grp, d, generator=g).bfloat16()
        sl = torch.full((n_req,), s, dtype=torch.int32)
        bt = torch.full((n_req,), math.ceil(BUDGET * s), dtype=torch.int32)  # HERALD §IV-B4
        k_bytes = n_req * hkv * s * d * 2
        return {
            "args": (q, k, v, pt, sl, bt),
            "n_req": n_req,
            "items": n_req * hkv,
            "k_bytes": k_bytes,
        }


def sweep(cfg: argparse.Namespace, wl: Workload, dram: float, threads: int) -> list[dict[str, Any]]:
    runs = []
    for shape in SHAPES:
        for s in cfg.seq_lens:
            for mode in ("selected", "full"):
                for n_q in cfg.n_q:
                    w = wl.make(shape, s, n_q)
                    a = w["args"]
                    nbytes = w["k_bytes"] * (2 if mode == "full" else 1)
                    paths: dict[str, Callable[[], object]] = {
                        "fused": partial(select_topk, *a, output_mode=mode, num_threads=threads),
                        "naive": partial(naive_select, a[0], a[1], a[2], a[3], a[4], a[5], mode),
                    }
                    for path, fn in paths.items():
                        if path == "naive" and cfg.skip_naive:
                            continue
                        times = timed(fn, cfg.reps, 10, cfg.budget_s)
                        best = min(times)
                        row = {
                            "shape": shape, "S": s, "mode": mode, "n_q": n_q, "path": path,
                            "n_req": w["n_req"], "items": w["items"], "bytes": nbytes,
                            "times_s": times, "best_s": best, "gbs": nbytes / best / 1e9,
                            "frac_dram": nbytes / best / 1e9 / dram,
                            "mtok_per_s": w["items"] * s / best / 1e6,
                        }  # fmt: skip
                        runs.append(row)
                        log(
                            f"{shape:11s} S={s:5d} {mode:8s} n_q={n_q:2d} {path:5s} "
                            f"{best * 1e3:9.2f} ms {row['gbs']:6.1f} GB/s "
                            f"({100 * row['frac_dram']:5.1f}% DRAM) items={w['items']}"
                        )
    return runs


def extras(
    cfg: argparse.Namespace, wl: Workload, dram: dict[str, float], threads: int
) -> dict[str, Any]:
    """Prefetch sweep, ISA variants, one-thread rate and the gather, on LLaDA2.0-mini shapes."""
    out: dict[str, Any] = {}
    s = max(cfg.seq_lens)
    w1 = wl.make("llada2-mini", s, 1)
    a1 = w1["args"]

    def rate(fn: Callable[[], object], nbytes: int, reps: int = 3) -> dict[str, float]:
        best = min(timed(fn, reps, 6, cfg.budget_s))
        return {
            "best_s": best,
            "gbs": nbytes / best / 1e9,
            "frac_dram": nbytes / best / 1e9 / dram["reference_gbs"],
        }

    def sel(a: tuple[Any, ...] = a1, mode: str = "selected", n: int = threads) -> Callable[[], Any]:
        return lambda: select_topk(*a, output_mode=mode, num_threads=n)

    out["prefetch"] = {}
    for spec in ("none", "t0:1", "t0:2", "t0:4", "t1:1", "t1:4", "nta:1"):
        with overridden({"HERALD_SELECTION_PREFETCH": spec}):
            r = rate(sel(), w1["k_bytes"])
        out["prefetch"][spec] = r
        log(
            f"prefetch {spec:6s} n_q=1 selected: {r['gbs']:6.1f} GB/s ({100 * r['frac_dram']:.1f}%)"
        )
    lib = _kernel.load_native()
    isas = ["avx512", "avx512bf16", "portable"] if lib and lib.has_avx512bf16 else ["portable"]
    out["isa"] = []
    for n_q in sorted({1, max(cfg.n_q)}):
        w = wl.make("llada2-mini", s, n_q)
        for mode in ("selected", "full"):
            for isa in isas:
                if isa == "portable" and n_q > 1:
                    continue  # slow and not a production path
                nbytes = w["k_bytes"] * (2 if mode == "full" else 1)
                with overridden({"HERALD_SELECTION_ISA": isa}):
                    r = rate(sel(w["args"], mode), nbytes, 2)
                out["isa"].append({"isa": isa, "n_q": n_q, "mode": mode, **r})
                log(
                    f"isa {isa:10s} n_q={n_q:2d} {mode:8s}: {r['best_s'] * 1e3:8.2f} ms "
                    f"{r['gbs']:6.1f} GB/s"
                )
    r = rate(sel(a1, "selected", 1), w1["k_bytes"])
    r["frac_dram_1thread"] = r["gbs"] / dram["reference_1_gbs"]
    out["one_thread"] = r
    log(
        f"one thread n_q=1 selected: {r['gbs']:.2f} GB/s "
        f"({100 * r['frac_dram_1thread']:.0f}% of 1-thread DRAM)"
    )
    res = select_topk(*a1, output_mode="selected", num_threads=threads)
    n_req, hkv, k_max = res.indices.shape
    staging = torch.empty(2, n_req, hkv, k_max, SHAPES["llada2-mini"][2], dtype=torch.bfloat16)
    staging.fill_(0)
    moved = 2 * int(res.num_selected.sum()) * hkv * SHAPES["llada2-mini"][2] * 2
    g = rate(
        lambda: gather_selected(a1[1], a1[2], a1[3], res.indices, res.num_selected, staging), moved
    )
    out["gather"] = {"bytes": moved, **g}
    log(
        f"gather {moved / 2**20:.0f} MiB of selected K+V rows: {g['best_s'] * 1e3:.2f} ms, "
        f"{g['gbs']:.1f} GB/s"
    )
    return out


def summarize(runs: list[dict[str, Any]], dram: dict[str, float]) -> dict[str, Any]:
    """The kernel's three targets, each with its numbers: n_q = 1 streams at least
    :data:`~herald.bench.kernel_report.TARGET_BW_FRAC` of DRAM read bandwidth, the largest n_q
    -> 1 speeds it up at least :data:`~herald.bench.kernel_report.TARGET_SPEEDUP` times, and the
    fused kernel beats naive PyTorch at every point."""
    by = {(r["shape"], r["S"], r["mode"], r["n_q"], r["path"]): r for r in runs}
    fused = [r for r in runs if r["path"] == "fused"]
    nq = sorted({r["n_q"] for r in fused})
    lo, hi = nq[0], nq[-1]
    bw = [
        {
            "shape": r["shape"],
            "S": r["S"],
            "mode": r["mode"],
            "frac_dram": r["frac_dram"],
            "gbs": r["gbs"],
        }
        for r in fused
        if r["n_q"] == lo
    ]
    speed = []
    for r in fused:
        if r["n_q"] == lo and (r["shape"], r["S"], r["mode"], hi, "fused") in by:
            big = by[(r["shape"], r["S"], r["mode"], hi, "fused")]
            hkv, grp, d = SHAPES[r["shape"]]
            flops = 2 * r["items"] * r["S"] * hi * grp * d * (2 if r["mode"] == "full" else 1)
            speed.append(
                {
                    "shape": r["shape"],
                    "S": r["S"],
                    "mode": r["mode"],
                    "speedup": big["best_s"] / r["best_s"],
                    "gflops_at_max_nq": flops / big["best_s"] / 1e9,
                }
            )
    vs = [
        {"shape": r["shape"], "S": r["S"], "mode": r["mode"], "n_q": r["n_q"],
         "speedup": by[k]["best_s"] / r["best_s"]}
        for r in fused
        if (k := (r["shape"], r["S"], r["mode"], r["n_q"], "naive")) in by
    ]  # fmt: skip
    bw_min = min((b["frac_dram"] for b in bw), default=0.0)
    sp_min = min((x["speedup"] for x in speed), default=0.0)
    vs_min = min((x["speedup"] for x in vs), default=0.0)
    return {
        "dram_reference_gbs": dram["reference_gbs"],
        "bandwidth": {"min_frac": bw_min, "runs": bw, "met": bool(bw) and bw_min >= TARGET_BW_FRAC},
        "query_speedup": {
            "from": hi,
            "to": lo,
            "min": sp_min,
            "runs": speed,
            "met": bool(speed) and sp_min >= TARGET_SPEEDUP,
        },
        "vs_naive": {"min": vs_min, "runs": vs, "met": bool(vs) and vs_min > 1.0},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/kernel"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    p.add_argument(
        "--report", type=Path, help="only rewrite README.md / kernel.png from DIR/kernel.json"
    )
    p.add_argument("--k-gib", type=float, default=1.0, help="K bytes per timed call (GiB)")
    p.add_argument("--dram-gib", type=float, default=4.0)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--n-q", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--reps", type=int, default=3, help="minimum timed repetitions per point")
    p.add_argument("--budget-s", type=float, default=1.0, help="extra repetitions while under this")
    p.add_argument("--skip-naive", action="store_true")
    cfg = p.parse_args(argv)
    if cfg.report is not None:
        write_report(json.loads((cfg.report / "kernel.json").read_text()), cfg.report)
        return
    if cfg.smoke:
        cfg.k_gib, cfg.dram_gib, cfg.seq_lens, cfg.n_q, cfg.reps, cfg.budget_s = (
            1 / 256,
            1 / 32,
            [256, 512],
            [1, 4],
            1,
            0.0,
        )
    t_start = time.perf_counter()
    cfg.out.mkdir(parents=True, exist_ok=True)
    threads = _all_threads()
    torch.set_num_threads(threads)
    args = sys.argv[1:] if argv is None else argv
    res: dict[str, Any] = {
        "command": " ".join(["python -m herald.bench.kernel", *args]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": cfg.smoke, "machine": machine_info(),
        "config": {"k_gib": cfg.k_gib, "page_size": PAGE, "budget": BUDGET, "threads": threads,
                   "seq_lens": cfg.seq_lens, "n_q": cfg.n_q, "reps": cfg.reps},
    }  # fmt: skip
    log(
        f"machine: {res['machine'].get('cpu_model')}, {threads} threads, "
        f"kernel {res['machine']['kernel']}"
    )
    res["dram"] = dram_bandwidth(cfg.dram_gib, threads)
    log("DRAM read GB/s: " + ", ".join(f"{k}={v:.1f}" for k, v in res["dram"].items()))
    res["checks"] = check_paths(threads)
    failed = [c for c in res["checks"] if c["ok"] is False]
    if failed:
        log(f"WARNING: correctness check failed for {failed}; their timings are not trustworthy")
    log(f"allocating K and V pools of {cfg.k_gib:.2f} GiB each")
    wl = Workload(int(cfg.k_gib * 2**30))
    res["runs"] = sweep(cfg, wl, res["dram"]["reference_gbs"], threads)
    res["extras"] = extras(cfg, wl, res["dram"], threads)
    res["summary"] = summarize(res["runs"], res["dram"])
    res["elapsed_s"] = time.perf_counter() - t_start
    (cfg.out / "kernel.json").write_text(json.dumps(res, indent=1))
    write_report(res, cfg.out)
    s = res["summary"]
    print("\nshape        S      mode      n_q  fused ms  GB/s  %DRAM  naive ms")
    naive = {
        (r["shape"], r["S"], r["mode"], r["n_q"]): r for r in res["runs"] if r["path"] == "naive"
    }
    for r in res["runs"]:
        if r["path"] == "fused":
            nv = naive.get((r["shape"], r["S"], r["mode"], r["n_q"]))
            print(
                f"{r['shape']:12s} {r['S']:6d} {r['mode']:8s} {r['n_q']:4d} "
                f"{r['best_s'] * 1e3:9.2f} {r['gbs']:5.1f} {100 * r['frac_dram']:5.1f}  "
                f"{nv['best_s'] * 1e3 if nv else float('nan'):8.1f}"
            )
    word = {True: "met", False: "MISSED"}
    bwt, qs, vn = s["bandwidth"], s["query_speedup"], s["vs_naive"]
    print(
        f"\nDRAM {s['dram_reference_gbs']:.1f} GB/s | n_q={qs['to']} worst "
        f"{100 * bwt['min_frac']:.1f}% of DRAM ({word[bwt['met']]}) | {qs['from']}->{qs['to']} "
        f"worst {qs['min']:.1f}x ({word[qs['met']]}) | vs naive worst {vn['min']:.2f}x "
        f"({word[vn['met']]}) | {res['elapsed_s']:.0f} s -> {cfg.out}"
    )


if __name__ == "__main__":
    main()
