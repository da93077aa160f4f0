"""A real server at a few thousand tokens of context, in every mode: two concurrent requests
(3,000 and 1,500 prompt tokens) get the tokens an offline engine of the same mode and dtype
gives each prompt alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from helpers import make_engine
from server_kit import MODEL, TIMEOUT, start_server

from herald.config import OffloadConfig, SamplingParams
from herald.models.loader import load_model

MAX_SEQ_LEN = 4096
LENGTHS = (3000, 1500)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _offline(mode: str, dtype: torch.dtype, prompt: list[int], params: SamplingParams):
    model, config, _ = load_model(MODEL, "cpu", dtype)
    offload = None if mode == "dense" else OffloadConfig.for_mode(mode)
    engine = make_engine(model, config, offload, max_batch_size=1, max_seq_len=MAX_SEQ_LEN)
    try:
        (req,) = engine.generate([prompt], params)
    finally:
        engine.close()
    return list(req.output_ids)


@pytest.mark.parametrize("mode", ["dense", "herald", "mage", "infinigen"])
def test_served_long_prompts_equal_offline_generate(mode: str) -> None:
    dtype = torch.float32 if mode == "dense" else torch.bfloat16
    body = {"max_tokens": 64, "steps": 4, "temperature": 0.0}
    srv = start_server(dtype, mode=mode, max_seq_len=MAX_SEQ_LEN, max_batch_size=2)
    try:

        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
                posts = [c.post("/v1/completions", json={**body, "prompt": p}) for p in _prompts()]
                return list(await asyncio.gather(*posts))

        responses = asyncio.run(go())
    finally:
        srv.close()
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=4)
    for prompt, r in zip(_prompts(), responses, strict=True):
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        assert got, "nothing generated"
        assert got == _offline(mode, dtype, prompt, params), len(prompt)
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)
