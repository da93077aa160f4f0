"""Request fields that OpenAI and vLLM clients send and herald does not implement.

Each is either *ignored* (it asks for nothing herald would do differently: ``user``,
``metadata``, ...) or *neutral-only*: accepted when it has a value that asks for nothing (a
penalty of 0, an empty ``logit_bias``, ``n`` = 1 ...) and otherwise refused with a 400 that names
it. :func:`check` runs before a request model validates, so a field listed here never reaches the
model; a field that is neither here nor on the model is unknown and refused as such (the models
forbid extra fields). docs/API.md has the same lists in prose.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

REFUSED = "herald_refused"
"""The pydantic error type of a refused field; its ``ctx["param"]`` names the field."""


@dataclass(frozen=True)
class Neutral:
    """A field accepted only with one of ``values``; ``why`` says what herald lacks."""

    values: tuple[Any, ...]
    why: str

    def accepts(self, value: Any) -> bool:
        # bool is an int in Python: ``True`` must not pass for 1, nor ``0`` for False
        return any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.values
        )


_NO_PENALTY = "herald's sampler has no penalties"
_NO_TOOLS = "herald does not call tools or functions"
_NO_GUIDED = "herald has no guided (structured) decoding"
_NONE = (None,)

IGNORED_COMMON = frozenset({"user", "request_id", "cache_salt", "return_token_ids"})
"""Accepted and ignored on both routes: they name or tag a request (herald keeps no record), or
ask for what herald always does (``return_token_ids``: every response carries ``token_ids``)."""

IGNORED_CHAT = frozenset(
    {"metadata", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls"}
)
"""Accepted and ignored on chat completions."""

NEUTRAL_COMMON: dict[str, Neutral] = {
    "presence_penalty": Neutral((0, None), _NO_PENALTY),
    "frequency_penalty": Neutral((0, None), _NO_PENALTY),
    "repetition_penalty": Neutral((1, None), _NO_PENALTY),
    "length_penalty": Neutral((1, None), "herald has no beam search"),
    "use_beam_search": Neutral((False, None), "herald has no beam search"),
    "logit_bias": Neutral(({}, None), "herald's sampler takes no logit bias"),
    "min_p": Neutral((0, None), "herald's sampler has no min_p filter (top_k and top_p only)"),
    "allowed_token_ids": Neutral((None,), "herald's sampler cannot restrict the vocabulary"),
    "bad_words": Neutral(([], None), "herald's sampler cannot ban words"),
    "logits_processors": Neutral(_NONE, "herald runs no custom logits processors"),
    "prompt_logprobs": Neutral(_NONE, "herald does not score prompt tokens"),
    "truncate_prompt_tokens": Neutral(_NONE, "herald does not truncate prompts"),
    "spaces_between_special_tokens": Neutral((True, None), "herald's decode has no such switch"),
    "add_special_tokens": Neutral(
        (False, None), "herald never adds special tokens to a prompt (send them in the text)"
    ),
    "response_format": Neutral(({"type": "text"}, None), _NO_GUIDED),
    "guided_json": Neutral(_NONE, _NO_GUIDED),
    "guided_regex": Neutral(_NONE, _NO_GUIDED),
    "guided_choice": Neutral(_NONE, _NO_GUIDED),
    "guided_grammar": Neutral(_NONE, _NO_GUIDED),
    "guided_decoding_backend": Neutral(_NONE, _NO_GUIDED),
    "guided_whitespace_pattern": Neutral(_NONE, _NO_GUIDED),
    "structured_outputs": Neutral(_NONE, _NO_GUIDED),
    "priority": Neutral((0, None), "herald admits requests first come, first served"),
    "kv_transfer_params": Neutral(_NONE, "herald does not transfer KV between servers"),
    "vllm_xargs": Neutral(_NONE, "herald takes no extra sampling arguments"),
    "return_tokens_as_token_ids": Neutral((False, None), "token ids come in token_ids instead"),
    "best_of": Neutral((1, None), "herald returns one choice per prompt (n = 1)"),
}
"""Neutral-only on both routes."""

NEUTRAL_COMPLETIONS: dict[str, Neutral] = {
    "suffix": Neutral(("", None), "herald does not insert text before a suffix"),
    "prompt_embeds": Neutral(_NONE, "herald takes prompts as text or token ids only"),
}
"""Neutral-only on completions."""

NEUTRAL_CHAT: dict[str, Neutral] = {
    "tools": Neutral(([], None), _NO_TOOLS),
    "tool_choice": Neutral(("none", None), _NO_TOOLS),
    "functions": Neutral(([], None), _NO_TOOLS),
    "function_call": Neutral(("none", None), _NO_TOOLS),
    "modalities": Neutral((["text"], None), "herald generates text only"),
    "audio": Neutral(_NONE, "herald generates text only"),
    "prediction": Neutral(_NONE, "herald takes no predicted output"),
    "reasoning_effort": Neutral(_NONE, "herald's models have no reasoning switch"),
    "verbosity": Neutral(_NONE, "herald's models have no verbosity switch"),
    "web_search_options": Neutral(_NONE, "herald does not search the web"),
    "store": Neutral((False, None), "herald stores nothing"),
    "echo": Neutral((False, None), "chat completions do not echo (completions do)"),
    "continue_final_message": Neutral((False, None), "herald always starts a new message"),
    "documents": Neutral(_NONE, "herald's chat templates take no documents"),
    "chat_template": Neutral(_NONE, "herald uses the checkpoint's chat template"),
    "chat_template_kwargs": Neutral(({}, None), "herald uses the checkpoint's chat template"),
    "mm_processor_kwargs": Neutral(_NONE, "herald's models are text only"),
}
"""Neutral-only on chat completions."""

IGNORED_MESSAGE = frozenset({"refusal", "annotations", "reasoning_content", "reasoning"})
"""Accepted and ignored in a chat message (what a client copies from an earlier reply)."""

NEUTRAL_MESSAGE: dict[str, Neutral] = {
    "tool_calls": Neutral(([], None), _NO_TOOLS),
    "function_call": Neutral(_NONE, _NO_TOOLS),
    "tool_call_id": Neutral(_NONE, _NO_TOOLS),
    "audio": Neutral(_NONE, "herald's models are text only"),
}
"""Neutral-only in a chat message."""


def refuse(param: str | None, message: str) -> PydanticCustomError:
    """A validation error that becomes a 400 naming ``param`` (below the error's location)."""
    return PydanticCustomError(REFUSED, message, {"param": param})


def _json(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check(data: Any, ignored: frozenset[str], neutral: Mapping[str, Neutral]) -> Any:
    """``data`` without its ``ignored`` fields and its ``neutral`` fields at a neutral value;
    raises :func:`refuse`'s error for a ``neutral`` field at any other value. Non-dict ``data``
    passes unchanged (the model reports it)."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        if key in ignored:
            continue
        rule = neutral.get(key)
        if rule is None:
            out[key] = value
        elif not rule.accepts(value):
            shown = ", ".join(_json(v) for v in rule.values)
            raise refuse(key, f"{_json(value)} is not supported: {rule.why} (accepted: {shown})")
    return out
