"""Shared helpers of the selection-kernel tests: random paged inputs and float64 checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from herald.offload.selection.ref import SelectionResult, select_topk_torch


@dataclass
class Inputs:
    q: torch.Tensor
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    budget: torch.Tensor
    tail_lens: torch.Tensor | None = None

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_pages, self.v_pages, self.page_table, self.seq_lens, self.budget

    def ranked(self, r: int) -> int:
        """Length of request r's ranked part (seq_len minus tail)."""
        tail = 0 if self.tail_lens is None else int(self.tail_lens[r])
        return int(self.seq_lens[r]) - tail


def make_inputs(
    seed: int,
    seq_lens: list[int],
    budgets: list[int],
    *,
    n_q: int = 1,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 128,
    page_size: int = 32,
    spare_pages: int = 3,
    q_scale: float = 2.0,
    tail_lens: list[int] | None = None,
) -> Inputs:
    """Fresh random (never zero) inputs; requests' pages are shuffled through one pool.

    page_table columns past a request's pages hold -1 (they must never be read). q is scaled up
    so that attention is peaked and the top-k has clear winners.
    """
    g = torch.Generator().manual_seed(seed)
    n_req = len(seq_lens)
    pages = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(pages) + spare_pages
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    k = torch.randn(shape, generator=g).to(torch.bfloat16)
    v = torch.randn(shape, generator=g).to(torch.bfloat16)
    q = (torch.randn(n_req, n_q, num_kv_heads * group, head_dim, generator=g) * q_scale).bfloat16()
    perm = torch.randperm(num_pages, generator=g)
    max_pages = max(pages) + 1
    pt = torch.full((n_req, max_pages), -1, dtype=torch.int32)
    off = 0
    for r, n in enumerate(pages):
        pt[r, :n] = perm[off : off + n].int()
        off += n
    return Inputs(
        q,
        k,
        v,
        pt,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(budgets, dtype=torch.int32),
        None if tail_lens is None else torch.tensor(tail_lens, dtype=torch.int32),
    )


def reference(inp: Inputs, mode: str) -> SelectionResult:
    return select_topk_torch(
        *inp.args(), tail_lens=inp.tail_lens, output_mode=mode, return_importance=True
    )


def sparse_output(inp: Inputs, indices: torch.Tensor, num_selected: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention restricted to the given rows and the tail rows: what
    ``selected`` mode returns."""
    n_req, n_q, h, d = inp.q.shape
    hkv, p = inp.k_pages.shape[1], inp.k_pages.shape[2]
    g = h // hkv
    out = torch.empty(n_req, n_q, h, d, dtype=torch.float64)
    for r in range(n_req):
        ns, ranked = int(num_selected[r]), inp.ranked(r)
        tail = torch.arange(ranked, int(inp.seq_lens[r]))
        for kh in range(hkv):
            pos = torch.cat([indices[r, kh, :ns].long(), tail])
            pg = inp.page_table[r].long()[pos // p]
            keys = inp.k_pages[pg, kh, pos % p].double()
            vals = inp.v_pages[pg, kh, pos % p].double()
            qs = inp.q[r, :, kh * g : (kh + 1) * g].double()  # [n_q, G, D]
            w = torch.softmax(qs @ keys.T * d**-0.5, dim=-1)
            out[r, :, kh * g : (kh + 1) * g] = w @ vals
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def check_selection(
    res: SelectionResult, ref: SelectionResult, inp: Inputs, mode: str, *, tol: float = 1e-2
) -> None:
    """Indices match up to ties (captured importance mass; exact sets when no near-tie).

    With a tail, indices stay inside the ranked part ``[0, seq_len - tail)``.
    """
    assert torch.equal(res.num_selected, ref.num_selected)
    assert res.indices.shape == ref.indices.shape and res.indices.dtype == torch.int32
    assert ref.importance is not None
    for r in range(inp.seq_lens.shape[0]):
        ns, ranked = int(ref.num_selected[r]), inp.ranked(r)
        assert ns == min(int(inp.budget[r]), ranked)
        for h in range(inp.k_pages.shape[1]):
            got, want = res.indices[r, h, :ns], ref.indices[r, h, :ns]
            assert bool((res.indices[r, h, ns:] == -1).all())
            if ns == 0:
                continue
            assert bool((got[1:] > got[:-1]).all()), "indices must ascend"
            assert int(got.min()) >= 0 and int(got.max()) < ranked
            imp = ref.importance[r, h, :ranked].double()
            mass_got, mass_want = float(imp[got.long()].sum()), float(imp[want.long()].sum())
            assert mass_got >= mass_want * (1 - 1e-5) - 1e-9, (r, h, mass_got, mass_want)
            srt = torch.sort(imp, descending=True).values
            if ns < ranked and float(srt[ns - 1] - srt[ns]) > 1e-4 * float(srt[ns - 1]):
                assert torch.equal(got, want), (r, h)
    want_out = (
        ref.attn_output if mode == "full" else sparse_output(inp, res.indices, res.num_selected)
    )
    assert res.attn_output.dtype == torch.float32
    assert rel_err(res.attn_output, want_out) < tol
