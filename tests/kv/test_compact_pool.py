"""The CPU pool's int8 copy of K (first_pass="int8"): sized into the pool, written wherever K is
written (prefill, draft and commit hand-offs, write_block), and the engine with it on."""

from __future__ import annotations

import pytest
import torch

from herald.config import OffloadConfig
from herald.kv.compact_keys import CompactKeys, compact_bytes_per_page, quantize_keys
from herald.kv.cpu_pool import CpuKVPool
from herald.offload.handoff import BlockHandoff
from herald.offload.selection.compact_cpu import compact_args, update_compact

DIMS = (3, 2, 64, 8)  # layers, KV heads, head_dim, page size


def _assert_in_sync(pool: CpuKVPool, pages: list[int]) -> None:
    assert pool.compact is not None
    idx = torch.tensor(pages)
    q8, s = quantize_keys(pool.storage[:, 0, idx])
    assert torch.equal(pool.compact.q8[:, idx], q8) and torch.equal(pool.compact.scales[:, idx], s)


def test_the_int8_copy_counts_in_the_pool_size() -> None:
    plain = CpuKVPool.from_gib(0.001, *DIMS, pin=False)
    both = CpuKVPool.from_gib(0.001, *DIMS, pin=False, first_pass="int8")
    layers, hkv, d, p = DIMS
    kv = layers * 2 * hkv * p * d * 2
    extra = compact_bytes_per_page(layers, hkv, p, d)
    assert plain.compact is None and both.compact is not None
    assert plain.bytes_per_page == kv and both.bytes_per_page == kv + extra
    assert both.num_pages == int(0.001 * 2**30) // (kv + extra) < plain.num_pages
    assert both.nbytes == both.num_pages * (kv + extra) <= 0.001 * 2**30
    assert "int8 K" in both.describe() and "int8 K" not in plain.describe()
    assert compact_args(plain, 0) == {} and set(compact_args(both, 1)) == {
        "k8_pages",
        "scale_pages",
    }
    with pytest.raises(ValueError, match="first_pass"):
        CpuKVPool(*DIMS, 4, pin=False, first_pass="int4")


def test_handoff_and_write_block_keep_the_copy_in_sync() -> None:
    pool = CpuKVPool(*DIMS, 10, pin=False, first_pass="int8")
    layers, hkv, d, p = DIMS
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn(layers, 2, 3, hkv, p, d, generator=g).bfloat16()
    BlockHandoff(pool, 3, cuda=False, num_threads=2).to_cpu(blocks, [7, 2, 5])
    _assert_in_sync(pool, [7, 2, 5])
    assert bool((pool.compact.q8[:, [0, 1, 3]] == 0).all())  # type: ignore[union-attr]
    pool.allocate("r", 2)
    k = torch.randn(hkv, 5, d, generator=g).bfloat16()
    pool.write_block(1, "r", 1, k, torch.zeros_like(k))
    _assert_in_sync(pool, pool.pages("r"))
    pool.storage[:, 0, 4] = torch.randn(layers, hkv, p, d, generator=g).bfloat16()
    update_compact(pool, [4], num_threads=2)  # the prefill's hook
    _assert_in_sync(pool, [4])


def test_compact_keys_views() -> None:
    c = CompactKeys(2, 5, 3, 4, 16)
    assert c.k8_pages(1).shape == (5, 3, 4, 16) and c.scale_pages(1).shape == (5, 3, 4)
    assert c.nbytes == 2 * 5 * 3 * 4 * (16 + 4)


def test_offload_config_first_pass() -> None:
    assert OffloadConfig().first_pass == "none"
    OffloadConfig.for_mode("herald", first_pass="int8")
    with pytest.raises(ValueError, match="first_pass"):
        OffloadConfig.for_mode("herald", first_pass="fp8")
    for mode in ("mage", "infinigen"):
        with pytest.raises(ValueError, match="representative"):
            OffloadConfig.for_mode(mode, first_pass="int8")
    with pytest.raises(ValueError, match="representative"):
        OffloadConfig.for_mode("herald", selection_device="gpu", first_pass="int8")
