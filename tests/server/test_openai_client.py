"""The official ``openai`` client against the real server (skipped when it is not installed)."""

from __future__ import annotations

import pytest
from server_kit import MODEL, LiveServer, Offline

from herald.config import SamplingParams

openai = pytest.importorskip("openai")


def test_openai_client_completions_chat_and_stream(server: LiveServer, offline: Offline) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    extra = {"steps": 2}
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(
        model=MODEL, prompt="openai says", max_tokens=48, extra_body=extra
    )
    want = offline.run("openai says", SamplingParams(max_new_tokens=48, num_denoise_steps=2))
    assert r.choices[0].text == offline.tokenizer.decode(want)
    assert r.usage is not None and r.usage.completion_tokens == len(want)
    stream = client.completions.create(
        model=MODEL, prompt="openai says", max_tokens=48, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == r.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=32,
        extra_body=extra,
    )
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=8)
