"""select_topk with an always-included tail (the draft block of HERALD's lookahead).

The last ``tail_lens[r]`` positions are attended to and normalised over like any key, but never
ranked: indices stay in ``[0, S - tail)``, num_selected = min(budget, S - tail), and ``selected``
mode attends over the selected rows plus the tail rows.
"""

from __future__ import annotations

import re

import pytest
import torch
from selection_utils import Inputs, check_selection, make_inputs, reference, rel_err

from herald.offload.selection import _kernel, _kernel_build
from herald.offload.selection.cpu import gather_selected, select_topk
from herald.offload.selection.ref import SelectionResult, select_topk_torch

NATIVE = _kernel.load_native()
HAS_AVX512 = bool(NATIVE and NATIVE.has_avx512bf16)
needs_native = pytest.mark.skipif(NATIVE is None, reason="native library unavailable")
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="CPU lacks AVX-512 BF16")
# (backend, isa): every native ISA this CPU runs, and the PyTorch fallback
PATHS = [
    pytest.param(("native", "avx512"), marks=needs_avx512, id="avx512"),
    pytest.param(("native", "avx512bf16"), marks=needs_avx512, id="avx512bf16"),
    pytest.param(("native", "portable"), marks=needs_native, id="portable"),
    pytest.param(("torch", "auto"), id="torch"),
]
PAGE = 32
# request: (prefix, tail, budget)
#   one page of draft after a 300-token prefix (the draft straddles a page boundary),
#   a one-page draft after a partial page, a partial tail, a prefix smaller than the budget,
#   only the draft (prefix of 0 tokens: nothing ranked), and no tail at all
REQUESTS = [(300, PAGE, 40), (77, PAGE, 7), (32, 13, 9), (13, PAGE, 100), (0, PAGE, 5), (45, 0, 9)]


def tail_inputs(seed: int, requests: list[tuple[int, int, int]], **kw: object) -> Inputs:
    return make_inputs(
        seed,
        [p + t for p, t, _ in requests],
        [b for _, _, b in requests],
        tail_lens=[t for _, t, _ in requests],
        **kw,
    )


def run(inp: Inputs, mode: str, num_threads: int | None = None) -> SelectionResult:
    return select_topk(
        *inp.args(),
        tail_lens=inp.tail_lens,
        output_mode=mode,
        return_importance=True,
        num_threads=num_threads,
    )


@pytest.fixture
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    backend, isa = request.param
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    monkeypatch.setenv("HERALD_SELECTION_ISA", isa)
    return f"{backend}:{isa}"


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("mode", ["full", "selected"])
@pytest.mark.parametrize(("group", "n_q"), [(1, 1), (4, 1), (1, 32), (4, 32)])
def test_tail_matches_reference(path: str, mode: str, group: int, n_q: int) -> None:
    inp = tail_inputs(100 + group * 40 + n_q, REQUESTS, n_q=n_q, group=group, page_size=PAGE)
    res = run(inp, mode, 2)
    ref = reference(inp, mode)
    check_selection(res, ref, inp, mode)
    assert res.num_selected.tolist() == [40, 7, 9, 13, 0, 9]
    assert res.indices.shape == (len(REQUESTS), 2, 40)
    assert bool((res.indices[4] == -1).all())
    # importance: the very vector of a call without a tail (softmax over all S)
    assert ref.importance is not None
    plain = select_topk_torch(*inp.args(), output_mode="full", return_importance=True)
    assert torch.equal(ref.importance, plain.importance)
    assert torch.allclose(res.importance, ref.importance, rtol=1e-3, atol=1e-6)
    if mode == "full":  # exact attention over all S: the tail changes nothing
        assert rel_err(ref.attn_output, plain.attn_output) < 1e-6


@needs_native
@pytest.mark.parametrize("schedule", ["items", "tiles"])
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_tail_schedules(schedule: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles lying wholly or partly in the tail contribute no candidates; any split agrees."""
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    monkeypatch.setenv("HERALD_SELECTION_SCHEDULE", schedule)
    reqs = [(1000, 2 * PAGE, 60), (70, 45, 10), (0, 64, 3)]
    inp = tail_inputs(200 + threads, reqs, num_kv_heads=1, n_q=3, page_size=PAGE)
    for mode in ("full", "selected"):
        res = run(inp, mode, threads)
        check_selection(res, reference(inp, mode), inp, mode)


@needs_native
@pytest.mark.parametrize("mode", ["full", "selected"])
def test_tail_native_equals_torch_fallback(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inp = tail_inputs(300, [(257, PAGE, 30), (64, 20, 64), (5, PAGE, 8)], n_q=2, page_size=PAGE)
    ref = reference(inp, mode)
    out = {}
    for backend in ("native", "torch"):
        monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
        out[backend] = run(inp, mode)
        check_selection(out[backend], ref, inp, mode)
    nat, tor = out["native"], out["torch"]
    assert torch.equal(nat.num_selected, tor.num_selected)
    assert torch.equal(nat.indices, tor.indices)
    assert rel_err(nat.attn_output, tor.attn_output) < 5e-3


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_zero_tail_equals_no_tail(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(400, [300, 77], [40, 7], n_q=2)
    zeros = torch.zeros(2, dtype=torch.int32)
    for mode in ("full", "selected"):
        a = select_topk(*inp.args(), output_mode=mode, return_importance=True)
        b = select_topk(*inp.args(), tail_lens=zeros, output_mode=mode, return_importance=True)
        for x, y in zip(
            (a.indices, a.num_selected, a.attn_output, a.importance),
            (b.indices, b.num_selected, b.attn_output, b.importance),
            strict=True,
        ):
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_selected_sees_everything_when_nothing_is_dropped(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All of S tail, or a budget covering the ranked part: selected mode == full attention."""
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = tail_inputs(500, [(0, PAGE, 4), (50, 20, 50), (3, 40, 100)], n_q=4, page_size=PAGE)
    full = run(inp, "full")
    sel = run(inp, "selected")
    assert sel.num_selected.tolist() == [0, 50, 3]
    assert rel_err(sel.attn_output, full.attn_output) < 1e-5


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_only_draft_gives_no_indices(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix of 0 tokens: indices all -1 (one column), and the gather copies nothing."""
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = tail_inputs(600, [(0, PAGE, 5), (0, 7, 1)], page_size=PAGE)
    for mode in ("full", "selected"):
        res = run(inp, mode)
        assert res.num_selected.tolist() == [0, 0]
        assert res.indices.shape == (2, 2, 1) and bool((res.indices == -1).all())
        check_selection(res, reference(inp, mode), inp, mode)
    out = torch.full((2, 2, 2, 1, 128), 7.0, dtype=torch.bfloat16)
    gather_selected(inp.k_pages, inp.v_pages, inp.page_table, res.indices, res.num_selected, out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_tail_underflow_recompute(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query head 1 attends only to position 40 (ranked, not selected): its probabilities on the
    selected row 7 and the tail [60, 64) underflow in float32; its selected-mode output must still
    be the softmax over those five rows."""
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(700, [64], [1], num_kv_heads=1, group=2, q_scale=0.01, tail_lens=[4])
    inp.k_pages.mul_(0.01)
    e1, e2 = torch.zeros(128), torch.zeros(128)
    e1[0], e2[1] = 10.0, 10.0
    p0, p1 = int(inp.page_table[0, 0]), int(inp.page_table[0, 1])
    inp.k_pages[p0, 0, 7], inp.k_pages[p1, 0, 8] = e1.bfloat16(), e2.bfloat16()  # pos 7, pos 40
    inp.q[0, 0, 0], inp.q[0, 0, 1] = (e1 * 21).bfloat16(), (e2 * 20).bfloat16()
    res = run(inp, "selected")
    assert res.indices.tolist() == [[[7]]]
    check_selection(res, reference(inp, "selected"), inp, "selected", tol=1e-4)


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_bad_tail_lens(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(800, [100, 50], [10, 10])
    cases: list[tuple[type[Exception], str, object]] = [
        (ValueError, r"tail_lens\[1\] = 51 must be in \[0, seq_lens\[1\] = 50\]", [0, 51]),
        (ValueError, r"tail_lens\[0\] = -1", [-1, 0]),
        (TypeError, "tail_lens must be torch.int32", torch.tensor([0, 0])),
        (ValueError, "tail_lens shape", torch.tensor([0], dtype=torch.int32)),
        (TypeError, "tail_lens must be a torch.Tensor", [0, 0]),
    ]
    for exc, match, tail in cases:
        if isinstance(tail, list) and exc is ValueError:
            tail = torch.tensor(tail, dtype=torch.int32)
        with pytest.raises(exc, match=match):
            select_topk(*inp.args(), tail_lens=tail)


@needs_native
def test_native_rejects_bad_tail() -> None:
    """The C entry point validates tail_lens itself (the Python checks are not its only guard)."""
    import ctypes

    assert NATIVE is not None
    inp = make_inputs(900, [40], [4], num_kv_heads=1, group=1)
    tail = torch.tensor([41], dtype=torch.int32)
    idx = torch.empty(1, 1, 4, dtype=torch.int32)
    ns = torch.empty(1, dtype=torch.int32)
    out = torch.empty(1, 1, 1, 128, dtype=torch.float32)
    args = _kernel.SelectArgs(
        n_req=1, n_q=1, num_heads=1, num_kv_heads=1, head_dim=128, page_size=32, max_pages=3,
        k_max=4, s_max=40, output_mode=1, isa=2, num_threads=1, schedule=0, prefetch_hint=0,
        prefetch_distance=1, num_pages=inp.k_pages.shape[0],
        page_stride=inp.k_pages.stride(0), head_stride=inp.k_pages.stride(1), scale=128**-0.5,
        q=inp.q.data_ptr(), k_pages=inp.k_pages.data_ptr(), v_pages=inp.v_pages.data_ptr(),
        page_table=inp.page_table.data_ptr(), seq_lens=inp.seq_lens.data_ptr(),
        budget=inp.budget.data_ptr(), indices=idx.data_ptr(), num_selected=ns.data_ptr(),
        attn_output=out.data_ptr(), importance=None, tail_lens=tail.data_ptr(),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"tail_lens\[0\] = 41"):
        _kernel.check(NATIVE, NATIVE.lib.herald_select_topk(ctypes.byref(args)), "select_topk")


def test_ctypes_mirror_matches_header() -> None:
    """SelectArgs lists herald_select_args' fields in order, and the ABI versions agree."""
    header = (_kernel_build.CSRC_DIR / "herald_selection.h").read_text()
    body = re.search(r"typedef struct \{(.*?)\} herald_select_args;", header, re.S)
    assert body is not None
    names: list[str] = []
    for line in body.group(1).splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:  # "[const] type[*] a, b, c"
            decl = re.sub(r"^(const\s+)?\w+\s*\**\s*", "", decl)
            names += [n.strip() for n in decl.split(",")]
    assert names == [f[0] for f in _kernel.SelectArgs._fields_]
    version = re.search(r"#define HERALD_ABI_VERSION (\d+)", header)
    assert version is not None and int(version.group(1)) == _kernel.ABI_VERSION
