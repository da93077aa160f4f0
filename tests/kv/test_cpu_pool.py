"""CpuKVPool: sizing, views, page allocator (errors, no leak, threads), page tables, KV moves."""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time

import pytest
import torch

from herald.kv.cpu_pool import CpuKVPool, CpuPoolFullError, page_copy_runs
from herald.kv.pinned import register_pinned, unregister_pinned
from herald.offload.selection.cpu import select_topk

L, HKV, D, P = 3, 2, 8, 4  # pool layers, KV heads, head_dim, page_size (= block size)


def make_pool(num_pages: int = 10) -> CpuKVPool:
    return CpuKVPool(L, HKV, D, P, num_pages, pin=False)


def rand_block(n: int = P) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(HKV, n, D).bfloat16(), torch.randn(HKV, n, D).bfloat16()


def test_sizing_and_describe() -> None:
    pool = make_pool(10)
    assert pool.bytes_per_page == L * 2 * HKV * P * D * 2
    assert pool.nbytes == 10 * pool.bytes_per_page == pool.storage.nbytes
    assert pool.storage.shape == (L, 2, 10, HKV, P, D) and pool.storage.dtype == torch.bfloat16
    assert pool.capacity_tokens == 40 and pool.num_free_pages == 10 and pool.num_used_pages == 0
    assert pool.pages_for_tokens(9) == 3 and pool.pages_for_tokens(8) == 2
    gib = 25 * pool.bytes_per_page / 2**30 + 1e-12
    assert CpuKVPool.from_gib(gib, L, HKV, D, P, pin=False).num_pages == 25
    assert CpuKVPool.from_tokens(41, L, HKV, D, P, pin=False).num_pages == 11
    line = pool.describe()
    assert "40 tokens" in line and "pin 0.00 s" in line and "\n" not in line
    mib = pool.nbytes / 2**20  # a small pool in MiB, not "0.00 GiB"
    assert line.startswith(f"CPU KV pool: {mib:.1f} MiB not pinned"), line
    from herald.kv.cpu_pool import _size

    assert _size(3 * 2**30) == "3.00 GiB" and _size(2**20) == "1.0 MiB"
    with pytest.raises(ValueError, match="num_pages"):
        CpuKVPool(L, HKV, D, P, 0)
    with pytest.raises(ValueError, match="holds no page"):
        CpuKVPool.from_gib(1e-9, L, HKV, D, P)


def test_views_share_memory_and_match_kernel_layout() -> None:
    pool = make_pool()
    for layer in range(L):
        k, v = pool.k_pages(layer), pool.v_pages(layer)
        assert k.shape == v.shape == (10, HKV, P, D)
        assert k.data_ptr() == pool.storage[layer, 0].data_ptr()
        assert v.data_ptr() == pool.storage[layer, 1].data_ptr()
        assert k.stride() == v.stride() and k[0, 0].is_contiguous()
        x = torch.randn(P, D).bfloat16()
        k[3, 1] = x
        assert torch.equal(pool.storage[layer, 0, 3, 1], x)
    with pytest.raises(IndexError):
        pool.k_pages(L)


def test_allocate_extend_free_and_errors() -> None:
    pool = make_pool(10)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) == [3, 4] and "b" in pool and "z" not in pool
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a", 1)
    with pytest.raises(ValueError):
        pool.allocate("c", 0)
    assert pool.can_allocate(5) and not pool.can_allocate(6)
    with pytest.raises(CpuPoolFullError, match="needs 6 free page") as err:
        pool.allocate("c", 6)
    assert (err.value.needed, err.value.free) == (6, 5)
    assert "c" not in pool and pool.num_free_pages == 5  # nothing changed
    assert pool.extend("a", 2) == [5, 6] and pool.pages("a") == [0, 1, 2, 5, 6]
    with pytest.raises(CpuPoolFullError):
        pool.extend("a", 4)
    assert pool.pages("a") == [0, 1, 2, 5, 6] and pool.num_free_pages == 3
    assert pool.extend("a", 0) == []
    with pytest.raises(KeyError, match="holds no CPU KV pages"):
        pool.extend("zz", 1)
    pool.free("a")
    with pytest.raises(KeyError, match="holds no CPU KV pages"):
        pool.free("a")
    assert pool.num_used_pages == 2
    pool.free("b")
    assert pool.num_used_pages == 0 and pool.num_free_pages == 10
    assert sorted(pool.allocate("d", 10)) == list(range(10))  # every page came back
    pool.free("d")
    assert pool.num_used_pages == 0


def test_page_table_layout_and_padding() -> None:
    pool = make_pool(10)
    pool.allocate("a", 1)
    pool.allocate("b", 3)
    pool.extend("a", 2)  # a: [0, 4, 5], b: [1, 2, 3]
    pool.allocate("c", 1)  # c: [6]
    pt = pool.page_table(["c", "a", "b"])
    assert pt.dtype == torch.int32 and pt.device.type == "cpu"
    assert pt.tolist() == [[6, 6, 6], [0, 4, 5], [1, 2, 3]]
    assert pool.page_table(["a"], max_pages=5).tolist() == [[0, 4, 5, 0, 0]]
    with pytest.raises(ValueError, match="max_pages"):
        pool.page_table(["a"], max_pages=2)
    with pytest.raises(KeyError):
        pool.page_table(["a", "nope"])


def test_write_read_round_trip_across_pages() -> None:
    pool = make_pool(12)
    pool.allocate("a", 1)
    pool.allocate("b", 2)
    pool.extend("a", 2)  # a's pages are not contiguous: [0, 3, 4]
    ref: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(L):
        for rid, nblocks in (("a", 3), ("b", 2)):
            blocks = [rand_block() for _ in range(nblocks)]
            for i, (k, v) in enumerate(blocks):
                pool.write_block(layer, rid, i, k, v)
            ref[layer, rid] = (
                torch.cat([b[0] for b in blocks], 1),
                torch.cat([b[1] for b in blocks], 1),
            )
    for (layer, rid), (k_ref, v_ref) in ref.items():
        for start, end in ((0, 4), (2, 9), (0, k_ref.shape[1]), (5, 5)):
            if end > k_ref.shape[1]:
                continue
            k, v = pool.read_tokens(layer, rid, start, end)
            assert k.shape == (HKV, end - start, D) and k.is_contiguous()
            assert torch.equal(k, k_ref[:, start:end]) and torch.equal(v, v_ref[:, start:end])
    # a partial last block lands in slots [0, n) and leaves the rest untouched
    k, v = rand_block(3)
    pool.write_block(0, "a", 2, k, v)
    got_k, got_v = pool.read_tokens(0, "a", 8, 12)
    assert torch.equal(got_k[:, :3], k) and torch.equal(got_v[:, :3], v)
    assert torch.equal(got_k[:, 3], ref[0, "a"][0][:, 11])


def fill_pages(pool: CpuKVPool, rid: str, nblocks: int) -> None:
    for layer in range(L):
        for i in range(nblocks):
            pool.write_block(layer, rid, i, *rand_block())


def test_copy_pages_equals_the_request_rows() -> None:
    pool = make_pool(12)
    pool.allocate("a", 2)
    pool.allocate("b", 1)
    pool.extend("a", 2)  # a's pages: [0, 1, 3, 4], two runs
    fill_pages(pool, "a", 4)
    ids = pool.pages("a")
    for layer in range(L):
        out = torch.empty(2, len(ids), HKV, P, D, dtype=torch.bfloat16)
        for kv in (0, 1):
            view = out[kv]
            assert pool.copy_pages(layer, kv, ids, view) is view
        k, v = pool.read_tokens(layer, "a", 0, 4 * P)
        rows = out.transpose(1, 2).reshape(2, HKV, 4 * P, D)
        assert torch.equal(rows[0], k) and torch.equal(rows[1], v)
    # a prefix of the pages, and no pages at all
    out = torch.empty(3, HKV, P, D, dtype=torch.bfloat16)
    pool.copy_pages(1, 1, ids[:3], out)
    assert torch.equal(out[2], pool.v_pages(1)[3])
    assert pool.copy_pages(0, 0, [], torch.empty(0, HKV, P, D, dtype=torch.bfloat16)).numel() == 0


def test_copy_pages_errors() -> None:
    pool = make_pool(4)
    out = torch.empty(2, HKV, P, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv must be"):
        pool.copy_pages(0, 2, [0, 1], out)
    with pytest.raises(ValueError, match="shape"):
        pool.copy_pages(0, 0, [0], out)
    with pytest.raises(ValueError, match="contiguous"):
        pool.copy_pages(0, 0, [0, 1], out.float())
    with pytest.raises(ValueError, match="contiguous"):
        pool.copy_pages(0, 0, [0, 1], out.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(IndexError, match="page id 4"):
        pool.copy_pages(0, 0, [3, 4], out)
    with pytest.raises(IndexError):
        pool.copy_pages(L, 0, [0, 1], out)
    with pytest.raises(ValueError, match="non-contiguous"):
        pool.copy_pages(0, 0, [1], torch.empty(1, P, HKV, D, dtype=torch.bfloat16).transpose(1, 2))
    for bad_kv in (True, False, 1.0):
        with pytest.raises(ValueError, match="kv must be"):
            pool.copy_pages(0, bad_kv, [0, 1], out)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layer must be"):
        pool.copy_pages(1.0, 0, [0, 1], out)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="page ids must be integers"):
        pool.copy_pages(0, 0, [0, 1.0], out)  # type: ignore[list-item]


def test_page_copy_runs_split_at_gaps_and_registrations() -> None:
    assert page_copy_runs([0, 1, 2, 3, 7, 8, 5], 10, []) == [
        (0, 0, 4, ()), (4, 7, 2, ()), (6, 5, 1, ()),
    ]  # fmt: skip
    # a registration boundary at a page start splits the run there
    assert page_copy_runs([0, 1, 2, 3, 4, 5], 10, [30]) == [(0, 0, 3, ()), (3, 3, 3, ())]
    # inside a page: that page alone, with the cuts' offsets within it
    assert page_copy_runs([0, 1, 2, 3, 4, 5], 10, [25, 50, 22]) == [
        (0, 0, 2, ()), (2, 2, 1, (2, 5)), (3, 3, 2, ()), (5, 5, 1, ()),
    ]  # fmt: skip
    # boundaries outside the pages asked for (or at the first one's start) change nothing
    assert page_copy_runs([3, 4, 5], 10, [25, 30, 60, 70]) == [(0, 3, 3, ())]
    assert page_copy_runs([2], 10, [25]) == [(0, 2, 1, (5,))]
    assert page_copy_runs([], 10, [25]) == []
    with pytest.raises(ValueError):
        page_copy_runs([0], 0, [])


def test_page_copy_runs_random_cover_and_never_span_a_boundary() -> None:
    rng = random.Random(0)
    for _ in range(300):
        pb = rng.choice([4, 6, 10])
        ids = [rng.randrange(12) for _ in range(rng.randrange(10))]
        if rng.random() < 0.5:
            ids = sorted(set(ids))
        cuts = [rng.randrange(1, 12 * pb) for _ in range(rng.randrange(4))]
        runs = page_copy_runs(ids, pb, cuts)
        got: list[int] = []
        for j, first, count, inner in runs:
            assert got == ids[:j] and ids[j : j + count] == list(range(first, first + count))
            got += ids[j : j + count]
            lo, hi = first * pb, (first + count) * pb
            inside = sorted({c - lo for c in cuts if lo < c < hi})
            assert list(inner) == inside and (not inner or count == 1)
        assert got == ids


def test_copy_pages_across_a_registration_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool cut by registrations (faked): one inside a page, one at a page start."""
    pool = make_pool(8)
    pool.allocate("a", 8)
    fill_pages(pool, "a", 8)
    src = pool.v_pages(2)
    page_bytes = src[0].nbytes
    cuts = [src.data_ptr() + 2 * page_bytes + 64, src.data_ptr() + 5 * page_bytes]
    copies: list[int] = []
    real_copy = torch.Tensor.copy_

    def spy(self: torch.Tensor, other: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(other.shape[0])
        return real_copy(self, other, non_blocking)

    monkeypatch.setattr(pool, "_registered", [pool.storage.data_ptr() - 64, *cuts])
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    out = torch.empty(8, HKV, P, D, dtype=torch.bfloat16)
    pool.copy_pages(2, 1, list(range(8)), out)
    monkeypatch.undo()
    # pages [0, 2); page 2 in two pieces (of elements); [3, 5); [5, 8)
    assert copies == [2, 32, HKV * P * D - 32, 2, 3]
    assert torch.equal(out, src)


def test_write_read_errors() -> None:
    pool = make_pool(4)
    pool.allocate("a", 2)
    k, v = rand_block()
    with pytest.raises(IndexError, match="holds 2 pages"):
        pool.write_block(0, "a", 2, k, v)
    with pytest.raises(KeyError):
        pool.write_block(0, "x", 0, k, v)
    with pytest.raises(ValueError, match="must be"):
        pool.write_block(0, "a", 0, torch.randn(HKV, P + 1, D).bfloat16(), v)
    with pytest.raises(ValueError, match="must be"):
        pool.write_block(0, "a", 0, k, v[:, :2])
    with pytest.raises(TypeError, match="bfloat16"):
        pool.write_block(0, "a", 0, k.float(), v.float())
    with pytest.raises(IndexError, match="outside"):
        pool.read_tokens(0, "a", 0, 2 * P + 1)


def test_selection_kernel_reads_the_pool() -> None:
    """Exact attention from select_topk over the pool's views equals attention over read_tokens."""
    pool = make_pool(12)
    pool.allocate("a", 1)
    pool.allocate("b", 3)
    pool.extend("a", 2)
    seq = {"a": 10, "b": 12}
    for rid, s in seq.items():
        for i in range(pool.pages_for_tokens(s)):
            pool.write_block(1, rid, i, *rand_block())
    q = torch.randn(2, 1, 2 * HKV, D).bfloat16()
    res = select_topk(
        q, pool.k_pages(1), pool.v_pages(1), pool.page_table(["a", "b"]),
        torch.tensor([10, 12], dtype=torch.int32), torch.tensor([100, 100], dtype=torch.int32),
    )  # fmt: skip
    for r, (rid, s) in enumerate(seq.items()):
        k, v = pool.read_tokens(1, rid, 0, s)
        kf, vf = k.float().repeat_interleave(2, 0), v.float().repeat_interleave(2, 0)
        qf = q[r, 0].float()  # [H, D]
        p = torch.softmax(torch.einsum("hd,hsd->hs", qf, kf) * D**-0.5, -1)
        torch.testing.assert_close(res.attn_output[r, 0], torch.einsum("hs,hsd->hd", p, vf))


def test_concurrent_allocate_free_with_reader() -> None:
    pool = make_pool(64)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(tag: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(2000):
                rid = f"{tag}{i % 5}"
                if rid in pool:
                    pool.free(rid)
                else:
                    try:
                        pool.allocate(rid, rng.randint(1, 8))
                        pool.extend(rid, rng.randint(0, 3))
                    except CpuPoolFullError:
                        pass
        except BaseException as e:  # surfaced below
            errors.append(e)

    def reader() -> None:
        try:
            while not stop.is_set():
                with pool._lock:  # a consistent snapshot: no page owned twice, none lost
                    owned = [p for ids in pool._pages.values() for p in ids]
                    assert len(set(owned)) == len(owned)
                    assert sorted(owned + pool._free) == list(range(64))
                for rid in ("x0", "y1"):
                    with contextlib.suppress(KeyError):
                        pt = pool.page_table([rid])
                        assert ((pt >= 0) & (pt < 64)).all()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t, s)) for t, s in (("x", 1), ("y", 2))]
    rd = threading.Thread(target=reader)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often so the operations really interleave
    try:
        rd.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        rd.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    for rid in [r for t in "xy" for r in (f"{t}{i}" for i in range(5)) if r in pool]:
        pool.free(rid)
    assert pool.num_used_pages == 0 and sorted(pool._free) == list(range(64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_no_cuda_means_no_pinning() -> None:
    pool = CpuKVPool(L, HKV, D, P, 4)  # pin=None: auto
    assert not pool.pinned and pool.pin_seconds == 0.0 and "not pinned" in pool.describe()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CpuKVPool(L, HKV, D, P, 4, pin=True)


def test_close_and_context_manager() -> None:
    with make_pool(4) as pool:
        view = pool.k_pages(0)
    with pytest.raises(RuntimeError, match="closed"):
        pool.k_pages(0)
    assert view.sum().item() == 0  # views stay valid (zero-filled at start-up)
    pool.close()  # idempotent


@pytest.mark.gpu
def test_gpu_pinned_2gib_pool() -> None:
    """2 GiB pinned via cudaHostRegister: pinned, fast H2D, CUDA write_block, unregister once."""
    hkv, d, page, layers = 4, 128, 32, 16
    pool = CpuKVPool.from_gib(2.0, layers, hkv, d, page, pin=True)
    assert pool.pinned and pool.storage.is_pinned() and pool.pin_seconds > 0
    print(pool.describe())
    src = pool.storage.view(-1)[: 1 << 29]  # 1 GiB of bf16
    src.copy_(torch.randn(1 << 20).bfloat16().repeat(512))
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    gbs = src.nbytes / (time.perf_counter() - t0) / 1e9
    print(f"H2D from the pinned pool: {gbs:.1f} GB/s")
    assert torch.equal(dst.cpu(), src) and gbs > 15  # pageable is ~7 GB/s on an H200 host
    pool.allocate("r", 2)
    k = torch.randn(hkv, page, d, device="cuda").bfloat16()
    v = torch.randn(hkv, page, d, device="cuda").bfloat16()
    pool.write_block(layers - 1, "r", 1, k, v)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # the fence a reader would wait on
    got_k, got_v = pool.read_tokens(layers - 1, "r", page, 2 * page)
    assert torch.equal(got_k, k.cpu()) and torch.equal(got_v, v.cpu())
    # whole pages straight to the device (MAGE's full fetch): DMA from the pinned pool
    out = torch.empty(2, 2, hkv, page, d, device="cuda", dtype=torch.bfloat16)
    for kv in (0, 1):
        pool.copy_pages(layers - 1, kv, pool.pages("r"), out[kv])
    torch.cuda.synchronize()
    assert torch.equal(out[0, 1], k) and torch.equal(out[1, 1], v)
    pool.free("r")
    view = pool.k_pages(0)
    pool.close()
    assert not pool.pinned and not view.is_pinned()
    pool.close()


@pytest.mark.gpu
def test_gpu_copy_pages_across_real_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations of 20 KiB cut the pool inside pages (6 KiB each) and at page starts: the
    driver takes every piece as an async copy, and the pages arrive whole."""
    import functools

    import herald.kv.cpu_pool as cpu_pool_module

    small = functools.partial(register_pinned, chunk_bytes=5 * 4096)
    monkeypatch.setattr(cpu_pool_module, "register_pinned", small)
    pool = CpuKVPool(2, 2, 384, 4, 64, pin=True)  # page of one layer: 2 * 4 * 384 * 2 bytes
    assert len(pool._registered) > 10
    pool.storage.copy_(torch.randn(pool.storage.shape).bfloat16())
    ids = [*range(40, 64), *range(0, 30)]
    out = torch.empty(2, len(ids), 2, 4, 384, device="cuda", dtype=torch.bfloat16)
    for kv in (0, 1):
        pool.copy_pages(1, kv, ids, out[kv])
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), pool.storage[1][:, ids])
    pool.close()


class FakeCudart:
    """Records cudaHostRegister/Unregister calls; fails the register call number ``fail_at``."""

    def __init__(self, fail_at: int = -1) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.fail_at = fail_at

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_register_chunks_cover_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    t = torch.empty(100_003, dtype=torch.uint8)
    chunk = 4 * 4096
    addrs = register_pinned(t, chunk_bytes=chunk)
    assert addrs == [p for p, _ in fake.registered]
    pos = t.data_ptr()
    base = -(-pos // 4096) * 4096
    for i, (ptr, size) in enumerate(fake.registered):
        assert ptr == pos and 0 < size < chunk + 4096
        # inner boundaries page-aligned, chunk_bytes apart: no OS page twice
        assert i == 0 or (ptr % 4096 == 0 and (ptr - base) % chunk == 0)
        pos += size
    assert pos == t.data_ptr() + t.numel()
    unregister_pinned(addrs)
    assert fake.unregistered == [p for p, _ in fake.registered] and addrs == []


def test_register_failure_unregisters_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(fail_at=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(RuntimeError, match="cudaHostRegister .* CUDA error 2"):
        register_pinned(torch.empty(100_000, dtype=torch.uint8), chunk_bytes=4 * 4096)
    assert fake.unregistered == [p for p, _ in fake.registered] and len(fake.registered) == 2


def test_pool_pin_path_unregisters_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin=True path with a fake CUDA runtime: registered at start, unregistered once."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    pool = CpuKVPool(L, HKV, D, P, 8, pin=True)
    assert pool.pinned and len(fake.registered) == 1 and "pinned in 1 chunk" in pool.describe()
    # From the allocation's base (torch's is_pinned checks it) to the pool's end.
    start, size = fake.registered[0]
    assert start == pool.storage.untyped_storage().data_ptr() <= pool.storage.data_ptr()
    assert start + size == pool.storage.data_ptr() + pool.nbytes
    pool.close()
    pool.close()
    del pool
    assert len(fake.unregistered) == 1


def test_register_chunks_split_only_page_aligned_and_keep_small_buffers_whole():
    from herald.kv.pinned import register_chunks

    gib = 1 << 30
    # A small buffer straddling a 16 GiB-aligned address is one registration.
    start = 16 * gib - 1000
    assert register_chunks(start, start + 100 * 2**20, 16 * gib) == [(start, start + 100 * 2**20)]
    # A large one splits at align_up(start) + i * chunk: page-aligned, contiguous, covering.
    start = 12345 * 64
    chunks = register_chunks(start, start + 40 * gib, 16 * gib)
    assert chunks[0][0] == start and chunks[-1][1] == start + 40 * gib
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    base = -(-start // 4096) * 4096
    assert [c[1] for c in chunks[:-1]] == [base + 16 * gib, base + 32 * gib]


def test_pool_storage_is_page_aligned():
    pool = CpuKVPool(2, HKV, D, P, 8, pin=False)
    assert pool.storage.data_ptr() % 4096 == 0
    assert pool.storage.is_contiguous() and float(pool.storage.abs().sum()) == 0.0


def test_pinned_staging_views_are_zeroed_and_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    from herald.kv.pinned import PinnedStaging

    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    st = PinnedStaging(2 * 3 * 4, torch.bfloat16, pin=True)
    assert len(fake.registered) == 1  # one buffer, one registration
    view = st.take((2, 3, 4))
    assert view.shape == (2, 3, 4) and view.data_ptr() == st.buf.data_ptr()
    assert float(view.abs().sum()) == 0.0
    with pytest.raises(RuntimeError):
        st.take((5, 5))  # more than the buffer holds
    st.close()
    st.close()  # idempotent
    assert fake.unregistered == [p for p, _ in fake.registered]
