"""The official ``openai`` client with the request fields herald implements (skipped when the
client is not installed): usage in streams, echo, prompt lists, token-id prompts, chat content
parts, logprobs, and the 400 of a field herald does not implement."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_kit import MODEL, LiveServer, Offline

from herald.config import SamplingParams

openai = pytest.importorskip("openai")

EXTRA = {"steps": 2}


@pytest.fixture
def client(server: LiveServer) -> Iterator[Any]:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    yield c
    c.close()


def test_completion_stream_usage_echo_and_prompt_lists(client: Any, offline: Offline) -> None:
    full = client.completions.create(model=MODEL, prompt="usage", max_tokens=40, extra_body=EXTRA)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="usage", max_tokens=40, extra_body=EXTRA, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text

    echoed = client.completions.create(
        model=MODEL, prompt="usage", max_tokens=40, extra_body=EXTRA, echo=True
    )
    assert echoed.choices[0].text == "usage" + full.choices[0].text

    prompts = ["one prompt", "two prompts"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=40, extra_body=EXTRA)
    assert sorted(c.index for c in many.choices) == [0, 1]
    params = SamplingParams(max_new_tokens=40, num_denoise_steps=2)
    for c in many.choices:
        assert c.text == offline.tokenizer.decode(offline.run(prompts[c.index], params))
    ids = [offline.tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, extra_body=EXTRA)
    assert [c.text for c in by_ids.choices] == [c.text for c in many.choices]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=40, extra_body=EXTRA)
    assert one.choices[0].text == many.choices[0].text


def test_chat_stream_usage_and_content_parts(client: Any) -> None:
    text = [{"role": "user", "content": "parts"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "pa"},
                                          {"type": "text", "text": "rts"}]}]  # fmt: skip
    a = client.chat.completions.create(model=MODEL, messages=text, max_tokens=32, extra_body=EXTRA)
    b = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=32, extra_body=EXTRA)
    assert a.choices[0].message.content == b.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=text, max_tokens=32, extra_body=EXTRA, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage == a.usage
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert streamed == a.choices[0].message.content
    history = [*text, {"role": "assistant", "content": None}, {"role": "user", "content": "more"}]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8)
    assert r.choices[0].message.role == "assistant"


def test_unimplemented_fields_are_bad_requests(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", presence_penalty=0.5)
    assert "presence_penalty" in str(e.value)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools
        )
    assert "tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"nonsense": 1})
    assert "nonsense" in str(e.value)


def test_logprobs_through_the_client(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt="lp", max_tokens=32, logprobs=2, extra_body=EXTRA
    )
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "lp"}], max_tokens=32,
        logprobs=True, top_logprobs=2, extra_body=EXTRA,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) <= 2 and c.bytes is not None for c in content)
