"""DenseEngine.abort and slot compaction when several rows leave in one step."""

from __future__ import annotations

import torch
from helpers import make_engine

from herald.config import SamplingParams
from herald.engine.request import RequestStatus
from herald.models.registry import build_model, get_preset


def _setup():
    config = get_preset("tiny-sdar")
    model = build_model(config, device="cpu", dtype=torch.float32, seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 40, 17, 70, 33)]
    return model, config, prompts


def _engine(model, config, bs):
    return make_engine(
        model, config, None, max_batch_size=bs, max_seq_len=256, prefill_chunk_tokens=64
    )


def test_abort_running_rows_1_and_3_keeps_the_others_exact():
    # Rows 1 and 3 of 5 leave in one step: row 4 moves to 3, then on to 1 (a double move).
    model, config, prompts = _setup()
    sp = SamplingParams(max_new_tokens=96, num_denoise_steps=3, ignore_eos=True)
    engine = _engine(model, config, bs=5)
    reqs = [engine.add_request(p, sp) for p in prompts]
    for _ in range(5):  # mid-way through the first blocks
        engine.step()
    engine.abort(reqs[1])
    engine.abort(reqs[3])
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and len(engine.batch) == 0
    assert reqs[1].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    for i in (0, 2, 4):
        alone = _engine(model, config, bs=1).generate([prompts[i]], sp)[0]
        assert reqs[i].output_ids == alone.output_ids


def test_abort_waiting_and_finished_requests():
    model, config, prompts = _setup()
    sp = SamplingParams(max_new_tokens=32, num_denoise_steps=2, ignore_eos=True)
    engine = _engine(model, config, bs=1)
    first, queued = engine.add_request(prompts[0], sp), engine.add_request(prompts[1], sp)
    engine.abort(queued)
    assert queued.status == RequestStatus.FINISHED_ABORTED
    assert list(engine.waiting) == [first]
    while engine.has_unfinished():
        engine.step()
    assert first.status == RequestStatus.FINISHED_LENGTH
    engine.abort(first)  # finished: left as it is
    assert first.status == RequestStatus.FINISHED_LENGTH
