"""Pure-PyTorch selection: input checks, the reference (the spec) and the fallback.

The native kernel (herald/csrc, wrapped by :mod:`herald.offload.selection.cpu`) must match
:func:`select_topk_torch` and :func:`gather_selected_torch`; the tests compare them on fresh random
inputs, with ``compute_dtype=torch.float64`` as the reference. With ``torch.float32`` the same
functions are the fallback used when the native library cannot be built or loaded.
Semantics are those of HERALD §IV-B4; see :func:`herald.offload.selection.cpu.select_topk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from herald.offload.selection import topk
from herald.offload.selection.topk import group_queries


class NonFiniteScoreError(ValueError):
    """An attention score is NaN or inf: q or K holds NaN/inf (or a score overflows float32)."""


@dataclass
class SelectionResult:
    """Output of ``select_topk`` (all CPU tensors).

    indices:      [n_req, num_kv_heads, k_max] int32, selected logical positions ascending,
                  -1 past ``num_selected[r]``; k_max = max(1, max_r num_selected[r]). Never holds
                  a tail position (``>= seq_lens[r] - tail_lens[r]``).
    num_selected: [n_req] int32, ``min(budget_tokens[r], seq_lens[r] - tail_lens[r])`` (may be
                  0 when the whole sequence is tail).
    attn_output:  [n_req, n_q, num_heads, head_dim] float32.
    importance:   [n_req, num_kv_heads, S_max] float32 (0 past ``seq_lens[r]``), if requested.
    """

    indices: torch.Tensor
    num_selected: torch.Tensor
    attn_output: torch.Tensor
    importance: torch.Tensor | None = None


@dataclass(frozen=True)
class SelectionShapes:
    """Sizes of one validated ``select_topk`` call."""

    n_req: int
    n_q: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    max_pages: int
    seq_lens: list[int]
    tail_lens: list[int]
    num_selected: list[int]
    k_max: int
    s_max: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _tensor(x: object, name: str, dtype: torch.dtype, dim: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {x.dtype} (shape {tuple(x.shape)})")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {x.device}")
    return x


def check_pages(k_pages: object, v_pages: object) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v pools: [num_pages, num_kv_heads, page_size, head_dim] bf16, rows contiguous."""
    layout = "[num_pages, num_kv_heads, page_size, head_dim] bfloat16"
    k = _tensor(k_pages, "k_pages", torch.bfloat16, 4, layout)
    v = _tensor(v_pages, "v_pages", torch.bfloat16, 4, layout)
    if v.shape != k.shape:
        raise ValueError(f"v_pages shape {tuple(v.shape)} != k_pages shape {tuple(k.shape)}")
    if k.stride(3) != 1 or k.stride(2) != k.shape[3] or v.stride() != k.stride():
        raise ValueError(
            "k_pages/v_pages need contiguous [page_size, head_dim] slabs and equal strides, got "
            f"strides {k.stride()} and {v.stride()}"
        )
    return k, v


def _check_page_ids(page_table: torch.Tensor, used: torch.Tensor, num_pages: int) -> None:
    """Every page_table entry a request uses (first ``used[r]`` columns) is in range."""
    cols = torch.arange(page_table.shape[1])
    mask = cols[None, :] < used[:, None]
    bad = mask & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"page_table[{r}, {c}] = {int(page_table[r, c])} is outside [0, num_pages={num_pages})"
        )


def check_selection_inputs(
    q: object,
    k_pages: object,
    v_pages: object,
    page_table: object,
    seq_lens: object,
    budget_tokens: object,
    output_mode: str,
    check_page_ids: bool = True,
    *,
    tail_lens: object = None,
    gather_out: object = None,
) -> SelectionShapes:
    """Validates ``select_topk`` arguments; raises TypeError/ValueError naming the argument.

    ``check_page_ids=False`` skips the range check of the used page_table entries (the native
    kernel performs it itself). ``tail_lens`` None means no tail (all zeros); ``gather_out``
    None means no gather.
    """
    q = _tensor(q, "q", torch.bfloat16, 4, "[n_req, n_q, num_heads, head_dim] bfloat16")
    k, _ = check_pages(k_pages, v_pages)
    n_req, n_q, num_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, kd = k.shape
    if kd != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_pages head_dim {kd}")
    if min(n_req, n_q, num_heads, head_dim, num_kv_heads, page_size) < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k_pages {tuple(k.shape)}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    pt = _tensor(page_table, "page_table", torch.int32, 2, "[n_req, max_pages] int32")
    sl = _tensor(seq_lens, "seq_lens", torch.int32, 1, "[n_req] int32")
    bt = _tensor(budget_tokens, "budget_tokens", torch.int32, 1, "[n_req] int32")
    named = [("page_table", pt), ("seq_lens", sl), ("budget_tokens", bt)]
    tl = None
    if tail_lens is not None:
        tl = _tensor(tail_lens, "tail_lens", torch.int32, 1, "[n_req] int32")
        named.append(("tail_lens", tl))
    for name, t in named:
        if t.shape[0] != n_req:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match n_req = {n_req}")
    if output_mode not in ("full", "selected"):
        raise ValueError(f"output_mode must be 'full' or 'selected', got {output_mode!r}")
    max_pages = pt.shape[1]
    lens, budgets = sl.tolist(), bt.tolist()
    tails = tl.tolist() if tl is not None else [0] * n_req
    for r, (s, b, t) in enumerate(zip(lens, budgets, tails, strict=True)):
        if not 1 <= s <= max_pages * page_size:
            raise ValueError(
                f"seq_lens[{r}] = {s} must be in [1, max_pages * page_size = "
                f"{max_pages * page_size}]"
            )
        if b < 1:
            raise ValueError(f"budget_tokens[{r}] = {b} must be >= 1")
        if not 0 <= t <= s:
            raise ValueError(f"tail_lens[{r}] = {t} must be in [0, seq_lens[{r}] = {s}]")
    if check_page_ids:
        _check_page_ids(pt, (sl + page_size - 1) // page_size, num_pages)
    num_selected = [min(s - t, b) for s, b, t in zip(lens, budgets, tails, strict=True)]
    k_max = max(1, *num_selected)
    if gather_out is not None:
        _check_gather_out(gather_out, (2, n_req, num_kv_heads, k_max, head_dim))
    return SelectionShapes(
        n_req, n_q, num_heads, num_kv_heads, head_dim, page_size, num_pages, max_pages,
        lens, tails, num_selected, k_max, max(lens),
    )  # fmt: skip


def _check_gather_out(out: object, shape: tuple[int, ...]) -> None:
    """A gather destination: a contiguous bf16 CPU tensor of exactly ``shape``."""
    o = _tensor(out, "gather_out", torch.bfloat16, 5, "[2, n_req, num_kv_heads, k_max, head_dim]")
    if tuple(o.shape) != shape or not o.is_contiguous():
        raise ValueError(
            f"gather_out must be contiguous {shape} (k_max = max(1, max num_selected)), got shape "
            f"{tuple(o.shape)} (contiguous={o.is_contiguous()})"
        )


def _request_rows(pages: torch.Tensor, page_ids: torch.Tensor, s: int) -> torch.Tensor:
    """[num_kv_heads, S, head_dim]: the first S logical rows of one request."""
    x = pages[page_ids.long()]  # [n_pages, Hkv, P, D]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :s]


def select_topk_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    budget_tokens: torch.Tensor,
    *,
    tail_lens: torch.Tensor | None = None,
    output_mode: str = "full",
    return_importance: bool = False,
    compute_dtype: torch.dtype = torch.float64,
    gather_out: torch.Tensor | None = None,
) -> SelectionResult:
    """PyTorch ``select_topk`` (same contract); computes in ``compute_dtype``.

    Ties in importance go to the smaller position (a stable descending sort). The tail
    ``[S - tail, S)`` takes part in the softmax and the importance but not in the ranking;
    ``selected`` mode attends over the selected rows and the tail rows. ``gather_out``: the
    selected rows are also gathered there (:func:`gather_selected_torch` of the result).
    """
    sh = check_selection_inputs(
        q, k_pages, v_pages, page_table, seq_lens, budget_tokens, output_mode,
        tail_lens=tail_lens, gather_out=gather_out,
    )  # fmt: skip
    hkv, g, d, p = sh.num_kv_heads, sh.group_size, sh.head_dim, sh.page_size
    indices = torch.full((sh.n_req, hkv, sh.k_max), -1, dtype=torch.int32)
    out = torch.empty(sh.n_req, sh.n_q, sh.num_heads, d, dtype=torch.float32)
    imp_out = (
        torch.zeros(sh.n_req, hkv, sh.s_max, dtype=torch.float32) if return_importance else None
    )
    for r in range(sh.n_req):
        s, k = sh.seq_lens[r], sh.num_selected[r]
        ranked = s - sh.tail_lens[r]  # positions [0, ranked) compete; [ranked, s) is the tail
        ids = page_table[r, : (s + p - 1) // p]
        keys = _request_rows(k_pages, ids, s).to(compute_dtype)  # [Hkv, S, D]
        vals = _request_rows(v_pages, ids, s).to(compute_dtype)
        qr = group_queries(q[r], hkv, compute_dtype)  # [Hkv, n_q * G, D]
        scores = topk.scores(qr, keys, d)  # [Hkv, Qn, S]
        finite = torch.isfinite(scores).flatten(1).all(dim=1)
        if not bool(finite.all()):
            h = int((~finite).nonzero()[0])
            raise NonFiniteScoreError(
                f"non-finite attention score for request {r}, KV head {h} "
                "(NaN or inf in q or K, or a score overflowing float32)"
            )
        probs = torch.softmax(scores, dim=-1)  # normalised over all S, tail included
        imp = probs.sum(dim=1)  # [Hkv, S]
        sel = topk.topk_ascending(imp[:, :ranked], k)  # [Hkv, k]
        indices[r, :, :k] = sel.to(torch.int32)
        if imp_out is not None:
            imp_out[r, :, :s] = imp.float()
        if output_mode == "full":
            o = torch.matmul(probs, vals)  # [Hkv, Qn, D]
        else:  # the rows the sparse attention sees: selected, then the tail
            tail = torch.arange(ranked, s).expand(hkv, -1)
            rows = torch.cat([sel, tail], dim=1)
            s_sel = scores.gather(2, rows[:, None, :].expand(-1, scores.shape[1], -1))
            v_sel = vals.gather(1, rows[:, :, None].expand(-1, -1, d))
            o = torch.matmul(torch.softmax(s_sel, dim=-1), v_sel)
        o = o.view(hkv, sh.n_q, g, d).permute(1, 0, 2, 3).reshape(sh.n_q, sh.num_heads, d)
        out[r] = o.float()
    num = torch.tensor(sh.num_selected, dtype=torch.int32)
    if gather_out is not None:
        gather_selected_torch(k_pages, v_pages, page_table, indices, num, gather_out)
    return SelectionResult(indices, num, out, imp_out)


def check_gather_inputs(
    k_pages: object,
    v_pages: object,
    page_table: object,
    indices: object,
    num_selected: object,
    out: object,
) -> tuple[int, int, int, int]:
    """Validates ``gather_selected`` arguments; returns (n_req, num_kv_heads, k_max, head_dim)."""
    k, _ = check_pages(k_pages, v_pages)
    num_pages, hkv, page_size, d = k.shape
    pt = _tensor(page_table, "page_table", torch.int32, 2, "[n_req, max_pages] int32")
    idx = _tensor(indices, "indices", torch.int32, 3, "[n_req, num_kv_heads, k_max] int32")
    ns = _tensor(num_selected, "num_selected", torch.int32, 1, "[n_req] int32")
    n_req, k_max = idx.shape[0], idx.shape[2]
    if idx.shape[1] != hkv or pt.shape[0] != n_req or ns.shape[0] != n_req:
        raise ValueError(
            f"indices {tuple(idx.shape)}, page_table {tuple(pt.shape)} and num_selected "
            f"{tuple(ns.shape)} disagree with n_req / num_kv_heads = {hkv}"
        )
    if n_req and (int(ns.min()) < 0 or int(ns.max()) > k_max):
        raise ValueError(f"num_selected must be in [0, k_max = {k_max}], got {ns.tolist()}")
    if out is not None:
        o = _tensor(out, "out", torch.bfloat16, 5, "[2, n_req, num_kv_heads, k_max, head_dim]")
        if tuple(o.shape) != (2, n_req, hkv, k_max, d) or not o.is_contiguous():
            raise ValueError(
                f"out must be contiguous {(2, n_req, hkv, k_max, d)}, got shape "
                f"{tuple(o.shape)} (contiguous={o.is_contiguous()})"
            )
    return n_req, hkv, k_max, d


def gather_selected_torch(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    indices: torch.Tensor,
    num_selected: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch ``gather_selected`` (same contract: rows past num_selected are left untouched)."""
    n_req, hkv, k_max, d = check_gather_inputs(
        k_pages, v_pages, page_table, indices, num_selected, out
    )
    if out is None:
        out = torch.empty(2, n_req, hkv, k_max, d, dtype=torch.bfloat16)
    p, max_pages = k_pages.shape[2], page_table.shape[1]
    heads = torch.arange(hkv)[:, None]
    for r, ns in enumerate(num_selected.tolist()):
        pos = indices[r, :, :ns].long()
        if ns and (int(pos.min()) < 0 or int(pos.max()) >= max_pages * p):
            raise ValueError(f"indices[{r}] outside [0, max_pages * page_size = {max_pages * p})")
        pg = page_table[r].long()[pos // p]
        if ns and (int(pg.min()) < 0 or int(pg.max()) >= k_pages.shape[0]):
            raise ValueError(f"page_table[{r}] holds a page id outside [0, {k_pages.shape[0]})")
        out[0, r, :, :ns] = k_pages[pg, heads, pos % p]
        out[1, r, :, :ns] = v_pages[pg, heads, pos % p]
    return out
