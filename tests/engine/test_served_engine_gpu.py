"""What ``herald serve`` runs is what the benchmarks run: the engine built from the server's
settings (CUDA graphs on, compiled fused kernels), stepped by the server's engine thread, gives
the tokens of the same engine stepped directly on the main thread."""

from __future__ import annotations

import asyncio

import pytest
import torch

from herald.config import OffloadConfig, SamplingParams
from herald.engines import build_engine
from herald.models.registry import build_model, get_preset
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.engine_loop import EngineLoop


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (int(x),), generator=g).tolist() for x in (70, 20, 130, 64)[:n]]


async def _serve_all(loop: EngineLoop, prompts: list[list[int]], params: SamplingParams):
    handles = [loop.submit(p, params, asyncio.get_running_loop()) for p in prompts]
    outs = []
    for h in handles:
        ids: list[int] = []
        while True:
            kind, val = await asyncio.wait_for(h.queue.get(), 120)
            if kind == "tokens":
                ids += val
            else:
                assert kind == "done", (kind, val)
                break
        outs.append(ids)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_engine_thread_with_graphs_equals_direct_generate(mode: str) -> None:
    config = get_preset("tiny-llada2")
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    offload = None if mode == "dense" else OffloadConfig.for_mode("herald", kv_budget=0.3)
    cfg = SERVE_DEFAULTS.replace(max_batch_size=4, max_seq_len=256, offload=offload)
    assert cfg.use_cuda_graph
    params = SamplingParams(max_new_tokens=96, num_denoise_steps=8, ignore_eos=True)
    prompts = _prompts(4)
    direct = build_engine(model, config, cfg)
    assert direct.runner.use_cuda_graph
    want = [r.output_ids for r in direct.generate(prompts, params)]
    direct.close()
    served = build_engine(model, config, cfg)
    loop = EngineLoop(served)
    loop.start()
    try:
        got = asyncio.run(_serve_all(loop, prompts, params))
    finally:
        loop.stop()
    assert got == want
    assert served.usage().gpu_slots_used == 0 and served.usage().cpu_pages_used == 0
