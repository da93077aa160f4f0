"""Selection-kernel benchmark (DESIGN §6 "Kernel", issue 3): throughput vs number of queries.

Run on the GPU machine's CPU::

    python -m herald.bench.kernel --out results/kernel          # ~2-5 minutes on 16 cores
    python -m herald.bench.kernel --smoke --out /tmp/kernel      # tiny sizes, seconds
    python -m herald.bench.kernel --report results/kernel        # README + plot from kernel.json

In one run: DRAM read bandwidth (torch sum over a 4 GiB bf16 array and the library's own read
probe; all threads and one thread), a correctness check of every path (AVX-512 fp32-FMA,
AVX-512 vdpbf16ps, portable, PyTorch fallback, naive PyTorch) against the float64 reference, then
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

from herald.bench.kernel_report import (
    BUDGET,
    PAGE,
    SHAPES,
    TARGET_BW_FRAC,
    TARGET_SPEEDUP,
    log,
    write_report,
)
from herald.kv import _kernel
from herald.kv.selection import default_num_threads, gather_selected, kernel_info, select_topk
from herald.kv.selection_ref import select_topk_torch


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
    info["threads_used"] = default_num_threads()
    info["torch"] = torch.__version__
    info["kernel"] = kernel_info()
    return info


def dram_bandwidth(gib: float, threads: int) -> dict[str, float]:
    """GB/s reading a gib-sized bf16 array: torch sum and the native probe, all threads and 1."""
    x = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16)
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


def naive_select(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget: torch.Tensor,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What one would write in PyTorch: gather pages, bf16 matmul, softmax, sum, topk."""
    n_req, n_q, h, d = q.shape
    hkv, p = k_pages.shape[1], k_pages.shape[2]
    g = h // hkv
    out = torch.empty(n_req, n_q, h, d)
    k_max = int(torch.minimum(seq_lens, budget).max())
    idx = torch.full((n_req, hkv, k_max), -1, dtype=torch.int64)
    for r, (s, b) in enumerate(zip(seq_lens.tolist(), budget.tolist(), strict=True)):
        ids = page_table[r, : (s + p - 1) // p].long()
        keys = k_pages[ids].transpose(0, 1).reshape(hkv, -1, d)[:, :s]
        qr = q[r].view(n_q, hkv, g, d).transpose(0, 1).reshape(hkv, n_q * g, d)
        scores = torch.matmul(qr, keys.transpose(1, 2)).float() * d**-0.5
        probs = torch.softmax(scores, dim=-1)
        sel = torch.topk(probs.sum(1), min(b, s), dim=-1).indices.sort(-1).values
        idx[r, :, : sel.shape[1]] = sel
        if mode == "full":
            vals = v_pages[ids].transpose(0, 1).reshape(hkv, -1, d)[:, :s]
            o = torch.matmul(probs.bfloat16(), vals).float()
        else:
            pg = ids[sel // p]
            vals = v_pages[pg, torch.arange(hkv)[:, None], sel % p]
            w = torch.softmax(scores.gather(2, sel[:, None, :].expand(-1, n_q * g, -1)), dim=-1)
            o = torch.matmul(w.bfloat16(), vals).float()
        out[r] = o.view(hkv, n_q, g, d).transpose(0, 1).reshape(n_q, h, d)
    return idx, out


def sparse_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pt: torch.Tensor,
    idx: torch.Tensor,
    budget: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """float64 softmax attention over the rows idx selects (what ``selected`` mode returns)."""
    n_req, n_q, h, d = q.shape
    hkv, p = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.empty(n_req, n_q, h, d, dtype=torch.float64)
    for r in range(n_req):
        ns = min(int(budget[r]), int(seq_lens[r]))
        for kh in range(hkv):
            pos = idx[r, kh, :ns].long()
            pg = pt[r].long()[pos // p]
            keys, vals = k[pg, kh, pos % p].double(), v[pg, kh, pos % p].double()
            qs = q[r, :, kh * g : (kh + 1) * g].double()
            out[r, :, kh * g : (kh + 1) * g] = torch.softmax(qs @ keys.T * d**-0.5, -1) @ vals
    return out


def check_paths(threads: int) -> list[dict[str, Any]]:
    """Every path against the float64 reference on a small input, before any timing."""
    g = torch.Generator().manual_seed(0)
    hkv, grp, d = SHAPES["llada2-mini"]
    lens, budgets, n_q = [700, 333, 64], [35, 17, 64], 4
    pages = [(s + PAGE - 1) // PAGE for s in lens]
    k = torch.randn(sum(pages) + 2, hkv, PAGE, d, generator=g).bfloat16()
    v = torch.randn(k.shape, generator=g).bfloat16()
    q = (torch.randn(len(lens), n_q, hkv * grp, d, generator=g) * 2).bfloat16()
    perm = torch.randperm(k.shape[0], generator=g).int()
    pt = torch.full((len(lens), max(pages)), -1, dtype=torch.int32)
    off = 0
    for r, n in enumerate(pages):
        pt[r, :n], off = perm[off : off + n], off + n
    sl, bt = torch.tensor(lens, dtype=torch.int32), torch.tensor(budgets, dtype=torch.int32)
    results = []
    lib = _kernel.load_native()
    paths = ["avx512", "avx512bf16", "portable", "torch", "naive"]
    for mode in ("full", "selected"):
        ref = select_topk_torch(q, k, v, pt, sl, bt, output_mode=mode, return_importance=True)
        assert ref.importance is not None
        for path in paths:
            row: dict[str, Any] = {"path": path, "mode": mode}
            if (
                path.startswith("avx512")
                and not (lib and lib.has_avx512bf16)
                or (path in ("avx512", "avx512bf16", "portable") and lib is None)
            ):
                results.append({**row, "ok": None, "note": "unavailable on this machine"})
                continue
            if path == "naive":
                idx, out = naive_select(q, k, v, pt, sl, bt, mode)
            else:
                env = {"HERALD_SELECTION_BACKEND": "torch" if path == "torch" else "native"}
                if path != "torch":
                    env["HERALD_SELECTION_ISA"] = path
                old = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                try:
                    res = select_topk(q, k, v, pt, sl, bt, output_mode=mode, num_threads=threads)
                finally:
                    for key, val in old.items():
                        os.environ.pop(key) if val is None else os.environ.__setitem__(key, val)
                idx, out = res.indices.long(), res.attn_output
            ratio = 1.0
            for r, s in enumerate(lens):
                ns = min(budgets[r], s)
                for h in range(hkv):
                    imp = ref.importance[r, h, :s].double()
                    got = float(imp[idx[r, h, :ns]].sum())
                    ratio = min(ratio, got / float(imp[ref.indices[r, h, :ns].long()].sum()))
            want = (
                ref.attn_output.double() if mode == "full" else sparse_ref(q, k, v, pt, idx, bt, sl)
            )
            rel = float((out.double() - want).norm() / want.norm())
            # naive: bf16 scores and probabilities, so looser
            ok = ratio > 1 - (1e-3 if path == "naive" else 1e-4) and rel < (
                2e-2 if path == "naive" else 1e-2
            )
            results.append({**row, "ok": ok, "rel_err": rel, "mass_ratio": ratio})
            log(f"check {path:10s} {mode:8s} ok={ok} rel_err={rel:.2e} mass_ratio={ratio:.6f}")
    return results


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
        bt = torch.full((n_req,), math.ceil(BUDGET * s), dtype=torch.int32)  # DESIGN §3
        k_bytes = n_req * hkv * s * d * 2
        return {
            "args": (q, k, v, pt, sl, bt),
            "n_req": n_req,
            "items": n_req * hkv,
            "k_bytes": k_bytes,
        }


def with_env(env: dict[str, str], fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        old = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for key, val in old.items():
                if val is None:
                    os.environ.pop(key)
                else:
                    os.environ[key] = val

    return run


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
        r = rate(with_env({"HERALD_SELECTION_PREFETCH": spec}, sel()), w1["k_bytes"])
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
                r = rate(with_env({"HERALD_SELECTION_ISA": isa}, sel(w["args"], mode)), nbytes, 2)
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
    """The three targets of issue 3, each with its numbers."""
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
    threads = default_num_threads()
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
