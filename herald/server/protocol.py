"""OpenAI- and vLLM-compatible request bodies (pydantic).

Validation lives here so that every bad field becomes a 400 in OpenAI's error shape
(:mod:`herald.server.errors`). The models forbid unknown fields; the fields clients send that
herald does not implement are in :mod:`herald.server.fields` (ignored, or accepted only at a
value that asks for nothing). docs/API.md documents every field.

Herald's extensions: ``threshold`` (confidence-threshold acceptance, in (0, 1]) or ``steps``
(fixed-steps mode: denoising steps per block; not both; a request without either denoises as the
server's :class:`~herald.server.defaults.DenoiseDefaults`), ``mode`` (one of :data:`MODES`; the
server runs one, chosen at launch, and the route refuses any other) and ``budget`` (alias
``kv_budget``, in (0, 1]: the fraction of the prefix each block attends to; fixed at launch, so
it must equal the server's). ``temperature`` defaults to 0 (greedy, deterministic).

Null in an optional field is that field's default (``"n": null`` is n = 1, ``"temperature":
null`` greedy), as in OpenAI's API, which marks its optional fields nullable; a required field
(``prompt``, ``messages``, a message's ``role``) is still refused as null.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from herald.config import MAX_DENOISE_STEPS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS, SamplingParams
from herald.engines import MODES
from herald.server import fields
from herald.server.defaults import DENOISE_DEFAULTS, DenoiseDefaults
from herald.server.fields import Neutral, refuse

MAX_LOGPROBS = MAX_TOP_LOGPROBS
"""Most alternatives per token that ``logprobs`` / ``top_logprobs`` may ask for."""
MAX_STOPS = 4
"""Most stop strings per request."""


class _Body(BaseModel):
    """A request body or a part of one: unknown fields are refused, null is a field's default."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _defaulted(cls)}


def _defaulted(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` with a default other than None (a field whose default is None
    takes null as it is; a required one has no default to stand for null)."""
    return frozenset(
        name
        for name, info in model.model_fields.items()
        if not info.is_required() and info.default is not None
    )


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with empty ``choices`` and the
    ``usage`` (every other chunk has ``"usage": null``); ``continuous_usage_stats`` (with it)
    puts the running usage of its choice in every chunk instead of null."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


_TWO_NAMES = (("max_tokens", "max_completion_tokens"), ("budget", "kv_budget"))
"""Fields a request may name either way: (name, alias)."""


class _Common(_Body):
    """Fields shared by completions and chat completions."""

    IGNORED: ClassVar[frozenset[str]] = fields.IGNORED_COMMON
    NEUTRAL: ClassVar[Mapping[str, Neutral]] = fields.NEUTRAL_COMMON

    model: str | None = None
    max_tokens: StrictInt | None = Field(
        default=None, gt=0, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=0, ge=-1)
    min_tokens: StrictInt = Field(default=0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = False
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    threshold: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    steps: StrictInt | None = Field(default=None, gt=0, le=MAX_DENOISE_STEPS)
    mode: str | None = None
    budget: float | None = Field(
        default=None, gt=0.0, le=1.0, allow_inf_nan=False,
        validation_alias=AliasChoices("budget", "kv_budget"),
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        for name, alias in _TWO_NAMES:
            if isinstance(data, dict) and name in data and alias in data:
                # the two names of one field: equal values are one request, different ones a
                # 400; a null one is not given
                given = data[name], data[alias]
                if None not in given and given[0] != given[1]:
                    raise refuse(alias, f"{name} and {alias} name one field and differ here: "
                                 "give one of them")  # fmt: skip
                drop = alias if given[1] is None else name
                data = {k: v for k, v in data.items() if k != drop}
        return fields.check(data, cls.IGNORED, cls.NEUTRAL)

    @model_validator(mode="after")
    def _stream_options(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "stream_options is only allowed with stream = true")
        return self

    @model_validator(mode="after")
    def _one_denoising_mode(self) -> _Common:
        if self.steps is not None and self.threshold is not None:  # as herald serve's flags
            raise refuse("steps", "give steps (fixed-steps mode, which uses no threshold) or "
                         "threshold (threshold mode), not both")  # fmt: skip
        return self

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str | None) -> str | None:
        if v is not None and v not in MODES:
            raise ValueError(f"unknown mode {v!r}; the modes are {', '.join(MODES)}")
        return v

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(
                "only n = 1 is supported: send the request n times (a completion also takes a "
                "list of prompts)"
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and
                                           self.stream_options.continuous_usage_stats)  # fmt: skip

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else the number of alternatives per token (0: the token's own)."""
        return None

    def sampling_params(
        self, max_tokens: int, denoise: DenoiseDefaults = DENOISE_DEFAULTS
    ) -> SamplingParams:
        """The engine's parameters of this request; ``threshold`` and ``steps`` as
        :meth:`DenoiseDefaults.resolve` of ``denoise`` (the server's) gives them."""
        top = self.top_logprobs_wanted()
        threshold, steps = denoise.resolve(self.threshold, self.steps)
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(0, self.top_k),  # -1 (vLLM's "off") is 0 here
            top_p=self.top_p,
            threshold=threshold,
            num_denoise_steps=steps,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            top_logprobs=top or 0,
        )


def _prompts(v: Any) -> Any:
    """``prompt`` as a list of prompts: a string, a list of strings, a list of token ids or a
    list of lists of token ids; each non-empty."""
    if isinstance(v, str) or (isinstance(v, list) and v and all(type(x) is int for x in v)):
        v = [v]
    if not isinstance(v, list) or not v:
        raise ValueError(
            "a prompt is a non-empty string, a list of strings, a list of token ids or a list "
            "of lists of token ids"
        )
    for i, p in enumerate(v):
        which = "the prompt" if len(v) == 1 else f"prompt {i}"
        if not (isinstance(p, str) or (isinstance(p, list) and all(type(x) is int for x in p))):
            raise ValueError(f"{which} is neither a string nor a list of token ids")
        if not p:
            raise ValueError(f"{which} is empty: at least 1 character or token id")
    return v


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt per choice; ``echo`` prepends the prompt to its text;
    ``logprobs`` = the number of alternatives per token."""

    NEUTRAL: ClassVar[Mapping[str, Neutral]] = {**fields.NEUTRAL_COMMON,
                                                **fields.NEUTRAL_COMPLETIONS}  # fmt: skip

    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _echo_scores(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise refuse("logprobs", "logprobs with echo would score the prompt, which herald "
                         "does not do (prompt tokens are prefilled, never sampled)")  # fmt: skip
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class ContentPart(_Body):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles OpenAI's chat API defines; a model's chat template may still refuse some (tool)."""


class ChatMessage(_Body):
    """One message: ``content`` is text, a list of text parts, or null (an assistant's)."""

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return fields.check(data, fields.IGNORED_MESSAGE, fields.NEUTRAL_MESSAGE)

    @field_validator("role")
    @classmethod
    def _a_chat_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}: one of {', '.join(CHAT_ROLES)}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported (text only)"
                    )
        return v

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise refuse("content", f"a {self.role!r} message needs content (null is for an "
                         "assistant's only)")  # fmt: skip
        return self

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` (and ``"name"``) with text parts joined, as chat templates
        expect; null content is the empty string."""
        parts = self.content
        if parts is None:
            text = ""
        else:
            text = parts if isinstance(parts, str) else "".join(p.text for p in parts)
        out = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: at least one message; ``logprobs`` (bool) and
    ``top_logprobs`` (alternatives per token); ``add_generation_prompt`` (default true) cues
    the assistant's reply after the messages."""

    IGNORED: ClassVar[frozenset[str]] = fields.IGNORED_COMMON | fields.IGNORED_CHAT
    NEUTRAL: ClassVar[Mapping[str, Neutral]] = {**fields.NEUTRAL_COMMON, **fields.NEUTRAL_CHAT}

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise refuse("top_logprobs", "top_logprobs needs logprobs = true")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` (text) or chat ``messages`` (rendered with the chat
    template, as chat completions would); ``return_token_strs`` adds each token's text."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        names = ("continue_final_message", "chat_template", "chat_template_kwargs", "tools")
        neutral = {k: fields.NEUTRAL_CHAT[k] for k in names}
        neutral["add_special_tokens"] = fields.NEUTRAL_COMMON["add_special_tokens"]
        return fields.check(data, frozenset(), neutral)

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise refuse("prompt", "give either prompt or messages")
        return self


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids -> text."""

    model: str | None = None
    tokens: list[StrictInt]
