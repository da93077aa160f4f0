"""Batch invariance through the real server, in every mode: mixed-length standard-library
prompts sent at once (32 on a CUDA GPU, 8 on the CPU), each reply equal to the same prompt sent
alone.

The embedded trained model (real text, real attention patterns, so real near-ties in the
offloading modes' selections), bf16 on the CPU (and on a CUDA GPU, marked gpu), at each mode's
default budget. Eight running requests at most on the GPU, four on the CPU, and a prefill
budget of 256 tokens per boundary, so the prompts queue, join at different boundaries next to
different mates, and long ones prefill over several boundaries.
One or two blocks per reply (the second block's selection is the retrieval stream's), two or
three denoising steps per block, so the whole test stays within CPU minutes. On the CPU a
quarter of the prompts and half the slots (still twice the running slots, every prompt length,
both reply lengths and both step counts; each standard-library file once): bf16 matmuls are
slow on a CPU without bf16 instructions and the prompts sent one at a time run one after
another: on a 2-core machine 32 prompts took 103 s in dense mode, 16 took 47-67 s per mode
(~4 minutes over the four modes, a fifth of the suite); 8 take 26-33 s.
What a reply may not depend on: its batch mates (attention over padded key lengths, the
selection kernel's schedule), when it joined, and how the prefill budget was shared.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch
from server_kit import start_server

from herald.models.loader import load_model

pytestmark = pytest.mark.slow

MODEL = "code-sdar"
MODULES = ["textwrap", "json.decoder", "heapq", "bisect", "string", "colorsys", "fnmatch", "glob",
           "shlex", "queue", "sched", "numbers", "keyword", "copy", "abc", "random"]  # fmt: skip
TOKENS = [40, 150, 300, 600]  # prompt lengths, cycled
CLIENT_TIMEOUT = httpx.Timeout(600.0)  # 32 queued requests on a 2-core machine


PROMPTS = {"cpu": 8, "cuda": 32}
"""Prompts per device: the first this many of :func:`_bodies`."""
SLOTS = {"cpu": 4, "cuda": 8}
"""Running requests at most per device (``--max-batch-size``)."""


def _bodies() -> list[dict[str, Any]]:
    _, _, tok = load_model(MODEL, "cpu", torch.bfloat16)
    bodies = []
    for i in range(32):
        ids = tok.encode(open(importlib.import_module(MODULES[i % 16]).__file__ or "").read())  # noqa: SIM115
        n = TOKENS[i % len(TOKENS)]
        start = (i * 97) % (len(ids) - n)
        bodies.append({
            "prompt": tok.decode(ids[start : start + n]),
            "max_tokens": (32, 64)[i % 2],
            "steps": (2, 3)[i % 3 % 2],  # fixed denoising steps per block: bounded CPU time
        })  # fmt: skip
    return bodies


@pytest.fixture(scope="module")
def bodies() -> list[dict[str, Any]]:
    return _bodies()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["dense", "herald", "mage", "infinigen"])
def test_every_reply_equals_the_same_prompt_alone(
    mode: str, device: str, bodies: list[dict[str, Any]]
) -> None:
    bodies = bodies[: PROMPTS[device]]
    srv = start_server(dtype=torch.bfloat16, mode=mode, model=MODEL, device=device,
                       max_batch_size=SLOTS[device], max_seq_len=1024, max_prefill_tokens=256,
                       max_waiting=64)  # fmt: skip
    try:
        with httpx.Client(base_url=srv.url, timeout=CLIENT_TIMEOUT) as c:

            def text(body: dict[str, Any]) -> str:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["text"])

            with ThreadPoolExecutor(len(bodies)) as ex:
                together = list(ex.map(text, bodies))
            alone = [text(b) for b in bodies]  # one at a time: each alone in the batch
    finally:
        srv.close()
    differ = [i for i, (t, a) in enumerate(zip(together, alone, strict=True)) if t != a]
    assert not differ, (
        f"{mode} on {device}: {len(differ)} of {len(bodies)} replies differ: {differ}"
    )
