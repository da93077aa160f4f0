"""OpenAI-compatible request bodies (pydantic) and the OpenAI error shape.

Validation lives here so that every bad field becomes a 400 with
``{"error": {"message", "type", "param", "code"}}``. Unknown fields are ignored. Herald's
extensions: ``threshold`` (confidence-threshold acceptance, in (0, 1]), ``steps`` (fixed-steps
mode: denoising steps per block), ``mode`` (one of :data:`MODES`; the server runs one, chosen at
launch, and the route refuses any other) and ``budget`` (alias ``kv_budget``, in (0, 1]: the
fraction of the prefix each block attends to; fixed at launch, so it must equal the server's).
``temperature`` defaults to 0 (greedy, deterministic).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from herald.config import MAX_DENOISE_STEPS, MAX_TEMPERATURE, SamplingParams
from herald.engines import MODES

RETRY_AFTER_SECONDS = 1
"""The ``Retry-After`` of a 503: the queue drains at block boundaries, a fraction of a second."""


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """An OpenAI-shaped error body with HTTP ``status``."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "overloaded_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    # 503: the waiting queue is full (or the engine is dead); clients back off and retry
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(
        default=None, gt=0, validation_alias=AliasChoices("max_completion_tokens", "max_tokens")
    )
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = 1
    stream: bool = False
    threshold: float = Field(default=0.95, gt=0.0, le=1.0, allow_inf_nan=False)
    steps: int | None = Field(default=None, gt=0, le=MAX_DENOISE_STEPS)
    mode: str | None = None
    budget: float | None = Field(
        default=None, gt=0.0, le=1.0, allow_inf_nan=False,
        validation_alias=AliasChoices("budget", "kv_budget"),
    )  # fmt: skip

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
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 4:
            raise ValueError("at most 4 stop strings")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            threshold=self.threshold,
            num_denoise_steps=self.steps,
            seed=self.seed,
        )


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is one non-empty string."""

    prompt: str = Field(min_length=1)


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(min_length=1)
    content: str | list[ContentPart]

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

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` with text parts joined, as chat templates expect."""
        parts = self.content
        text = parts if isinstance(parts, str) else "".join(p.text for p in parts)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: at least one message."""

    messages: list[ChatMessage] = Field(min_length=1)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) of the first pydantic error."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return "malformed JSON body", None
    msg = str(e.get("msg", "invalid value"))
    return (f"{param}: {msg}" if param else msg), param
