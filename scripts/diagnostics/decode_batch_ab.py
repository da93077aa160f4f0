"""DecodeBatch A/B on one device: the tokens of every engine with another DecodeBatch module
(an earlier version of ``herald/engine/decode_batch.py``) equal this one's, and the dense engine's
time per step with each.

    git show <commit>:herald/engine/decode_batch.py > .dev/old_decode_batch.py
    python3 scripts/diagnostics/decode_batch_ab.py .dev/old_decode_batch.py [cuda]

Prints one line per configuration whose outputs (tokens, steps per block, finish reason) differ,
then ``ALL EQUAL`` or ``MISMATCH``, then ms/step of the dense engine at batch 32 (greedy and
sampled, tiny-llada2) with each module.
"""

from __future__ import annotations

import importlib.util
import sys
import time

import torch

from herald.config import EngineConfig, OffloadConfig, SamplingParams
from herald.engines import build_engine
from herald.models.registry import build_model, get_preset

PARAMS = {
    "greedy": [SamplingParams(max_new_tokens=70, ignore_eos=True)],
    "fixed": [SamplingParams(max_new_tokens=64, num_denoise_steps=5, ignore_eos=True)],
    "sampled": [
        SamplingParams(
            max_new_tokens=60, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True
        )
    ],
    "mixed": [
        SamplingParams(max_new_tokens=60, ignore_eos=True),
        SamplingParams(max_new_tokens=90, num_denoise_steps=8, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=64, threshold=0.5, ignore_eos=True),
        SamplingParams(max_new_tokens=50, temperature=1.5, top_p=0.8, seed=11),
    ],
}
MODES = {
    "dense": None,
    "herald-1.0": OffloadConfig.for_mode("herald", kv_budget=1.0),
    "herald-0.3": OffloadConfig.for_mode("herald", kv_budget=0.3),
    "mage-0.5": OffloadConfig.for_mode("mage", kv_budget=0.5),
}


def _use(module_path: str | None) -> None:
    import herald.engine.base as base
    from herald.engine import decode_batch

    cls = decode_batch.DecodeBatch
    if module_path is not None:
        spec = importlib.util.spec_from_file_location("other_decode_batch", module_path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cls = mod.DecodeBatch
    base.DecodeBatch = cls  # type: ignore[misc]


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def outputs(device: str) -> dict[str, list]:
    out: dict[str, list] = {}
    prompts = _prompts([33, 100, 7, 64, 45], 3)
    for preset in ("tiny-sdar", "tiny-llada2"):
        config = get_preset(preset)
        model = build_model(config, device=device, dtype=torch.bfloat16, seed=1)
        for mode, off in MODES.items():
            for name, plist in PARAMS.items():
                cfg = EngineConfig(offload=off, max_batch_size=3, max_seq_len=320)
                eng = build_engine(model, config, cfg)
                sp = (plist * len(prompts))[: len(prompts)]
                reqs = eng.generate(prompts, sp)
                eng.close()
                out[f"{preset}/{mode}/{name}"] = [
                    [r.output_ids, r.steps_per_block, r.finish_reason] for r in reqs
                ]
    return out


def ms_per_step(device: str) -> list[str]:
    config = get_preset("tiny-llada2")
    model = build_model(config, device=device, dtype=torch.bfloat16, seed=1)
    prompts = _prompts([int(n) for n in torch.randint(20, 200, (32,))], 0)
    lines = []
    for temp in (0.0, 1.0):
        params = SamplingParams(
            max_new_tokens=128, num_denoise_steps=8, ignore_eos=True, temperature=temp, seed=1
        )
        eng = build_engine(model, config, EngineConfig(max_batch_size=32, max_seq_len=512))
        eng.generate(prompts, params)  # warm-up: graphs, compiled kernels
        best = float("inf")
        for _ in range(3):
            n0 = eng.stats.num_forwards
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / (eng.stats.num_forwards - n0))
        eng.close()
        lines.append(f"temperature {temp}: {best * 1e3:.3f} ms/step")
    return lines


def main() -> None:
    other = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    _use(other)
    want, t_other = outputs(device), ms_per_step(device)
    _use(None)
    got, t_this = outputs(device), ms_per_step(device)
    bad = [k for k in want if want[k] != got[k]]
    for k in bad:
        print("differs:", k)
    print("MISMATCH" if bad else "ALL EQUAL", f"({len(want)} configurations)")
    for a, b in zip(t_other, t_this, strict=True):
        print(f"dense bs 32, {a.split(':')[0]}: other {a.split(': ')[1]}, this {b.split(': ')[1]}")


if __name__ == "__main__":
    main()
