"""The OpenAI error shape, and pydantic validation errors mapped onto it."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from herald.server.fields import REFUSED

RETRY_AFTER_SECONDS = 1
"""The ``Retry-After`` of a 503: the queue drains at block boundaries, a fraction of a second."""


SHUTTING_DOWN = "the server shut down before this request finished"
"""The message of a request cut by the graceful shutdown's timeout (code ``server_shutting_down``:
a 503, or a stream's error event)."""


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error shape ``{"error": {"message", "type", "param", "code"}}`` of an error
    of HTTP ``status`` (also what a stream sends as its error event)."""
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        503: "overloaded_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """:func:`error_body` with HTTP ``status``."""
    body = error_body(status, message, param=param, code=code)
    # 503: the waiting queue is full (or the engine is dead); clients back off and retry
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _is_tag(segment: Any) -> bool:
    """A location segment naming a union member's type (``str``, ``list[ContentPart]``,
    ``function-after[...]``), not a field or an index."""
    return isinstance(segment, str) and (
        segment in _TYPE_TAGS or "[" in segment or "-" in segment or segment[:1].isupper()
    )


def _pre_tag(error: dict[str, Any]) -> tuple[Any, ...]:
    loc = tuple(error.get("loc", ()))
    for i, segment in enumerate(loc):
        if _is_tag(segment):
            return loc[:i]
    return loc


def _location(error: dict[str, Any]) -> str | None:
    loc = [str(x) for x in error.get("loc", ()) if x != "body" and not _is_tag(x)]
    ctx = error.get("ctx") or {}
    if error.get("type") == REFUSED and ctx.get("param"):
        loc.append(str(ctx["param"]))
    return ".".join(loc) or None


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """(message, param) for a request that failed validation: every unknown field named at
    once, else the first error, its field as ``param``."""
    if not errors:
        return "invalid request", None
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        names = [_location(e) or "?" for e in unknown]
        listed = ", ".join(repr(n) for n in names)
        what = "field" if len(names) == 1 else "fields"
        return (
            f"unknown {what} {listed}: not an OpenAI or vLLM request field this server knows "
            "(docs/API.md lists them)",
            names[0],
        )
    e = errors[0]
    if e.get("type") == "json_invalid":
        return "malformed JSON body", None
    if e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",):
        return "the request has no body: send a JSON object", None
    if _pre_tag(e) != tuple(e.get("loc", ())):
        # a value that fit none of a union's types: each member reports an error at the same
        # place; the deepest one is the member that took the input's shape (a list of content
        # parts, not a string), so it names the field actually missing or wrong
        same = [x for x in errors if _pre_tag(x) == _pre_tag(e)]
        e = max(same, key=lambda x: len(x.get("loc", ())))
    param = _location(e)
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
