"""select_topk's fused gather (``gather_out``) against the PyTorch reference on random KV."""

from __future__ import annotations

import pytest
import torch
from selection_utils import Inputs, check_selection, make_inputs, reference

from herald.offload.selection import _kernel
from herald.offload.selection.cpu import select_topk
from herald.offload.selection.ref import gather_selected_torch, select_topk_torch

NATIVE = _kernel.load_native()
HAS_AVX512 = bool(NATIVE and NATIVE.has_avx512bf16)
needs_native = pytest.mark.skipif(NATIVE is None, reason="native library unavailable")
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="CPU lacks AVX-512 BF16")
PATHS = [
    pytest.param(("native", "avx512"), marks=needs_avx512, id="avx512"),
    pytest.param(("native", "avx512bf16"), marks=needs_avx512, id="avx512bf16"),
    pytest.param(("native", "portable"), marks=needs_native, id="portable"),
    pytest.param(("torch", "auto"), id="torch"),
]
SENTINEL = 7.0  # rows past num_selected keep it


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    backend, isa = request.param
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    monkeypatch.setenv("HERALD_SELECTION_ISA", isa)
    return f"{backend}-{isa}"


def _staging(inp: Inputs, k_max: int) -> torch.Tensor:
    n, hkv, d = inp.q.shape[0], inp.k_pages.shape[1], inp.k_pages.shape[3]
    return torch.full((2, n, hkv, k_max, d), SENTINEL, dtype=torch.bfloat16)


def _check_gathered(inp: Inputs, res, out: torch.Tensor) -> None:
    """Rows [0, k_r) hold exactly the pool rows of the selected positions (the reference gather
    of the same indices); rows past k_r were not written."""
    want = gather_selected_torch(
        inp.k_pages, inp.v_pages, inp.page_table, res.indices, res.num_selected,
        torch.full_like(out, SENTINEL),
    )  # fmt: skip
    assert torch.equal(out, want)
    for r, ns in enumerate(res.num_selected.tolist()):
        assert bool((out[:, r, :, ns:] == SENTINEL).all())


@pytest.mark.parametrize("mode", ["full", "selected"])
@pytest.mark.parametrize("schedule", ["items", "tiles"])
def test_gathered_rows_equal_the_reference(
    path: str, mode: str, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HERALD_SELECTION_SCHEDULE", schedule)
    # several requests, partial last pages, a draft tail (never gathered), k = S - tail, k = 1
    inp = make_inputs(
        31, [332, 109, 64, 6], [40, 77, 1, 9], group=4, num_kv_heads=2,
        tail_lens=[32, 32, 0, 3],
    )  # fmt: skip
    ref_out = _staging(inp, 77)
    ref = select_topk_torch(
        *inp.args(), tail_lens=inp.tail_lens, output_mode=mode, return_importance=True,
        gather_out=ref_out,
    )  # fmt: skip
    out = _staging(inp, 77)
    res = select_topk(
        *inp.args(), tail_lens=inp.tail_lens, output_mode=mode, num_threads=3, gather_out=out
    )
    check_selection(res, ref, inp, mode)
    _check_gathered(inp, res, out)
    _check_gathered(inp, ref, ref_out)
    if torch.equal(res.indices, ref.indices):  # no near-tie moved a pick: the same rows
        assert torch.equal(out, ref_out)


def test_fused_gather_changes_nothing_else(path: str) -> None:
    """Indices, counts and outputs are those of a call without gather_out."""
    inp = make_inputs(8, [500, 45], [25, 45], n_q=2, head_dim=128)
    plain = select_topk(*inp.args(), output_mode="selected", num_threads=2)
    out = _staging(inp, int(plain.num_selected.max()))
    fused = select_topk(*inp.args(), output_mode="selected", num_threads=2, gather_out=out)
    assert torch.equal(plain.indices, fused.indices)
    assert torch.equal(plain.num_selected, fused.num_selected)
    assert torch.equal(plain.attn_output, fused.attn_output)
    _check_gathered(inp, fused, out)
    check_selection(fused, reference(inp, "selected"), inp, "selected")


def test_bad_gather_out_raises(path: str) -> None:
    inp = make_inputs(3, [100, 40], [10, 5])
    good = _staging(inp, 10)
    strided = torch.empty(2, 2, 2, 128, 10, dtype=torch.bfloat16).transpose(3, 4)
    for bad, match in [
        (good[:, :, :, :9], "gather_out must be contiguous"),  # k_max too small
        (good.float(), "bfloat16"),
        (strided, "contiguous"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            select_topk(*inp.args(), gather_out=bad)
