"""Prefill throughput through the engines' real prefill (GPU, full-size random weights).

``python -m herald.bench.prefill --model llada2-mini --prompts 4096,16384,32768 --requests 4``

Per engine mode and prompt length: two warm-up requests (compiles, first launches and the CUDA graph
capture of the first selection's forward, not counted), then ``--requests`` prompts queued at once
and stepped until all have joined the decode batch. Reported: prefill tokens/s = prompt tokens over
the engine's own prefill time (``EngineStats.prefill_seconds``: each chunk's forward, the KV writes,
for offloading modes the copy to the CPU pool and the first block's selection, synchronised), and
the wall time until the last request joined. ``--triton 0,auto`` measures with herald's Triton
kernels off and on in the same process (``HERALD_TRITON``), ``--prefill-attention sdpa,triton`` with
the prefill chunks' attention on either path (``HERALD_PREFILL_ATTENTION``), ``--chunk-tokens
4096,16384`` with prompts prefilled in pieces of each size, ``--cuda-graphs on,off`` with the
engine's ``use_cuda_graph`` on and off (the prefill chunks run eagerly either way; an offloading
engine's first selection replays the decode forward's graphs when on); every combination, in the
order given.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

from herald.bench.common import append_jsonl, random_prompts
from herald.cliargs import list_of, token_count
from herald.config import EngineConfig, SamplingParams
from herald.engines import MODES, build_engine, offload_for_mode
from herald.env import PREFILL_ATTENTION_CHOICES, TRITON_CHOICES, overridden, settings
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig
from herald.models.loader import load_model


def measure(
    model: BlockDiffusionLM,
    config: ModelConfig,
    mode: str,
    prompt_len: int,
    requests: int,
    chunk_tokens: int = EngineConfig.prefill_chunk_tokens,
    cuda_graphs: bool = True,
) -> dict[str, object]:
    """One mode and prompt length: tokens/s of the real prefill (see the module docstring)."""
    engine_config = EngineConfig(
        max_batch_size=requests,
        max_seq_len=prompt_len + 64,
        prefill_chunk_tokens=chunk_tokens,
        offload=offload_for_mode(mode),
        use_cuda_graph=cuda_graphs,
    )
    eng = build_engine(model, config, engine_config)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)

    def run(n: int, seed: int) -> float:
        # token ids drawn without the special ones (a tiny preset's mask id is among its first
        # few hundred: the engine refuses a prompt holding it)
        prompts = random_prompts(config, n, prompt_len, seed)
        reqs = [eng.add_request(prompt, params) for prompt in prompts]
        t0 = time.perf_counter()
        while eng.num_waiting:
            eng.step()
        wall = time.perf_counter() - t0
        while eng.has_unfinished():
            eng.step()
        assert all(r.status.finished for r in reqs)
        return wall

    try:
        run(2, seed=2 * prompt_len)  # warm-up: the second join captures the graphs
        eng.stats.prefill_seconds = 0.0
        eng.stats.num_prefill_tokens = 0
        wall = run(requests, seed=2 * prompt_len + 1)
        tokens, secs = eng.stats.num_prefill_tokens, eng.stats.prefill_seconds
    finally:
        eng.close()
    return {
        "mode": mode,
        "prompt_tokens": prompt_len,
        "prefill_chunk_tokens": chunk_tokens,
        "cuda_graphs": cuda_graphs,
        "requests": requests,
        "prefill_tokens": tokens,
        "prefill_seconds": secs,
        "prefill_tokens_per_s": tokens / secs if secs else None,
        "wall_until_all_joined_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m herald.bench.prefill", description=__doc__)
    p.add_argument(
        "--model",
        default="llada2-mini",
        help="a preset (random weights at full size) (default: %(default)s)",
    )
    p.add_argument(
        "--modes",
        type=list_of(str.lower, MODES),
        default="dense,herald",
        help=f"comma-separated of {MODES} (default: %(default)s)",
    )
    p.add_argument(
        "--prompts",
        type=list_of(token_count),
        default="4096,16384,32768",
        help="prompt lengths in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--requests", type=int, default=4, help="prompts queued at once (default: %(default)s)"
    )
    p.add_argument(
        "--triton",
        type=list_of(str.lower, TRITON_CHOICES),
        default=None,
        help=f"HERALD_TRITON values to measure, of {TRITON_CHOICES}, e.g. 0,auto (default: this "
        "process's setting)",
    )
    p.add_argument(
        "--prefill-attention",
        type=list_of(str.lower, PREFILL_ATTENTION_CHOICES),
        default=None,
        help=f"HERALD_PREFILL_ATTENTION values to measure, of {PREFILL_ATTENTION_CHOICES}, e.g. "
        "sdpa,triton (default: this process's setting)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=list_of(token_count),
        default=str(EngineConfig.prefill_chunk_tokens),
        help="prompt tokens per prefill forward (EngineConfig.prefill_chunk_tokens), a list to "
        "measure each, e.g. 4096,16384 (default: %(default)s)",
    )
    p.add_argument(
        "--cuda-graphs",
        type=list_of(str.lower, ("on", "off")),
        default="on",
        help="the engine's CUDA graphs, on and/or off, e.g. off,on (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, default=None, help="append records to DIR/prefill.jsonl")
    a = p.parse_args(argv)
    try:
        now = settings()
    except ValueError as e:  # a bad HERALD_* switch in the environment
        p.error(str(e))
    triton = a.triton or [now.triton]
    attention = a.prefill_attention or [now.prefill_attention]
    modes, prompts, chunks = a.modes, a.prompts, a.chunk_tokens
    for flag, sizes in (("--prompts", prompts), ("--chunk-tokens", chunks)):
        if min(sizes) < 1:
            p.error(f"{flag}: token counts must be >= 1, got {sizes}")
    if a.requests < 1:
        p.error(f"--requests must be >= 1, got {a.requests}")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model, config, _ = load_model(
        a.model, device="cuda", dtype=torch.bfloat16, random_init_seed=0, block_size=32
    )
    switches = [
        {"HERALD_TRITON": t, "HERALD_PREFILL_ATTENTION": at} for t in triton for at in attention
    ]
    for switch in switches:
        with overridden(switch):
            for mode, n, chunk, graphs in itertools.product(modes, prompts, chunks, a.cuda_graphs):
                rec = {
                    "model": a.model,
                    "triton": switch["HERALD_TRITON"],
                    "prefill_attention": switch["HERALD_PREFILL_ATTENTION"],
                    **measure(model, config, mode, n, a.requests, chunk, graphs == "on"),
                }
                if a.out is not None:  # each record as it comes: a cut run keeps them
                    append_jsonl(a.out / "prefill.jsonl", [rec])
                tps = rec["prefill_tokens_per_s"]
                print(
                    f"triton={rec['triton']} prefill_attention={rec['prefill_attention']} "
                    f"graphs={graphs} "
                    f"{mode:8s} {n:6d} tokens x {a.requests} (chunks of {chunk}): {tps:10.0f} "
                    f"tok/s prefill, all joined after {rec['wall_until_all_joined_s']:.2f} s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
