"""Block-causal prefill chunks on the CPU in query tiles (herald.attention.sdpa.sdpa_block_causal)
against one call with the whole chunk's mask and against a float64 reference."""

from __future__ import annotations

import pytest
import torch

import herald.attention.sdpa as sdpa_mod
from herald.attention.masks import block_causal_chunk_mask
from herald.attention.sdpa import sdpa_block_causal, sdpa_gqa


@pytest.mark.parametrize(
    "start,length,tile",
    [(0, 64, 16), (32, 80, 16), (48, 40, 32), (16, 128, 512), (0, 8, 16)],
)
def test_tiles_equal_one_masked_call(
    monkeypatch: pytest.MonkeyPatch, start: int, length: int, tile: int
) -> None:
    """Tiles of whole blocks, a last tile and a last block cut short (80 = 5 tiles of 16, 40 =
    a tile and a partial one of 8 rows, 8 < one block), a tile larger than the chunk."""
    monkeypatch.setattr(sdpa_mod, "CPU_PREFILL_TILE", tile)
    block, hq, hkv, d = 16, 8, 2, 32
    g = torch.Generator().manual_seed(start + length)
    q = torch.randn(1, length, hq, d, generator=g)
    keys = torch.randn(1, hkv, start + length, d, generator=g)
    values = torch.randn(1, hkv, start + length, d, generator=g)
    out = sdpa_block_causal(q, keys, values, start, block)
    mask = block_causal_chunk_mask(start, length, block, start + length, q.device)
    one = sdpa_gqa(q, keys, values, mask)
    assert out.shape == one.shape
    assert (out - one).abs().max().item() < 1e-5
    ref = sdpa_gqa(q.double(), keys.double(), values.double(), mask)
    assert (out.double() - ref).abs().max().item() < 1e-5
