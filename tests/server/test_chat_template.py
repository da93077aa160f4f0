"""Chat templates: from a checkpoint's tokenizer_config.json (jinja2), the fallbacks, and the
chat route over the live server using the template's text as its prompt."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_kit import LiveServer

from herald.models.registry import get_preset
from herald.models.tokenizer import byte_level_tokenizer
from herald.server.chat import ChatTemplate, ChatTemplateError

# A ChatML template in the style of the Qwen family's, with an input check.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def _sdar_tokenizer():
    return byte_level_tokenizer(get_preset("tiny-sdar"))


def test_template_from_tokenizer_config(tmp_path: Path) -> None:
    cfg = {"chat_template": TEMPLATE, "bos_token": {"content": "<|endoftext|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.for_model(tmp_path, _sdar_tokenizer())
    assert t.kind == "jinja"
    assert t.render(MESSAGES) == (
        "<|endoftext|><|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        t.render([{"role": "tool", "content": "x"}])


def test_named_templates_and_the_jinja_file(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.for_model(tmp_path, _sdar_tokenizer()).render(MESSAGES) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert ChatTemplate.for_model(tmp_path, _sdar_tokenizer()).render(MESSAGES) == "J2"


def test_template_errors_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate("{{ messages[5]['content'].upper() }}").render(MESSAGES)
    with pytest.raises(ChatTemplateError):  # the sandbox: no attribute walks to Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)
    assert ChatTemplate("{{ messages | tojson }}").render([{"role": "u", "content": "é<"}]) == (
        '[{"role": "u", "content": "é<"}]'
    )


def test_fallbacks() -> None:
    sdar = ChatTemplate.for_model("tiny-sdar", _sdar_tokenizer())
    assert sdar.kind == "chatml"
    assert sdar.render(MESSAGES).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    llada = ChatTemplate.for_model("tiny-llada2", byte_level_tokenizer(get_preset("tiny-llada2")))
    assert llada.kind == "plain"
    assert llada.render(MESSAGES) == "system: be brief\nuser: hi\nassistant:"


def test_chat_route_prompts_with_the_template(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = ChatTemplate(TEMPLATE, variables={"bos_token": ""})
    monkeypatch.setattr(server.state, "chat_template", template)
    # The mask token's text inside a message stays text, never a mask.
    messages = [{"role": "user", "content": "fill <|MASK|> in"}]
    body = {"max_tokens": 32, "steps": 2}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        chat = c.post("/v1/chat/completions", json={**body, "messages": messages})
        assert chat.status_code == 200, chat.text
        prompt = template.render(messages)
        plain = c.post("/v1/completions", json={**body, "prompt": prompt})
        tool = [{"role": "tool", "content": "x"}]
        bad = c.post("/v1/chat/completions", json={**body, "messages": tool})
    assert chat.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    mask_id = server.state.engine_loop.engine.config.mask_token_id
    assert mask_id not in server.state.tokenizer.encode(prompt)
    assert bad.status_code == 400 and "unknown role tool" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "messages"
