"""The compact first pass of the CPU selection against the exact kernel: candidate-set sizes,
certified items, bytes read per request-block, kernel times; on synthetic KV and on the trained
checkpoint's real KV.

    python -m herald.bench.compact synthetic --out results/compact/synthetic.json
    python -m herald.bench.compact capture --context 16384 --out /tmp/real_16384.pt
    python -m herald.bench.compact real /tmp/real_16384.pt --out results/compact/real_16384.json
    python -m herald.bench.compact exp --out results/compact/exp.json     # ~25 s per ISA
    python -m herald.bench.compact device /tmp/real_16384.pt --out results/compact/device_16384.json

``synthetic``: N(0, 1) keys and queries scaled by ``--q-scales`` (LLaDA2.0-mini-like shapes: 4 KV
heads, 4 query heads each, head_dim 128, pages of 32, one representative query, a 32-token tail,
budget 5%), for each context and request count: the exact kernel (selected mode), the compact
pass alone, and the compact call (with its exact fallback), medians of ``--repeat`` runs.
``capture``: the embedded checkpoint (``code-sdar``) prefills a standard-library file (the first
``--context`` tokens of typing.py then inspect.py), then one denoising step of the first
[MASK] block; its post-RoPE keys and that step's queries of every layer are saved (not committed:
tens of MB; the command re-creates them bit for bit on the same machine type). ``real``: per
offloaded layer and KV head, at the budget, the candidate fraction and the certificate, for the
representative query (the block's centre [MASK] query) and for all B queries of the block; also
what a non-exact variant trusting the normalisers' midpoints would have picked (its overlap with
the exact top-k and the importance mass it keeps). ``exp``: the pass's exp bound over every
float32 argument in [-104, 0], per ISA this CPU runs. ``device``: on a captured record, what
``first_pass="int8-gpu"`` selects (:func:`herald.offload.selection.compact_device.select_int8`,
the representative query, no tail) against the exact top-k: their overlap, the importance mass
it keeps, and how much of the exact top-k its own top 1.5 x k / 2 x k hold (the keys
``exact_in_top_1.5k``, ``..._2k``; what an exact re-rank of
that many candidates would need).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from herald.bench.common import code_version, command_line, machine_info, write_json
from herald.env import selection_threads
from herald.kv.compact_keys import quantize_keys
from herald.offload.selection import compact
from herald.offload.selection.compact_cpu import (
    best_isa,
    compact_pass,
    exp_bound_error,
    select_topk_compact,
)
from herald.offload.selection.cpu import kernel_info, select_topk
from herald.offload.selection.topk import group_queries

HOST_LAYERS = 18  # offloaded layers of the host's model shapes (bytes per request-block)


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm: thread pool, arenas, page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged(keys: torch.Tensor, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n_req, Hkv, S, D]`` -> pages ``[n_req * S / page, Hkv, page, D]`` in a shuffled order
    and the page table ``[n_req, S / page]`` int32 (S a multiple of ``page``)."""
    n, hkv, s, d = keys.shape
    per = s // page
    pages = keys.contiguous().view(n, hkv, per, page, d).permute(0, 2, 1, 3, 4)
    pages = pages.reshape(n * per, hkv, page, d)
    perm = torch.randperm(n * per, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(pages.shape, dtype=pages.dtype)
    out[perm] = pages
    return out, perm.view(n, per).int()


def bytes_read(
    seq: list[int], tails: list[int], ks: list[int], ncand: torch.Tensor, d: int
) -> dict[str, float]:
    """Bytes one layer call reads: exact (K of every position, V of the selected and tail rows)
    and compact (int8 K + scales of every position, bf16 K of candidates and tail, V of the
    selected and tail rows), summed over requests and KV heads (``ncand [n_req, Hkv]``)."""
    hkv = ncand.shape[1]
    exact = comp = 0.0
    for r, (s, t, k) in enumerate(zip(seq, tails, ks, strict=True)):
        v = (k + t) * 2 * d
        exact += hkv * (s * 2 * d + v)
        comp += sum(s * (d + 4) + (int(c) + t) * 2 * d + v for c in ncand[r].tolist())
    return {"exact": exact, "compact": comp}


def synthetic_case(cfg: argparse.Namespace, ctx: int, n_req: int, group: int, qs: float) -> dict:
    """One measured point (module docstring)."""
    g = torch.Generator().manual_seed(ctx + n_req + group)
    hkv, d, b = cfg.kv_heads, cfg.head_dim, cfg.page_size
    keys = torch.randn(n_req, hkv, ctx, d, generator=g).bfloat16()
    kp, pt = paged(keys, b, ctx)
    vp = torch.randn(kp.shape, generator=g).bfloat16()
    q = (torch.randn(n_req, 1, hkv * group, d, generator=g) * qs).bfloat16()
    seq = torch.full((n_req,), ctx, dtype=torch.int32)
    tails = torch.full((n_req,), cfg.tail, dtype=torch.int32)
    budget = torch.full((n_req,), math.ceil(cfg.budget * (ctx - cfg.tail)), dtype=torch.int32)
    k8, sc = quantize_keys(kp)
    args = (q, kp, vp, pt, seq, budget)
    kw: dict[str, Any] = dict(tail_lens=tails, num_threads=cfg.threads)
    exact = select_topk(*args, output_mode="selected", **kw)
    _, st = compact_pass(*args, k8_pages=k8, scale_pages=sc, **kw)
    res = select_topk_compact(*args, k8_pages=k8, scale_pages=sc, **kw)
    assert torch.equal(res.indices, exact.indices)
    t_exact = _median_s(lambda: select_topk(*args, output_mode="selected", **kw), cfg.repeat)
    t_pass = _median_s(lambda: compact_pass(*args, k8_pages=k8, scale_pages=sc, **kw), cfg.repeat)
    t_portable = _median_s(
        lambda: compact_pass(*args, k8_pages=k8, scale_pages=sc, isa="portable", **kw), cfg.repeat
    )
    t_call = _median_s(
        lambda: select_topk_compact(*args, k8_pages=k8, scale_pages=sc, **kw), cfg.repeat
    )
    k = int(budget[0])
    by = bytes_read([ctx] * n_req, [cfg.tail] * n_req, [k] * n_req, st.num_candidates, d)
    ranked = ctx - cfg.tail
    frac = st.num_candidates.double() / ranked
    return {
        "context": ctx, "requests": n_req, "group": group, "q_scale": qs, "k": k,
        "candidate_fraction_mean": float(frac.mean()), "candidate_fraction_max": float(frac.max()),
        "certified_items": float((st.status == compact.CERTIFIED).double().mean()),
        "fallback": st.fallback, "exact_s": t_exact, "exact_isa": kernel_info()["isa"],
        "compact_pass_s": t_pass, "compact_pass_portable_s": t_portable, "compact_call_s": t_call,
        "bytes_per_request_block_exact": by["exact"] / n_req * HOST_LAYERS,
        "bytes_per_request_block_compact_pass": by["compact"] / n_req * HOST_LAYERS,
    }  # fmt: skip


def cmd_synthetic(cfg: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for ctx in cfg.contexts:
        for n_req in cfg.requests:
            for group in cfg.groups:
                for qs in cfg.q_scales:
                    row = synthetic_case(cfg, ctx, n_req, group, qs)
                    rows.append(row)
                    print(_line(row), file=sys.stderr)
    return {"points": rows}


def _line(row: dict[str, Any]) -> str:
    return (
        f"S={row['context']} n={row['requests']} G={row['group']} qs={row['q_scale']}: "
        f"cand {100 * row['candidate_fraction_mean']:.1f}% (max "
        f"{100 * row['candidate_fraction_max']:.1f}%), certified "
        f"{100 * row['certified_items']:.0f}%, exact {1e3 * row['exact_s']:.1f} ms, pass "
        f"{1e3 * row['compact_pass_s']:.1f} ms (portable {1e3 * row['compact_pass_portable_s']:.1f}"
        f"), call {1e3 * row['compact_call_s']:.1f} ms"
    )


def cmd_capture(cfg: argparse.Namespace) -> dict[str, Any]:
    """Prefill + one denoising step of the embedded checkpoint; save keys and queries."""
    import inspect
    import typing

    from herald.bench.capture import capture_dense
    from herald.config import SamplingParams
    from herald.models.loader import load_model

    torch.manual_seed(0)
    model, config, tok = load_model("code-sdar", device="cpu", dtype=torch.float32)
    files = [Path(typing.__file__), Path(inspect.__file__)]
    text = "".join(f.read_text() for f in files)
    ids = tok.encode(text)[: cfg.context]
    t0 = time.perf_counter()
    params = SamplingParams(num_denoise_steps=1)
    cap = capture_dense(model, config, ids, 1, params)  # type: ignore[arg-type]
    start = cap.block_starts[0]
    step = cap.steps[start][0]
    record = {
        "keys": {i: cap.committed_k[i][:, :start].bfloat16() for i in step.q},
        "queries": {i: q.bfloat16() for i, q in step.q.items()},
        "prefix": start, "block": config.block_size,
        "files": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "tokens": len(ids), "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, cfg.out)
    return {k: v for k, v in record.items() if k not in ("keys", "queries")}


def _midpoint_choice(x: torch.Tensor, keys: torch.Tensor, k: int, scale: float) -> dict:
    """Float64 analysis of one item: the reference's candidates and certificate, and the top-k
    a non-exact variant would take from the candidates' exact scores with each normaliser at
    the midpoint of its bounds."""
    seq = keys.shape[0]
    q8, s = quantize_keys(keys)
    item = compact.select_item(x, keys, keys, q8, s, seq, k, scale)
    lo, hi = compact.first_pass_bounds(x, q8, s, scale)
    ib = compact.candidate_set(lo, hi, seq, k)
    cand = ib.candidates.nonzero().squeeze(1)
    ce = torch.exp(scale * (x @ keys[cand].double().T) - ib.shift[:, None])
    rest = ~ib.candidates
    z_lo = ce.sum(1) + ib.e_lo[:, rest].sum(1)
    z_hi = ce.sum(1) + ib.e_hi[:, rest].sum(1)
    pick = cand[torch.topk((ce / ((z_lo + z_hi) / 2)[:, None]).sum(0), k).indices]
    imp = torch.softmax(scale * (x @ keys.double().T), dim=-1).sum(0)
    top = torch.topk(imp, k).indices
    return {
        "candidate_fraction": item.candidates / seq, "status": compact.STATUS_NAMES[item.status],
        "midpoint_overlap": len(set(pick.tolist()) & set(top.tolist())) / k,
        "midpoint_mass": float(imp[pick].sum() / imp[top].sum()),
        "normaliser_uncertainty": float(((z_hi - z_lo) / z_lo).max()),
    }  # fmt: skip


def _offloaded(
    rec: dict[str, Any], cfg: argparse.Namespace
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """A record's offloaded layers: ``(layer, keys [Hkv, S, D], queries [B, Hq, D], k)``."""
    for layer in sorted(rec["keys"]):
        if layer >= cfg.num_dense:
            keys = rec["keys"][layer]
            yield layer, keys, rec["queries"][layer], math.ceil(cfg.budget * keys.shape[1])


def cmd_real(cfg: argparse.Namespace) -> dict[str, Any]:
    rec = torch.load(cfg.record)
    rows = []
    for layer, keys, q, k in _offloaded(rec, cfg):
        hkv, seq, d = keys.shape
        scale = float(torch.tensor(d**-0.5, dtype=torch.float32))
        mid = q.shape[0] // 2  # the block's centre [MASK] query, and all B of them
        for name, qs in (("representative", q[mid : mid + 1]), ("block", q)):
            xs = group_queries(qs, hkv, torch.float64)
            for h in range(hkv):
                row = {"layer": layer, "head": h, "queries": name, "rows": xs.shape[1], "k": k}
                row.update(_midpoint_choice(xs[h], keys[h], k, scale))
                rows.append(row)
        rows += _native_rows(rec, layer, keys, q, k, cfg)
    return {"budget": cfg.budget, "prefix": rec["prefix"], "files": rec["files"], "items": rows}


def cmd_device(cfg: argparse.Namespace) -> dict[str, Any]:
    from herald.offload.selection.compact_device import DeviceCompactKeys, select_int8

    if not 0.0 < cfg.budget <= 1.0:
        raise SystemExit(f"error: --budget must be in (0, 1], got {cfg.budget}")
    rec = torch.load(cfg.record)
    layers = sorted(rec["keys"])
    if not 0 <= cfg.num_dense < len(layers):
        raise SystemExit(f"error: --num-dense must be in [0, {len(layers) - 1}] for this record "
                         f"({len(layers)} layers), got {cfg.num_dense}")  # fmt: skip
    rows = []
    for layer, keys, q, k in _offloaded(rec, cfg):
        hkv, seq, d = keys.shape
        mid = q[q.shape[0] // 2][None]  # the block's centre [MASK] query
        store = DeviceCompactKeys([layer], 1, hkv, seq, d, torch.device("cpu"))
        store.write(layer, 0, 0, keys)
        picks = {f: select_int8(mid, store, layer, 0, [seq], [min(seq, math.ceil(f * k))],
                                keys[None, :, :0])[0]  # fmt: skip
                 for f in (1.0, 1.5, 2.0)}  # fmt: skip
        x = group_queries(mid, hkv, torch.float64)
        imp = torch.softmax(x @ keys.double().transpose(1, 2) * d**-0.5, dim=-1).sum(1)
        for h in range(hkv):
            top = set(torch.topk(imp[h], k).indices.tolist())
            got = picks[1.0][h].tolist()
            row = {"layer": layer, "head": h, "k": k, "prefix": seq,
                   "overlap": len(top & set(got)) / k,
                   "mass": float(imp[h, got].sum() / imp[h, list(top)].sum())}  # fmt: skip
            for f in (1.5, 2.0):
                row[f"exact_in_top_{f:g}k"] = len(top & set(picks[f][h].tolist())) / k
            rows.append(row)
    summary = {
        key: {"mean": statistics.mean(r[key] for r in rows), "min": min(r[key] for r in rows)}
        for key in ("overlap", "mass", "exact_in_top_1.5k", "exact_in_top_2k")
    }
    print(summary)
    return {"budget": cfg.budget, "prefix": rec["prefix"], "files": rec["files"],
            "summary": summary, "items": rows}  # fmt: skip


def _native_rows(
    rec: dict[str, Any], layer: int, keys: torch.Tensor, q: torch.Tensor, k: int, cfg: Any
) -> list[dict[str, Any]]:
    """The native pass on the same layer (representative query), timed beside the exact one."""
    hkv, seq, d = keys.shape
    b = rec["block"]
    kp, pt = paged(keys[None], b, layer)
    vp = torch.randn(kp.shape, generator=torch.Generator().manual_seed(layer)).bfloat16()
    mid = q.shape[0] // 2
    args = (q[mid : mid + 1][None], kp, vp, pt, torch.tensor([seq], dtype=torch.int32),
            torch.tensor([k], dtype=torch.int32))  # fmt: skip
    k8, sc = quantize_keys(kp)
    res, st = compact_pass(*args, k8_pages=k8, scale_pages=sc, num_threads=cfg.threads)
    exact = select_topk(*args, output_mode="selected", num_threads=cfg.threads)
    ok = bool(torch.equal(res.indices, exact.indices)) if not st.fallback else None
    return [
        {"layer": layer, "head": h, "queries": "representative (native pass)",
         "candidate_fraction": int(st.num_candidates[0, h]) / seq,
         "status": compact.STATUS_NAMES[int(st.status[0, h])], "equal_if_certified": ok}
        for h in range(hkv)
    ]  # fmt: skip


def cmd_exp(cfg: argparse.Namespace) -> dict[str, Any]:
    isas = ["avx512", "avx2", "portable"]
    best = best_isa()
    out = {}
    for isa in isas[isas.index(best) :] if best in isas else ["portable"]:
        err, side = exp_bound_error(isa, cfg.stride)
        out[isa] = {"max_relative_error": err, "max_wrong_side": side, "stride": cfg.stride}
        print(isa, out[isa], file=sys.stderr)
    return {"exp": out}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m herald.bench.compact", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    syn = sub.add_parser("synthetic", help="random KV: candidates, bytes, kernel times")
    syn.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    syn.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    syn.add_argument("--groups", type=int, nargs="+", default=[4, 1])
    syn.add_argument("--q-scales", type=float, nargs="+", default=[1.0, 4.0])
    syn.add_argument("--kv-heads", type=int, default=4)
    syn.add_argument("--head-dim", type=int, default=128)
    syn.add_argument("--page-size", type=int, default=32)
    syn.add_argument("--tail", type=int, default=32)
    syn.add_argument("--budget", type=float, default=0.05)
    syn.add_argument("--repeat", type=int, default=15)
    cap = sub.add_parser("capture", help="real keys/queries of the embedded checkpoint")
    cap.add_argument("--context", type=int, default=16384)
    real = sub.add_parser("real", help="candidate sets on a captured record")
    real.add_argument("record", type=Path)
    real.add_argument("--budget", type=float, default=0.05)
    real.add_argument("--num-dense", type=int, default=2)
    dev = sub.add_parser("device", help="first_pass='int8-gpu' against exact on a record")
    dev.add_argument("record", type=Path, help="a file written by the capture subcommand")
    dev.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="k = ceil(budget x prefix), in (0, 1] (default %(default)s)",
    )
    dev.add_argument("--num-dense", type=int, default=2,
                     help="leading layers not analysed (default %(default)s)")  # fmt: skip
    exp = sub.add_parser("exp", help="the pass's exp bound over every float argument")
    exp.add_argument("--stride", type=int, default=1)
    for p in (syn, cap, real, dev, exp):
        p.add_argument("--out", type=Path, required=p is cap)
        p.add_argument("--threads", type=int, default=None)
    cfg = ap.parse_args(argv)
    cfg.threads = selection_threads(cfg.threads)
    t0 = time.perf_counter()
    cmds = {"synthetic": cmd_synthetic, "capture": cmd_capture, "real": cmd_real,
            "device": cmd_device, "exp": cmd_exp}  # fmt: skip
    run = cmds[cfg.cmd]
    result = run(cfg)
    payload = {
        "command": command_line(), "machine": machine_info(), "code": code_version(),
        "threads": cfg.threads, "compact_isa": best_isa(), "seconds": time.perf_counter() - t0,
        **result,
    }  # fmt: skip
    if cfg.out is not None and cfg.cmd != "capture":
        write_json(cfg.out, payload)
    elif cfg.cmd == "capture":
        write_json(cfg.out.with_suffix(".json"), payload)
    print({k: v for k, v in payload.items() if k not in ("points", "items")})


if __name__ == "__main__":
    main()
