"""herald bench serve's client request: the body a level sends, seen by a mock transport."""

from __future__ import annotations

import asyncio
import json

import pytest

from herald.bench.serve_client import LoadSettings, Outcome, _stream

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

SSE = (
    'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":'
    '[{"index":0,"text":"ab","finish_reason":null,"token_ids":[5,6]}]}\n\n'
    'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[],'
    '"usage":{"prompt_tokens":3000,"completion_tokens":2,"total_tokens":3002}}\n\n'
    "data: [DONE]\n\n"
)


def test_the_prompt_ids_reach_the_body_whole_and_in_order():
    ids = [(7 * i) % 301 for i in range(3000)]
    bodies: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE)

    async def go() -> Outcome:
        transport = httpx.MockTransport(handler)
        client = openai.AsyncOpenAI(
            base_url="http://bench.invalid/v1", api_key="k", max_retries=0,
            http_client=httpx.AsyncClient(transport=transport),
        )  # fmt: skip
        settings = LoadSettings("m", max_tokens=64, steps=2, ignore_eos=True, duration_limit_s=9)
        outcome = Outcome()
        await _stream(client, ids, settings, outcome)
        await client.close()
        return outcome

    outcome = asyncio.run(go())
    (body,) = bodies
    assert body["prompt"] == ids
    assert body["max_tokens"] == 64 and body["stream"] is True
    assert body["steps"] == 2 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert outcome.status == "completed", outcome.error
    assert outcome.tokens == 2 and outcome.usage_prompt_tokens == 3000
