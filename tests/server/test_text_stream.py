"""TextStream (stop strings, the emitted tokens, min_tokens), token pieces for logprobs, and the
field tables, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from herald.models.loader import bundled_checkpoint, load_config
from herald.models.registry import get_preset
from herald.models.tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer
from herald.server.errors import validation_message
from herald.server.protocol import ChatCompletionRequest, CompletionRequest
from herald.server.render import TokenPieces, chat_logprobs, completion_logprobs
from herald.server.text import TextStream


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """The embedded model's real byte-level BPE tokenizer (multi-character tokens)."""
    return load_tokenizer(bundled_checkpoint("code-sdar"), load_config("code-sdar"))


def _feed(stream: TextStream, ids: list[int], size: int) -> str:
    out = "".join(stream.feed(ids[i : i + size]) for i in range(0, len(ids), size))
    return out + stream.finish()


def test_stop_string_keeps_the_tokens_whose_text_is_emitted(bpe: Tokenizer) -> None:
    text = "def hello_world(x):\n    return x + 1\n"
    ids = bpe.encode(text)
    s = TextStream(bpe, ["world"])
    assert _feed(s, ids, 32) == "def hello_"
    k = s.num_kept
    # the fewest leading tokens whose text holds the returned text
    assert bpe.decode(ids[:k]).startswith("def hello_")
    assert not bpe.decode(ids[: k - 1]).startswith("def hello_")
    assert s.kept_ids == ids[:k] and k < len(ids)
    # a stop string starting inside a token keeps that token
    inside = TextStream(bpe, ["ello"])
    assert _feed(inside, ids, 4) == "def h"
    assert bpe.decode(inside.kept_ids).startswith("def h")
    assert len(bpe.decode(inside.kept_ids)) > len("def h")  # " hello" is split by the cut
    # at the very start: nothing is emitted
    none = TextStream(bpe, ["def"])
    assert _feed(none, ids, 8) == "" and none.num_kept == 0
    # no stop: every token counts
    plain = TextStream(bpe, ["zzz"])
    assert _feed(plain, ids, 3) == text and plain.num_kept == len(ids)


def test_ids_wait_with_their_held_back_text(bpe: Tokenizer) -> None:
    """Block 1 ends with text that may start a stop string: it is held back, and so are the
    ids whose text it is (a stream sends ``ids[:num_ready]``). When block 2 completes the stop
    string, the ids sent never exceed the emitted tokens; when it does not, all go out."""
    text = "def hello_world(x):\n    return x + 1\n"
    ids = bpe.encode(text)
    split = next(k for k in range(1, len(ids)) if bpe.decode(ids[:k]).endswith("hello"))
    stop = "hello_world"  # starts in block 1 ("...hello"), ends in block 2
    s = TextStream(bpe, [stop])
    out = s.feed(ids[:split])
    assert out == "def " and s.num_ready < split
    assert bpe.decode(ids[: s.num_ready]) == "def"  # ids whose whole text went out (not " he")
    sent = s.num_ready
    assert s.feed(ids[split:]) == "" and s.stopped
    assert sent <= s.num_ready == s.num_kept
    assert bpe.decode(s.kept_ids).startswith("def ")
    other = TextStream(bpe, ["hello_there"])  # held back too, but it is no stop
    assert other.feed(ids[:split]) == "def " and other.num_ready < split
    assert other.feed(ids[split:]) == text[len("def ") :] and other.num_ready == len(ids)


def test_include_stop_and_the_first_of_several(bpe: Tokenizer) -> None:
    ids = bpe.encode("alpha beta gamma beta")
    s = TextStream(bpe, ["gamma", "beta"], include_stop=True)
    assert _feed(s, ids, 2) == "alpha beta"
    assert bpe.decode(s.kept_ids) == "alpha beta"


def test_min_tokens_ignores_stop_strings_inside_the_first_tokens(bpe: Tokenizer) -> None:
    ids = bpe.encode("x = 1\nx = 2\nx = 3\n")
    head = bpe.decode(ids[:3])
    s = TextStream(bpe, ["x"], min_tokens=3)
    out = _feed(s, ids, 1)
    assert out.startswith(head) and len(out) < len(bpe.decode(ids))
    assert s.num_kept >= 3
    assert _feed(TextStream(bpe, ["x"]), ids, 1) == ""


def test_skip_special_tokens() -> None:
    tok = byte_level_tokenizer(get_preset("tiny-sdar"))
    ids = tok.encode("a<|im_end|>b")
    assert _feed(TextStream(tok), ids, 1) == "a<|im_end|>b"
    assert _feed(TextStream(tok, skip_special_tokens=True), ids, 1) == "ab"
    assert TokenPieces(tok, skip_special_tokens=True).offsets(ids) == [0, 1, 1]


def test_token_pieces_and_logprob_shapes(bpe: Tokenizer) -> None:
    ids = bpe.encode("héllo → wörld")
    pieces = TokenPieces(bpe)
    assert b"".join(pieces.bytes_of(i) for i in ids).decode() == "héllo → wörld"
    offsets = pieces.offsets(ids)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    lps = [-0.5] * len(ids)
    tops = [[(i, -0.5), (ids[0], -1.0)] for i in ids]
    comp = completion_logprobs(pieces, ids, lps, tops, offsets)
    assert comp["tokens"][0] == "h" and comp["token_logprobs"] == lps
    assert comp["top_logprobs"][0] == {"h": -0.5}  # one text twice: the likelier stays
    assert comp["top_logprobs"][1] == {pieces.text_of(ids[1]): -0.5, "h": -1.0}
    assert completion_logprobs(pieces, ids, lps, [], offsets)["top_logprobs"] is None
    chat = chat_logprobs(pieces, ids, [float("-inf")] + lps[1:], tops)
    first = chat["content"][0]
    assert first["token"] == "h" and first["bytes"] == [ord("h")] and first["logprob"] < -1e3
    assert [t["token"] for t in first["top_logprobs"]] == ["h", "h"]


def _error(model: type, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_message(list(e.value.errors()))


def test_field_refusals_name_the_field() -> None:
    msg, param = _error(CompletionRequest, {"prompt": "x", "presence_penalty": 0.5})
    assert param == "presence_penalty" and "no penalties" in msg
    msg, param = _error(CompletionRequest, {"prompt": "x", "best_of": True})  # not 1
    assert param == "best_of"
    msg, param = _error(CompletionRequest, {"prompt": "x", "zz": 1, "yy": 2})
    assert param == "zz" and "'yy'" in msg
    msg, param = _error(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x",
                                                              "tool_call_id": "7"}]})  # fmt: skip
    assert param == "messages.0.tool_call_id"
    msg, param = _error(CompletionRequest, {"prompt": [True]})
    assert param == "prompt"
    ok = CompletionRequest.model_validate({"prompt": "x", "user": "u", "best_of": 1})
    assert ok.prompt == ["x"]
    assert CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompt == [[1, 2], [3]]
