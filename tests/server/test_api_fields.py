"""The OpenAI / vLLM request fields and routes over raw HTTP (httpx): usage in streams, echo,
prompt lists and token ids, chat content forms, defaults, sampling fields reaching the engine,
refusals, stop strings cutting token counts, /tokenize, /detokenize, /version, model names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_kit import API_KEY, MAX_SEQ_LEN, MODEL, TIMEOUT, LiveServer, Offline

import herald
from herald import env
from herald.cli import build_parser
from herald.config import SamplingParams
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.launch import build_app
from herald.server.state import served_names

FAST = {"max_tokens": 48, "steps": 2}


def _sse(resp: httpx.Response) -> list[Any]:
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture
def captured(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The SamplingParams of every request the engine queues while the test runs."""
    engine = server.state.engine_loop.engine
    real = engine.add_request
    seen: list[SamplingParams] = []

    def add_request(ids: list[int], params: SamplingParams) -> Any:
        seen.append(params)
        return real(ids, params)

    monkeypatch.setattr(engine, "add_request", add_request)
    return seen


def _post_stream(c: httpx.Client, route: str, body: dict[str, Any]) -> list[Any]:
    with c.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        chunks = _sse(r)
    assert chunks[-1] == "[DONE]"
    return chunks[:-1]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_stream_include_usage_ends_with_a_usage_chunk(client: httpx.Client, route: str) -> None:
    chat = route.endswith("chat/completions")
    body: dict[str, Any] = {**FAST}
    body.update({"messages": [{"role": "user", "content": "count"}]} if chat else {"prompt": "n"})
    full = client.post(route, json=body).json()
    plain = _post_stream(client, route, body)
    assert all("usage" not in p for p in plain)  # without stream_options: no usage key
    parts = _post_stream(client, route, {**body, "stream_options": {"include_usage": True}})
    *blocks, last = parts
    assert last["choices"] == [] and last["usage"] == full["usage"]
    assert all(p["usage"] is None for p in blocks) and blocks
    key = (lambda ch: ch["delta"]["content"]) if chat else (lambda ch: ch["text"])
    text = "".join(key(p["choices"][0]) for p in blocks)
    want = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    assert text == want
    cont = {"include_usage": True, "continuous_usage_stats": True}
    *blocks, last = _post_stream(client, route, {**body, "stream_options": cont})
    counts = [p["usage"]["completion_tokens"] for p in blocks]
    assert counts == sorted(counts) and counts[-1] == full["usage"]["completion_tokens"]
    assert last["usage"] == full["usage"]
    r = client.post(route, json={**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_echo_prepends_the_prompt(client: httpx.Client, offline: Offline) -> None:
    body = {"prompt": "echo me", **FAST}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "echo me" + plain["text"]
    assert echoed["token_ids"] == plain["token_ids"]  # generated tokens only
    parts = _post_stream(client, "/v1/completions", {**body, "echo": True})
    assert parts[0]["choices"][0]["text"] == "echo me" and parts[0]["choices"][0]["token_ids"] == []
    assert "".join(p["choices"][0]["text"] for p in parts) == echoed["text"]
    ids = offline.tokenizer.encode("echo me")
    by_ids = client.post("/v1/completions", json={**body, "prompt": ids, "echo": True}).json()
    assert by_ids["choices"][0]["text"] == echoed["text"]
    r = client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_prompt_lists_and_token_ids(client: httpx.Client, offline: Offline) -> None:
    prompts = ["first prompt", "second one", "third"]
    r = client.post("/v1/completions", json={"prompt": prompts, **FAST})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [ch["index"] for ch in got["choices"]] == [0, 1, 2]
    params = SamplingParams(max_new_tokens=48, num_denoise_steps=2)
    wants = [offline.run(p, params) for p in prompts]
    assert [ch["token_ids"] for ch in got["choices"]] == wants
    ids = [offline.tokenizer.encode(p) for p in prompts]
    assert got["usage"]["prompt_tokens"] == sum(len(x) for x in ids)
    assert got["usage"]["completion_tokens"] == sum(len(w) for w in wants)
    one = client.post("/v1/completions", json={"prompt": ids[1], **FAST}).json()
    assert one["choices"][0]["token_ids"] == wants[1]
    many = client.post("/v1/completions", json={"prompt": ids, **FAST}).json()
    assert [ch["token_ids"] for ch in many["choices"]] == wants
    parts = _post_stream(client, "/v1/completions", {"prompt": prompts, **FAST})
    for i, want in enumerate(wants):
        mine = [p["choices"][0] for p in parts if p["choices"][0]["index"] == i]
        assert [t for ch in mine for t in ch["token_ids"]] == want
        assert [ch["finish_reason"] is not None for ch in mine].count(True) == 1
    bad = client.post("/v1/completions", json={"prompt": [[1, 2], [10**9]], **FAST})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    mask, vocab = offline.tokenizer.mask_token_id, offline.config.vocab_size
    bad = client.post("/v1/completions", json={"prompt": [5, mask, 7], **FAST})
    assert bad.status_code == 400 and "mask token" in bad.json()["error"]["message"]
    for stop in ([vocab], [3, mask]):  # never a token the model emits
        bad = client.post("/v1/completions", json={"prompt": "x", "stop_token_ids": stop, **FAST})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids", stop


def test_chat_content_forms(client: httpx.Client) -> None:
    def ask(messages: list[dict[str, Any]]) -> httpx.Response:
        return client.post("/v1/chat/completions", json={"messages": messages, **FAST})

    text = ask([{"role": "user", "content": "ab"}]).json()
    parts = ask([{"role": "user", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]}])  # fmt: skip
    assert parts.json()["choices"][0]["token_ids"] == text["choices"][0]["token_ids"]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "again"}]  # fmt: skip
    assert ask(turns).status_code == 200
    r = ask([{"role": "user", "content": None}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    r = ask(audio)
    assert r.status_code == 400 and "'input_audio'" in r.json()["error"]["message"]
    r = ask([{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.tool_calls"
    # what a client copies back from an earlier reply is accepted
    reply = {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None}
    assert ask([{"role": "user", "content": "hi"}, reply]).status_code == 200


def test_default_max_tokens(
    client: httpx.Client, server: LiveServer, captured: list[SamplingParams]
) -> None:
    prompt = server.state.chat_template.render([{"role": "user", "content": "long"}])  # type: ignore[union-attr]
    n = len(server.state.tokenizer.encode(prompt))
    body = {"messages": [{"role": "user", "content": "long"}], "steps": 1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "short", "steps": 1}).status_code == 200
    assert [p.max_new_tokens for p in captured] == [MAX_SEQ_LEN - n, 16]


def test_sampling_fields_reach_the_engine(
    client: httpx.Client, captured: list[SamplingParams]
) -> None:
    body = {"prompt": "knobs", **FAST, "top_k": 5, "min_tokens": 3, "ignore_eos": True,
            "stop_token_ids": [7, 9], "temperature": 0.5, "seed": 3}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "x"}], **FAST, "top_k": -1}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    p, q = captured
    assert (p.top_k, p.min_tokens, p.ignore_eos, tuple(p.stop_token_ids)) == (5, 3, True, (7, 9))
    assert (p.temperature, p.seed) == (0.5, 3)
    assert q.top_k == 0  # vLLM's -1, "off"
    assert len(r.json()["choices"][0]["token_ids"]) == 48  # ignore_eos: the full length
    r = client.post("/v1/completions", json={**body, "min_tokens": 49})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


def test_requests_without_steps_or_threshold_take_the_servers(
    client: httpx.Client, server: LiveServer, captured: list[SamplingParams],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``herald serve --steps / --threshold``: the denoising of a request that sets neither; a
    request's own value wins (its threshold: threshold mode at it); it may not set both."""
    from herald.server.defaults import DenoiseDefaults

    monkeypatch.setattr(server.state, "denoise", DenoiseDefaults(threshold=0.8, steps=3))
    cases = [({}, 0.8, 3), ({"steps": None}, 0.8, 3), ({"steps": 2}, 0.8, 2),
             ({"threshold": 0.9}, 0.9, None),
             ({"threshold": 0.9, "steps": None}, 0.9, None)]  # fmt: skip
    for fields, _, _ in cases:
        body = {"prompt": "defaults", "max_tokens": 8, **fields}
        assert client.post("/v1/completions", json=body).status_code == 200
    got = [(p.threshold, p.num_denoise_steps) for p in captured]
    assert got == [(t, s) for _, t, s in cases]
    both = {"prompt": "both", "max_tokens": 8, "threshold": 0.9, "steps": 2}  # steps used no
    r = client.post("/v1/completions", json=both)  # threshold: one of them was dropped
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps", r.text
    assert "not both" in r.json()["error"]["message"] and len(captured) == len(cases)
    monkeypatch.setattr(server.state, "denoise", DenoiseDefaults(threshold=0.8))
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert (captured[-1].threshold, captured[-1].num_denoise_steps) == (0.8, None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("best_of", 2), ("suffix", "end"), ("presence_penalty", 0.5), ("frequency_penalty", 1),
        ("repetition_penalty", 1.2), ("logit_bias", {"5": 1}), ("response_format",
        {"type": "json_object"}), ("n", 2), ("use_beam_search", True), ("min_p", 0.1),
        ("guided_json", {}), ("add_special_tokens", True), ("prompt_logprobs", 1),
    ],
)  # fmt: skip
def test_unimplemented_completion_fields_are_refused_by_name(
    client: httpx.Client, field: str, value: Any
) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "field,value",
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
     ("functions", [{"name": "f"}]), ("response_format", {"type": "json_schema"}),
     ("top_logprobs", 2), ("echo", True), ("audio", {"voice": "x"}), ("best_of", 2),
     ("suffix", "x")],
)  # fmt: skip
def test_unimplemented_chat_fields_are_refused_by_name(
    client: httpx.Client, field: str, value: Any
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_neutral_values_ignored_fields_and_unknown_fields(client: httpx.Client) -> None:
    neutral = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "user": "u-1", "suffix": None, "n": 1, "repetition_penalty": 1.0,
               "response_format": {"type": "text"}, "seed": 1}  # fmt: skip
    r = client.post("/v1/completions", json={"prompt": "hi", **FAST, **neutral})
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], **FAST, "tools": [],
            "tool_choice": "none", "user": "u", "metadata": {"a": "b"}, "store": False,
            "parallel_tool_calls": True, "best_of": 1}  # fmt: skip
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "hi", "bogus": 1, "other": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "bogus"
    assert "'bogus'" in err["message"] and "'other'" in err["message"]
    # a chat-only field on completions is unknown there
    r = client.post("/v1/completions", json={"prompt": "hi", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def _emitted(offline: Offline, ids: list[int], text: str) -> list[int]:
    """The shortest prefix of ``ids`` whose text starts with ``text``."""
    k = next(k for k in range(len(ids) + 1) if offline.tokenizer.decode(ids[:k]).startswith(text))
    return ids[:k]


def test_stop_string_cuts_token_ids_and_usage(client: httpx.Client, offline: Offline) -> None:
    body = {"prompt": "stop counting", "max_tokens": 64, "steps": 2}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    text, ids = full["text"], full["token_ids"]
    # a 2-character stop string first seen inside the first block (committed whole), not at 0
    cut = next(p for p in range(1, len(text) - 1) if text.find(text[p : p + 2]) == p
               and 0 < len(_emitted(offline, ids, text[:p])) < 31)  # fmt: skip
    stop = text[cut : cut + 2]
    want = _emitted(offline, ids, text[:cut])
    r = client.post("/v1/completions", json={**body, "stop": stop}).json()
    assert r["choices"][0]["text"] == text[:cut] and r["choices"][0]["token_ids"] == want
    assert r["usage"]["completion_tokens"] == len(want)
    streamed = {**body, "stop": [stop], "stream_options": {"include_usage": True}}
    *parts, last = _post_stream(client, "/v1/completions", streamed)
    assert [t for p in parts for t in p["choices"][0]["token_ids"]] == want
    assert last["usage"]["completion_tokens"] == len(want)
    kept = {**body, "stop": stop, "include_stop_str_in_output": True}
    kept = client.post("/v1/completions", json=kept).json()
    assert kept["choices"][0]["text"] == text[: cut + len(stop)]
    assert kept["choices"][0]["token_ids"] == _emitted(offline, ids, text[: cut + len(stop)])


def test_a_stream_sends_no_empty_chunk_while_text_is_held_back(client: httpx.Client) -> None:
    """Text is held back at a block's end while it may be the start of a stop string (or is an
    unfinished UTF-8 sequence): such a block goes out with a later one, never as an empty chunk.
    The stop string here is two blocks' text and then a character the model never writes."""
    body = {"prompt": "stop counting", "max_tokens": 160, "steps": 2}
    plain = [p["choices"][0] for p in _post_stream(client, "/v1/completions", body)]
    texts = [p["text"] for p in plain if p["text"]]
    assert len(texts) >= 4, texts
    stop = texts[1] + texts[2] + "\U0010ffff"
    held = _post_stream(client, "/v1/completions", {**body, "stop": stop})
    parts = [p["choices"][0] for p in held]
    for chunks in (plain, parts):
        assert all(p["text"] or p["token_ids"] or p["finish_reason"] for p in chunks), chunks
        assert "".join(p["text"] for p in chunks) == "".join(texts)
        assert [t for p in chunks for t in p["token_ids"]] == [
            t for p in plain for t in p["token_ids"]
        ]
    assert len(parts) < len(plain)  # the held blocks went out with a later one


def test_tokenize_detokenize_version(client: httpx.Client, server: LiveServer) -> None:
    tok = server.state.tokenizer
    r = client.post("/tokenize", json={"prompt": "hello there", "model": MODEL}).json()
    assert r == {"count": len(tok.encode("hello there")), "max_model_len": MAX_SEQ_LEN,
                 "tokens": tok.encode("hello there")}  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == tok.encode(server.state.chat_template.render(msgs))  # type: ignore[union-attr]
    strs = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["a", "b"]
    back = client.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "hello there"}
    assert client.post("/tokenize", json={}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404
    bad = client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.get("/version").json() == {"version": herald.__version__}


def test_served_model_names(
    client: httpx.Client, server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_names("checkpoints/code-sdar/") == ("code-sdar",)
    assert served_names("/models/LLaDA2.0-mini") == ("LLaDA2.0-mini",)
    assert served_names("tiny-sdar", ["a", "b"]) == ("a", "b")
    with pytest.raises(ValueError):
        served_names("x", [""])
    monkeypatch.setattr(server.state, "model_name", "public")
    monkeypatch.setattr(server.state, "aliases", ("alias",))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["public", "alias"]
    body = {"prompt": "named", "max_tokens": 8, "steps": 1}
    assert client.post("/v1/completions", json=body).json()["model"] == "public"
    r = client.post("/v1/completions", json={**body, "model": "alias"})
    assert r.status_code == 200 and r.json()["model"] == "alias"
    r = client.post("/v1/completions", json={**body, "model": MODEL})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_from_the_environment() -> None:
    with env.overridden({"HERALD_API_KEY": "from-env"}) as s:
        assert s.api_key == "from-env" and "from-env" not in repr(s)
    assert env.parse({"HERALD_API_KEY": ""}).api_key is None


def test_build_app_takes_names_and_the_key_from_the_environment() -> None:
    engine = SERVE_DEFAULTS.replace(max_seq_len=64, max_batch_size=1)
    with env.overridden({"HERALD_API_KEY": "from-env"}):
        named = build_app(MODEL, engine, served_model_name=["public", "alt"])
        flagged = build_app(MODEL, engine, api_key="flag")
    try:
        assert named.state.herald.model_names == ("public", "alt")
        assert named.state.herald.api_key == "from-env"
        assert flagged.state.herald.model_names == (MODEL,)
        assert flagged.state.herald.api_key == "flag"  # --api-key wins
    finally:
        for app in (named, flagged):
            app.state.herald.engine_loop.stop()
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]


def test_stop_reason_for_strings_and_stop_token_ids(client: httpx.Client) -> None:
    body = {"prompt": "reasons", "max_tokens": 64, "steps": 2}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    assert full["stop_reason"] is None
    ids = full["token_ids"]
    j = next(j for j in range(5, len(ids)) if ids[j] not in ids[:j])  # first seen at j
    r = client.post("/v1/completions", json={**body, "stop_token_ids": [ids[j]]}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == ids[j]
    assert ch["token_ids"] == ids[:j]  # the stop token itself is not returned
    text = full["text"]
    stop = text[3:5]
    r = client.post("/v1/completions", json={**body, "stop": ["\x00never", stop]}).json()
    assert r["choices"][0]["stop_reason"] == stop
    *_, last = _post_stream(client, "/v1/completions", {**body, "stop": stop})
    assert last["choices"][0]["stop_reason"] == stop


def test_completion_logprobs(client: httpx.Client) -> None:
    body = {"prompt": "scores", "max_tokens": 64, "steps": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    ch = client.post("/v1/completions", json={**body, "logprobs": 3}).json()["choices"][0]
    assert ch["token_ids"] == plain["token_ids"] and plain["logprobs"] is None
    lp = ch["logprobs"]
    n = len(ch["token_ids"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(x <= 0 for x in lp["token_logprobs"])
    for own, alts in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 1 <= len(alts) <= 3
        assert max(alts.values()) == pytest.approx(own)  # greedy: the token is the likeliest
    assert all(isinstance(t, str) for t in lp["tokens"])
    zero = client.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    assert zero["logprobs"]["top_logprobs"] is None
    assert zero["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    parts = _post_stream(client, "/v1/completions", {**body, "logprobs": 3})
    blocks = [p["choices"][0]["logprobs"] for p in parts if p["choices"][0]["token_ids"]]
    assert [x for b in blocks for x in b["token_logprobs"]] == lp["token_logprobs"]
    assert [x for b in blocks for x in b["text_offset"]] == lp["text_offset"]
    # cut with the text at a stop string
    stop = plain["text"][3:5]
    cut = client.post("/v1/completions", json={**body, "logprobs": 1, "stop": stop}).json()
    got = cut["choices"][0]
    assert len(got["logprobs"]["token_logprobs"]) == len(got["token_ids"])
    assert got["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(got["token_ids"])]
    r = client.post("/v1/completions", json={**body, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_chat_logprobs(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "score"}], **FAST}
    r = client.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2})
    ch = r.json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == len(ch["token_ids"]) == r.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert isinstance(entry["bytes"], list) and len(entry["top_logprobs"]) <= 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
    own = client.post("/v1/chat/completions", json={**body, "logprobs": True}).json()
    assert all(e["top_logprobs"] == [] for e in own["choices"][0]["logprobs"]["content"])
    parts = _post_stream(client, "/v1/chat/completions", {**body, "logprobs": True})
    streamed = [e for p in parts if p["choices"][0]["logprobs"]
                for e in p["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert streamed == own["choices"][0]["logprobs"]["content"]


def test_too_many_prompts_and_the_key_on_tokenizer_routes(
    client: httpx.Client, server: LiveServer, small_server: LiveServer
) -> None:
    limit = server.state.max_prompts
    assert limit is not None
    r = client.post("/v1/completions", json={"prompt": [[1]] * (limit + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with httpx.Client(base_url=small_server.url, timeout=TIMEOUT) as c:
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert c.post(route, json=body).status_code == 401
            ok = c.post(route, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
            assert ok.status_code == 200, ok.text
        assert c.get("/version").status_code == 200  # open, as /health


def test_a_lone_surrogate_is_a_400_not_a_500(client: httpx.Client) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which no tokenizer can encode."""
    for route, body in [
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("/tokenize", {"prompt": "\ud800"}),
    ]:
        raw = json.dumps(body)  # ASCII, with the surrogate escaped as JSON allows
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["code"] == "invalid_unicode", route


def test_a_body_that_is_not_utf8_is_a_malformed_json_400(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    for body in (b'{"prompt": "\xff\xfe", "max_tokens": 2}', b"{not json"):
        r = client.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("malformed JSON body"), r.text


def test_max_tokens_and_max_completion_tokens_together(client: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    same = {"messages": msgs, "max_tokens": 4, "max_completion_tokens": 4, "steps": 2}
    r = client.post("/v1/chat/completions", json=same)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
    r = client.post("/v1/chat/completions", json={**same, "max_completion_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert "differ" in r.json()["error"]["message"]


def test_budget_and_kv_budget_together(client: httpx.Client) -> None:
    """The two names of the budget field: equal values are one request, different ones a 400
    naming the alias."""
    budget = client.get("/v1/models").json()["data"][0]["herald"]["kv_budget"]
    same = {"prompt": "hi", "max_tokens": 4, "steps": 2, "budget": budget, "kv_budget": budget}
    r = client.post("/v1/completions", json=same)
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={**same, "kv_budget": budget / 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_budget", r.text
    assert "differ" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={**same, "budget": None})  # null: not given
    assert r.status_code == 200, r.text


NULLABLE = ("n", "temperature", "top_p", "top_k", "min_tokens", "stop", "stop_token_ids", "seed",
            "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "stream",
            "stream_options", "threshold", "steps", "mode", "budget", "model", "logprobs",
            "presence_penalty", "user")  # fmt: skip


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_null_is_the_default(
    client: httpx.Client, captured: list[SamplingParams], route: str
) -> None:
    """null in an optional field is its default, as in OpenAI's API (``"n": null`` is n = 1):
    the engine gets the request it gets without the field, the reply is the same; a required
    field is still refused as null."""
    chat = route.endswith("chat/completions")
    source = "messages" if chat else "prompt"
    base: dict[str, Any] = {source: [{"role": "user", "content": "hi"}] if chat else "hi"}
    base["max_tokens"] = 8
    nulls = dict.fromkeys(NULLABLE + (("top_logprobs", "add_generation_prompt") if chat else
                                      ("echo", "suffix")))  # fmt: skip
    replies = [client.post(route, json=body) for body in (base, {**base, **nulls})]
    assert [r.status_code for r in replies] == [200, 200], replies[1].text
    texts = [r.json()["choices"][0]["message" if chat else "text"] for r in replies]
    assert texts[0] == texts[1] and captured[0] == captured[1]
    both = {**base, "max_tokens": None, "max_completion_tokens": 8}  # null: not given
    assert client.post(route, json=both).status_code == 200
    assert captured[2] == captured[0]
    options = {"include_usage": None, "continuous_usage_stats": None}
    chunks = _post_stream(client, route, {**base, "stream_options": options})
    assert chunks and all("usage" not in c for c in chunks)  # include_usage: false
    r = client.post(route, json={**base, source: None})
    assert r.status_code == 400 and r.json()["error"]["param"] == source, r.text


def test_an_unknown_chat_role_is_refused(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "bogus", "content": "x"}]})
    assert r.status_code == 400 and "unknown role 'bogus'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("messages")


def test_a_body_sent_as_another_type_says_it_must_be_json(client: httpx.Client) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}  # curl -d's default
    r = client.post("/tokenize", content='{"prompt": "x"}', headers=form)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert "application/json" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"")  # no body, no type
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert client.get("/v1/models").json()["data"][0]["created"] > 1_700_000_000


def test_booleans_and_integers_are_not_coerced(client: httpx.Client) -> None:
    """``max_tokens: true`` is not 1 and ``stream: "yes"`` is not true: a 400 names the field."""
    for body, field in [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4, "stream": "yes"}, "stream"),
        ({"prompt": "x", "max_tokens": 4, "echo": 1}, "echo"),
        ({"prompt": "x", "max_tokens": 4, "seed": "7"}, "seed"),
    ]:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": False})
    assert ok.status_code == 200, ok.text


def test_validation_errors_name_the_real_place(client: httpx.Client) -> None:
    """An empty JSON body says so; a content part that fits no union member names the field
    of the member that took its shape (the part's ``text``), not the other member's tag."""
    r = client.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "no body" in r.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages.0.content.0.text", err
