"""The offloading engine with the compact first pass (first_pass="int8"): the retrieval job's
top-k equals the exact reference on the same query and KV, and the int8 copy of K follows every
write of K into the CPU pool (budget 1.0 equals dense: test_offload.py's MODES)."""

from __future__ import annotations

import pytest
import torch
from helpers import recorded_engine

import herald.offload.retrieval as retrieval
from herald.config import OffloadConfig
from herald.kv.compact_keys import quantize_keys
from herald.models.registry import build_model, get_preset
from herald.offload.selection import compact_cpu
from herald.offload.selection.ref import select_topk_torch


@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2"])
def test_compact_selection_equals_the_reference_and_the_copy_stays_in_sync(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = get_preset(preset)
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (100, 40)]
    stats: list[compact_cpu.compact.CompactStats] = []
    real = compact_cpu.select_topk_compact

    def spy(*args: object, **kw: object):  # the engine's calls, with their stats kept
        return real(*args, **kw, stats_out=stats)  # type: ignore[arg-type]

    monkeypatch.setattr(retrieval, "select_topk_compact", spy)
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.25, selection_threads=2, first_pass="int8")
    eng, recorder = recorded_engine(model, config, cfg, prompts)
    pool, b = eng.cpu_pool, config.block_size
    checked, seen, synced = 0, set(), 0
    while eng.has_unfinished():
        eng.step()
        for req in eng.batch.requests:  # every page a running request holds
            idx = torch.tensor(pool.pages(req.request_id))
            q8, s = quantize_keys(pool.storage[:, 0, idx])
            assert torch.equal(pool.compact.q8[:, idx], q8)  # type: ignore[union-attr]
            assert torch.equal(pool.compact.scales[:, idx], s)  # type: ignore[union-attr]
            synced += 1
        for job in recorder.jobs:
            if id(job) in seen or not job.done.is_set():
                continue
            seen.add(id(job))
            n = len(job.request_ids)
            seq = torch.tensor([p + b for p in job.prefix_lens], dtype=torch.int32)
            tails = torch.full((n,), b, dtype=torch.int32)
            budgets = torch.tensor([max(x, 1) for x in job.budgets], dtype=torch.int32)
            for layer, (q, idx) in job.recorded.items():
                pl = layer - eng.num_dense
                ref = select_topk_torch(
                    q, pool.k_pages(pl), pool.v_pages(pl), job.page_table, seq, budgets,
                    tail_lens=tails,
                )  # fmt: skip
                assert torch.equal(ref.indices, idx), (layer, job.prefix_lens)
                checked += 1
    eng.close()
    assert checked >= 4 and synced >= 4 and stats  # the compact path ran
