"""A step that fails fails the requests it ran and frees their KV, wherever it failed: in a
prompt's prefill forward or in its join (an offloading engine's join runs the first block's
selection forward on the GPU, where a long prompt can run out of memory). The engine goes on
with the next requests."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from herald.config import OffloadConfig, SamplingParams
from herald.engine.request import RequestStatus
from herald.models.registry import build_model, get_preset

PARAMS = SamplingParams(max_new_tokens=32, num_denoise_steps=4, ignore_eos=True)


@pytest.mark.parametrize("where", ["_prefill", "_join"])
@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_a_failed_prefill_or_join_frees_the_request_and_the_engine_goes_on(
    mode: str, where: str
) -> None:
    config = get_preset("tiny-sdar")
    dtype = torch.float32 if mode == "dense" else torch.bfloat16
    model = build_model(config, device="cpu", dtype=dtype, seed=1)
    offload = None if mode == "dense" else OffloadConfig.for_mode(mode, kv_budget=0.3)
    eng = make_engine(model, config, offload, max_batch_size=2, max_seq_len=256)
    real, calls = getattr(eng, where), [0]

    def failing(chunk):
        calls[0] += 1
        if calls[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(chunk)

    setattr(eng, where, failing)
    first = eng.add_request([1, 2, 3] * 20, PARAMS)
    second = eng.add_request([7, 8, 9] * 15, PARAMS)  # admitted at the same boundary
    with pytest.raises(torch.OutOfMemoryError):
        eng.step()
    assert first.status == second.status == RequestStatus.FINISHED_ERROR
    assert isinstance(first.error, torch.OutOfMemoryError)
    usage = eng.usage()
    assert usage.gpu_slots_used == 0 and usage.cpu_pages_used == 0, usage
    assert not eng.has_unfinished() and eng.num_running == 0
    # the engine serves on: a request after the failure runs to its end
    again = eng.generate([[4, 5, 6] * 10], PARAMS)[0]
    assert again.status == RequestStatus.FINISHED_LENGTH and len(again.output_ids) == 32
