"""Why does the GPU budget-1.0 test (tiny-llada2, herald) fail in some runs and not others?

Runs dense twice (is dense itself deterministic?), then herald / herald with the selection
kernel's output recorded, several times, and prints for each run which requests differ from the
first dense run and at which token. Also checks that the retrieval's selected indices at budget
1.0 come out in position order (the pool's key order must equal dense's for bit-equal SDPA).

    PYTHONPATH=$PWD python3 scripts/device/diagnose_budget1.py [runs]
"""

from __future__ import annotations

import sys

import torch

from herald.config import EngineConfig, OffloadConfig, SamplingParams
from herald.engine.dense import DenseEngine
from herald.engine.hooks import EngineHooks, SelectionRecorder
from herald.models.registry import build_model, get_preset
from herald.offload.engine import OffloadEngine


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    config = get_preset("tiny-llada2")
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (70, 20, 130, 64)]
    params = SamplingParams(max_new_tokens=72, ignore_eos=True)

    pad = int(sys.argv[2]) if len(sys.argv) > 2 else 0  # kv_pad for both engines

    def dense() -> list[list[int]]:
        eng = DenseEngine(
            model, config, EngineConfig(max_batch_size=4, max_seq_len=256, kv_pad=pad)
        )
        return [r.output_ids for r in eng.generate(prompts, params)]

    ref = dense()
    for r in range(runs):
        d2 = dense()
        print(
            f"dense run {r + 1}: diff vs dense run 0:",
            [first_diff(a, b) for a, b in zip(ref, d2, strict=True)],
        )
    if True:
        for r in range(runs):
            cfg = OffloadConfig.for_mode("herald", kv_budget=1.0, selection_threads=2)
            recorder = SelectionRecorder()
            ecfg = EngineConfig(max_batch_size=4, max_seq_len=256, kv_pad=pad, offload=cfg)
            eng = OffloadEngine(model, config, ecfg, EngineHooks(on_selection=recorder))
            got = [x.output_ids for x in eng.generate(prompts, params)]
            unsorted = 0
            for job in recorder.jobs:
                for _layer, (_q, idx) in job.recorded.items():
                    for i, kk in enumerate(job.budgets):
                        rows = idx[i, :, :kk]
                        unsorted += int((rows[:, 1:] < rows[:, :-1]).any())
            eng.close()
            print(
                f"herald run {r}: diff vs dense:",
                [first_diff(a, b) for a, b in zip(ref, got, strict=True)],
                f"| selections with indices out of position order: {unsorted}",
            )


if __name__ == "__main__":
    main()
