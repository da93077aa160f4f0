"""scatter_blocks (the CPU pool's block hand-off on the kernel's threads) equals index_copy_."""

from __future__ import annotations

import pytest
import torch

from herald.offload.selection import _kernel
from herald.offload.selection.cpu import scatter_blocks

NATIVE = _kernel.load_native()
BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif(NATIVE is None, reason="no native library")),
    "torch",
]
ISAS = ["auto", "portable"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", request.param)
    return str(request.param)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    ("shape", "dim", "pages"),
    [
        ((3, 2, 9, 2, 4, 64), 2, [7, 0, 3, 8]),  # the pool's layout: [L, 2, pages, Hkv, B, D]
        ((2, 11, 5, 3), 1, [10, 2, 5]),  # blocks of 30 bytes: no whole 64-byte line
        ((6, 40), 0, [5, 1]),
        ((4, 7, 33), 2, [32, 0, 16]),  # the last dim: 2-byte blocks
    ],
)
def test_equals_index_copy(
    backend: str, isa: str, shape: tuple[int, ...], dim: int, pages: list[int], monkeypatch
) -> None:
    monkeypatch.setenv("HERALD_SELECTION_ISA", isa)
    g = torch.Generator().manual_seed(len(pages) + dim)
    dst = torch.randn(shape, generator=g).bfloat16()
    src_shape = list(shape)
    src_shape[dim] = len(pages)
    src = torch.randn(src_shape, generator=g).bfloat16()
    idx = torch.tensor(pages, dtype=torch.long)
    want = dst.clone().index_copy_(dim, idx, src)
    scatter_blocks(dst, dim, idx, src, num_threads=3)
    assert torch.equal(dst, want)


def test_aligned_pool_pages_on_many_threads(backend: str) -> None:
    """Page-aligned 32 KiB blocks (the streaming-store path on AVX-512), more threads than
    blocks for some of them."""
    raw = torch.zeros(2 * 16 * 16384 + 4096, dtype=torch.bfloat16)
    off = (-raw.data_ptr() % 4096) // 2
    dst = raw[off : off + 2 * 16 * 16384].view(2, 16, 16384)
    src = torch.randn(2, 5, 16384).bfloat16()
    idx = torch.tensor([15, 3, 4, 0, 9])
    want = dst.clone().index_copy_(1, idx, src)
    for threads in (1, 4, 16):
        dst.zero_()
        want.zero_().index_copy_(1, idx, src)
        scatter_blocks(dst, 1, idx, src, num_threads=threads)
        assert torch.equal(dst, want)


@pytest.mark.skipif(NATIVE is None, reason="no native library")
def test_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    dst, src = torch.zeros(2, 4, 8).bfloat16(), torch.ones(2, 2, 8).bfloat16()
    with pytest.raises(ValueError, match="outside"):
        scatter_blocks(dst, 1, torch.tensor([0, 4]), src)
    with pytest.raises(ValueError, match="int64"):
        scatter_blocks(dst, 1, torch.tensor([0, 1], dtype=torch.int32), src)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_blocks(dst, 1, torch.tensor([0, 1]), src.float())
    with pytest.raises(ValueError, match="differ outside"):
        scatter_blocks(dst, 1, torch.tensor([0, 1]), torch.ones(3, 2, 8).bfloat16())
    with pytest.raises(TypeError, match="contiguous"):
        scatter_blocks(dst, 1, torch.tensor([0, 1]), torch.ones(2, 8, 2).bfloat16().transpose(1, 2))
    assert bool((dst == 0).all())  # nothing written by a refused call
