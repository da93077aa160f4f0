"""select_topk / gather_selected (native kernel and PyTorch fallback) against the float64 spec."""

from __future__ import annotations

import threading

import pytest
import torch
from selection_utils import Inputs, check_selection, make_inputs, reference, rel_err

from herald.offload.selection import _kernel
from herald.offload.selection.cpu import NonFiniteScoreError, gather_selected, select_topk
from herald.offload.selection.ref import gather_selected_torch

NATIVE = _kernel.load_native()
HAS_AVX512 = bool(NATIVE and NATIVE.has_avx512bf16)
needs_native = pytest.mark.skipif(NATIVE is None, reason="native library unavailable")
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="CPU lacks AVX-512 BF16")
ISAS = [
    pytest.param("avx512", marks=needs_avx512),
    pytest.param("avx512bf16", marks=needs_avx512),
    pytest.param("portable", marks=needs_native),
]


@pytest.fixture
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    monkeypatch.setenv("HERALD_SELECTION_ISA", request.param)
    return str(request.param)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("mode", ["full", "selected"])
@pytest.mark.parametrize(("group", "n_q"), [(1, 1), (4, 1), (8, 1), (4, 32), (1, 32), (8, 4)])
def test_matches_reference(isa: str, mode: str, group: int, n_q: int) -> None:
    # several requests, different S (partial last pages), shuffled page tables, S < k, k = 1
    inp = make_inputs(
        group * 10 + n_q, [300, 77, 32, 5], [40, 7, 1, 9], n_q=n_q, group=group, num_kv_heads=2
    )
    res = select_topk(*inp.args(), output_mode=mode, return_importance=True, num_threads=2)
    ref = reference(inp, mode)
    check_selection(res, ref, inp, mode)
    assert res.importance is not None and ref.importance is not None
    assert torch.allclose(res.importance, ref.importance, rtol=1e-3, atol=1e-6)
    assert bool((res.importance[1, :, 77:] == 0).all())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize(
    ("seq_lens", "budgets", "page_size"),
    [([1], [1], 32), ([1, 2], [5, 1], 16), ([45], [200], 16), ([1000], [50], 32), ([33], [3], 8)],
)
def test_edge_sizes(isa: str, seq_lens: list[int], budgets: list[int], page_size: int) -> None:
    inp = make_inputs(len(seq_lens) + seq_lens[0], seq_lens, budgets, page_size=page_size)
    for mode in ("full", "selected"):
        check_selection(select_topk(*inp.args(), output_mode=mode), reference(inp, mode), inp, mode)


@needs_native
@pytest.mark.parametrize("head_dim", [64, 96, 40])
def test_other_head_dims(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    inp = make_inputs(head_dim, [150, 31], [12, 40], head_dim=head_dim, n_q=2)
    for mode in ("full", "selected"):
        check_selection(select_topk(*inp.args(), output_mode=mode), reference(inp, mode), inp, mode)


@needs_native
@pytest.mark.parametrize("schedule", ["items", "tiles"])
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_schedules_and_threads(
    schedule: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole items or tiles of S merged by top-k, any thread count: same answer."""
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    monkeypatch.setenv("HERALD_SELECTION_SCHEDULE", schedule)
    inp = make_inputs(threads, [1000, 70], [60, 70], num_kv_heads=1, n_q=3)
    for mode in ("full", "selected"):
        res = select_topk(*inp.args(), output_mode=mode, num_threads=threads)
        check_selection(res, reference(inp, mode), inp, mode)


@needs_native
def test_noncontiguous_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    inp = make_inputs(5, [200, 90], [20, 9], n_q=2)
    q_nc = inp.q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    assert not q_nc.is_contiguous()
    # a pool holding two layers: this layer's k/v pages are strided views
    pool = torch.stack([torch.stack([inp.k_pages, inp.v_pages], 1)] * 2, 1)  # [N, L, 2, H, P, D]
    k_nc, v_nc = pool[:, 1, 0], pool[:, 1, 1]
    assert not k_nc.is_contiguous()
    for mode in ("full", "selected"):
        res = select_topk(q_nc, k_nc, v_nc, *inp.args()[3:], output_mode=mode)
        check_selection(res, reference(inp, mode), inp, mode)


@needs_avx512
def test_portable_equals_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    inp = make_inputs(11, [700, 333, 64], [35, 17, 64], n_q=4)
    out = {}
    for isa in ("avx512", "avx512bf16", "portable"):
        monkeypatch.setenv("HERALD_SELECTION_ISA", isa)
        out[isa] = select_topk(*inp.args(), output_mode="full", return_importance=True)
    ref = reference(inp, "full")
    for isa in ("avx512", "avx512bf16"):
        check_selection(out[isa], ref, inp, "full")
        assert rel_err(out[isa].attn_output, out["portable"].attn_output) < 5e-3
        assert torch.allclose(out[isa].importance, out["portable"].importance, rtol=1e-4, atol=1e-7)  # type: ignore[arg-type]


@needs_native
def test_torch_fallback_equals_native(monkeypatch: pytest.MonkeyPatch) -> None:
    inp = make_inputs(12, [257, 64], [30, 64], n_q=2)
    for mode in ("full", "selected"):
        monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
        nat = select_topk(*inp.args(), output_mode=mode, return_importance=True)
        monkeypatch.setenv("HERALD_SELECTION_BACKEND", "torch")
        tor = select_topk(*inp.args(), output_mode=mode, return_importance=True)
        check_selection(nat, reference(inp, mode), inp, mode)
        check_selection(tor, reference(inp, mode), inp, mode)
        assert rel_err(nat.attn_output, tor.attn_output) < 5e-3


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
@pytest.mark.parametrize("where", ["k_nan", "k_inf", "q_nan", "q_inf"])
def test_nonfinite_raises(backend: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(13, [100, 50], [10, 10])
    bad = float("nan") if where.endswith("nan") else float("inf")
    if where.startswith("k"):
        inp.k_pages[int(inp.page_table[1, 1]), 1, 3, 7] = bad  # request 1, KV head 1, position 35
    else:
        inp.q[1, 0, 5, 0] = bad  # query head 5 -> KV head 1
    with pytest.raises(NonFiniteScoreError, match="request 1, KV head 1"):
        select_topk(*inp.args())


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_garbage_past_seq_len_is_ignored(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(14, [40], [8], page_size=32)
    ref = reference(inp, "full")
    inp.k_pages[int(inp.page_table[0, 1]), :, 8:] = float("nan")  # slots past S = 40
    inp.v_pages[int(inp.page_table[0, 1]), :, 8:] = float("inf")
    check_selection(select_topk(*inp.args()), ref, inp, "full")


@needs_native
def test_concurrent_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    inps = [make_inputs(20 + i, [300, 100], [20, 20], n_q=2) for i in range(4)]
    refs = [reference(inp, "full") for inp in inps]
    results: dict[int, object] = {}

    def work(i: int) -> None:
        results[i] = select_topk(*inps[i].args(), num_threads=1 + i % 3)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        check_selection(results[i], refs[i], inps[i], "full")  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_gather_layout(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(15, [300, 64, 10], [25, 64, 20], n_q=1)
    res = select_topk(*inp.args(), output_mode="selected")
    n_req, hkv, k_max = res.indices.shape
    out = torch.full((2, n_req, hkv, k_max, 128), 7.0, dtype=torch.bfloat16)
    got = gather_selected(
        inp.k_pages, inp.v_pages, inp.page_table, res.indices, res.num_selected, out, num_threads=3
    )
    assert got.data_ptr() == out.data_ptr()
    p = inp.k_pages.shape[2]
    for r in range(n_req):
        ns = int(res.num_selected[r])
        for h in range(hkv):
            for j, pos in enumerate(res.indices[r, h, :ns].tolist()):
                page = int(inp.page_table[r, pos // p])
                assert torch.equal(out[0, r, h, j], inp.k_pages[page, h, pos % p])
                assert torch.equal(out[1, r, h, j], inp.v_pages[page, h, pos % p])
            assert bool((out[:, r, h, ns:] == 7.0).all()), "rows past num_selected untouched"
    fresh = gather_selected(inp.k_pages, inp.v_pages, inp.page_table, res.indices, res.num_selected)
    ref = gather_selected_torch(
        inp.k_pages, inp.v_pages, inp.page_table, res.indices, res.num_selected, out.clone()
    )
    for r in range(n_req):
        ns = int(res.num_selected[r])
        assert torch.equal(fresh[:, r, :, :ns], ref[:, r, :, :ns])


@pytest.mark.parametrize("backend", [pytest.param("native", marks=needs_native), "torch"])
def test_bad_arguments(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", backend)
    inp = make_inputs(16, [100, 50], [10, 10])
    q, k, v, pt, sl, bt = inp.args()
    cases: list[tuple[type[Exception], str, tuple[object, ...], dict[str, object]]] = [
        (TypeError, "q must be torch.bfloat16", (q.float(), k, v, pt, sl, bt), {}),
        (ValueError, "q must be", (q[0], k, v, pt, sl, bt), {}),
        (TypeError, "q must be a torch.Tensor", ([1], k, v, pt, sl, bt), {}),
        (ValueError, "head_dim", (q[..., :64], k, v, pt, sl, bt), {}),
        (ValueError, "not a multiple of num_kv_heads", (q[:, :, :7], k, v, pt, sl, bt), {}),
        (ValueError, "v_pages shape", (q, k, v[:-1], pt, sl, bt), {}),
        (ValueError, "contiguous", (q, k.transpose(2, 3), v.transpose(2, 3), pt, sl, bt), {}),
        (TypeError, "page_table must be torch.int32", (q, k, v, pt.long(), sl, bt), {}),
        (ValueError, "seq_lens shape", (q, k, v, pt, sl[:1], bt), {}),
        (
            ValueError,
            r"seq_lens\[1\] = 5000",
            (q, k, v, pt, torch.tensor([100, 5000]).int(), bt),
            {},
        ),
        (ValueError, r"seq_lens\[0\] = 0", (q, k, v, pt, torch.tensor([0, 50]).int(), bt), {}),
        (ValueError, r"budget_tokens\[1\] = 0", (q, k, v, pt, sl, torch.tensor([3, 0]).int()), {}),
        (ValueError, "output_mode", (q, k, v, pt, sl, bt), {"output_mode": "sparse"}),
        (ValueError, "num_threads", (q, k, v, pt, sl, bt), {"num_threads": 0}),
    ]
    for exc, match, args, kwargs in cases:
        with pytest.raises(exc, match=match):
            select_topk(*args, **kwargs)  # type: ignore[arg-type]
    bad_pt = pt.clone()
    bad_pt[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match=r"page_table\[1, 0\]"):
        select_topk(q, k, v, bad_pt, sl, bt)
    res = select_topk(*inp.args())
    with pytest.raises(ValueError, match="out must be contiguous"):
        gather_selected(
            k, v, pt, res.indices, res.num_selected, torch.empty(2, 1, 1, 1, 1).bfloat16()
        )
    bad_idx = res.indices.clone()
    bad_idx[0, 0, 0] = 10_000
    with pytest.raises(ValueError, match="indices|out of range"):
        gather_selected(k, v, pt, bad_idx, res.num_selected)
    with pytest.raises(ValueError, match="num_selected"):
        gather_selected(k, v, pt, res.indices, res.num_selected + 100)


def test_fallback_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import herald.offload.selection.cpu as sel

    monkeypatch.setattr(_kernel, "load_native", lambda: None)
    monkeypatch.setattr(_kernel, "_reason", "simulated: no compiler")
    monkeypatch.setattr(sel, "_warned", False)
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "auto")
    inp = make_inputs(17, [64], [8])
    with pytest.warns(RuntimeWarning, match="simulated: no compiler"):
        res = select_topk(*inp.args())
    check_selection(res, reference(inp, "full"), inp, "full")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        select_topk(*inp.args())  # no second warning
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    with pytest.raises(RuntimeError, match="unavailable"):
        select_topk(*inp.args())


@needs_avx512
def test_forced_isa_errors_on_bad_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    monkeypatch.setenv("HERALD_SELECTION_ISA", "avx512")
    inp = make_inputs(18, [50], [5], head_dim=40)
    with pytest.raises(ValueError, match="AVX-512"):
        select_topk(*inp.args())


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_large_score_buffer(isa: str) -> None:
    """n_q = 32 over 10K keys: the per-item score buffer (5 MiB) takes the streaming-store path."""
    inp = make_inputs(31, [10_000], [500], n_q=32, num_kv_heads=1, group=4, q_scale=1.0)
    for mode in ("full", "selected"):
        res = select_topk(*inp.args(), output_mode=mode, num_threads=2)
        check_selection(res, reference(inp, mode), inp, mode)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_selected_rows_far_from_a_heads_attention(isa: str) -> None:
    """Query head 1 attends only to position 40, the budget keeps only position 7 (head 0's
    focus): head 1's probabilities on the selected row underflow in float32, and its selected-mode
    output must still be the softmax over the selected row, i.e. V[7]."""
    inp = make_inputs(32, [64], [1], num_kv_heads=1, group=2, q_scale=0.01)
    inp.k_pages.mul_(0.01)
    e1, e2 = torch.zeros(128), torch.zeros(128)
    e1[0], e2[1] = 10.0, 10.0
    p0, p1 = int(inp.page_table[0, 0]), int(inp.page_table[0, 1])
    inp.k_pages[p0, 0, 7], inp.k_pages[p1, 0, 8] = e1.bfloat16(), e2.bfloat16()  # pos 7, pos 40
    inp.q[0, 0, 0], inp.q[0, 0, 1] = (e1 * 21).bfloat16(), (e2 * 20).bfloat16()
    res = select_topk(*inp.args(), output_mode="selected")
    assert res.indices.tolist() == [[[7]]]
    assert torch.allclose(res.attn_output[0, 0, 1], inp.v_pages[p0, 0, 7].float())
    check_selection(res, reference(inp, "selected"), inp, "selected")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("mode", ["full", "selected"])
@pytest.mark.parametrize("page_size", [8, 32])
def test_a_request_gets_the_same_bits_whatever_its_batch_mates(
    isa: str, mode: str, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request 0's importance, indices and attention output are bitwise the same alone, next to
    mates of other lengths (which turn the whole-item schedule into tiles cut anywhere), under
    either schedule and any thread count: a batch mate cannot flip a near-tie of its top-k."""
    inp = make_inputs(21, [2600, 2600, 2600], [90, 90, 90], n_q=4, page_size=page_size)
    inp.tail_lens = torch.tensor([32, 0, 5], dtype=torch.int32)

    def run(lens: list[int], threads: int, schedule: str) -> tuple[torch.Tensor, ...]:
        monkeypatch.setenv("HERALD_SELECTION_SCHEDULE", schedule)
        sub = Inputs(inp.q[: len(lens)], inp.k_pages, inp.v_pages, inp.page_table[: len(lens)],
                     torch.tensor(lens, dtype=torch.int32), inp.budget[: len(lens)],
                     inp.tail_lens[: len(lens)])  # fmt: skip
        res = select_topk(*sub.args(), tail_lens=sub.tail_lens, output_mode=mode,
                          return_importance=True, num_threads=threads)  # fmt: skip
        assert res.importance is not None
        return res.indices[0], res.importance[0, :, :2600], res.attn_output[0]

    alone = run([2600], 1, "items")
    for lens in ([2600], [2600, 2600], [2600, 100], [2600, 2600, 700], [2600, 40, 2600]):
        for threads in (1, 2, 3, 7):
            for schedule in ("auto", "items", "tiles"):
                got = run(lens, threads, schedule)
                for a, b in zip(alone, got, strict=True):
                    assert torch.equal(a, b), (lens, threads, schedule)
