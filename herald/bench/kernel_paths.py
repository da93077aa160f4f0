"""The selection paths of the kernel benchmark (:mod:`herald.bench.kernel`) and their check.

:func:`naive_select` is what one would write in PyTorch (gather the pages, bf16 matmul, softmax,
top-k), timed beside the fused kernel; :func:`check_paths` compares every path (AVX-512 fp32-FMA,
AVX-512 vdpbf16ps, portable, PyTorch fallback, naive PyTorch) with the float64 reference on a
small input before any timing, in both output modes (:func:`sparse_ref`: the ``selected`` mode's
attention over the chosen rows).
"""

from __future__ import annotations

from typing import Any

import torch

from herald.bench.kernel_report import PAGE, SHAPES, log
from herald.env import overridden
from herald.offload.selection import _kernel
from herald.offload.selection.cpu import select_topk
from herald.offload.selection.ref import select_topk_torch


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
                with overridden(env):
                    res = select_topk(q, k, v, pt, sl, bt, output_mode=mode, num_threads=threads)
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
