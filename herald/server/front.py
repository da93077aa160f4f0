"""The HTTP front: what a connection may do before a route sees its request.

Two guards, both bounded by :class:`~herald.server.defaults.FrontLimits`:

- :func:`guarded_h11` is the HTTP/1.1 protocol the server runs (uvicorn's h11 protocol plus a
  header timer): a connection whose request headers are not complete within
  ``header_timeout_s`` is closed. The timer starts when the connection opens, and on a kept-alive
  connection with the next request's first byte (an idle kept-alive connection is closed by
  uvicorn's ``timeout_keep_alive``). Sending a byte at a time does not extend it.
- :class:`FrontMiddleware` (ASGI) runs once the headers are in, before the body is read: it
  answers 401 when the path needs the API key and the request lacks it, 413 when Content-Length
  is above ``max_body_bytes``, then reads the body itself within ``body_timeout_s`` (408 after
  it) counting a chunked body's bytes (413 once above the limit), and hands the routes the whole
  body. Its errors are in the OpenAI shape and close the connection, since the rest of the body
  is never read; a refused request whose body is declared small (<= ``DRAIN_BYTES``) has it read
  and dropped first, within ``DRAIN_SECONDS`` (then the connection stays open), so the close
  does not reset a connection whose client has already sent its body.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from herald.server.defaults import FrontLimits

PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize")
"""Paths (and the paths under them) that need ``Authorization: Bearer <key>`` when the server
has an API key; ``/health`` and ``/metrics`` stay open."""


DRAIN_BYTES = 64 * 1024
"""A refused request's body up to this size is read (and dropped) before the refusal is sent."""
DRAIN_SECONDS = 1.0
"""How long a refused request's small body is waited for."""


def is_protected(path: str, protected: tuple[str, ...] = PROTECTED_PATHS) -> bool:
    return any(path == p or path.startswith(p + "/") for p in protected)


class _HeaderTimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _sync_header_timer(self) -> None:
        """Armed while part of a request's headers is buffered, disarmed once they are in."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()
        elif self.conn.trailing_data[0]:
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: h11 with a header deadline."""
    return type("HeraldH11Protocol", (_HeaderTimedH11,), {"header_timeout_s": header_timeout_s})


def key_matches(authorization: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header value carries ``api_key`` as a Bearer token (the
    scheme is case-insensitive; compared in constant time)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    )


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class FrontMiddleware:
    """ASGI middleware: API key, body size and body deadline before the routes (module doc).

    ``api_key`` is called per request (the server's key, or None for an open server)."""

    def __init__(
        self,
        app: ASGIApp,
        limits: FrontLimits,
        api_key: Callable[[], str | None],
        protected: tuple[str, ...] = PROTECTED_PATHS,
    ) -> None:
        self.app = app
        self.limits = limits
        self.api_key = api_key
        self.protected = protected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        declared = _declared_length(length)
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        has_body = chunked or (length is not None and declared != 0)
        refusal = self._refusal(scope, headers, length, declared)
        if refusal is not None:
            drained = has_body and await self._drain_small_body(receive, declared, chunked)
            await _reply(scope, receive, send, *refusal, close=has_body and not drained)
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            msg = f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
            await _reply(scope, receive, send, 408, msg, "request_timeout", close=True)
            return
        except _TooLarge:
            await _reply(scope, receive, send, *self._too_large(), close=True)
            return
        except _Disconnected:
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(
        self, scope: Scope, headers: Headers, length: str | None, declared: int | None
    ) -> tuple[int, str, str] | None:
        """(status, message, code) of a request refused on its headers alone, else None
        (``declared``: :func:`_declared_length` of the ``length`` header)."""
        key = self.api_key()
        path: str = scope["path"]
        authorization = headers.get("authorization", "")
        if (
            key is not None
            and is_protected(path, self.protected)
            and not key_matches(authorization, key)
        ):
            return 401, "invalid or missing API key", "invalid_api_key"
        if length is not None and declared is None:
            return 400, f"Content-Length {length!r} is not a number", "invalid_content_length"
        if declared is not None and declared > self.limits.max_body_bytes:
            return self._too_large()
        return None

    async def _drain_small_body(
        self, receive: Receive, declared: int | None, chunked: bool
    ) -> bool:
        """Read and drop a refused request's body when it is declared small (a Content-Length
        of at most :data:`DRAIN_BYTES`), waiting at most :data:`DRAIN_SECONDS` for it; True when
        all of it was read. NOTE: closing a connection with unread bytes in its receive buffer
        makes the kernel send a reset, which can reach the client before it has read the
        refusal (it then sees "connection reset" instead of the 401); a small body that came
        with the headers is read first. A large or late body is not waited for."""
        if chunked or declared is None or declared > min(DRAIN_BYTES, self.limits.max_body_bytes):
            return False
        try:
            async with asyncio.timeout(min(DRAIN_SECONDS, self.limits.body_timeout_s)):
                await self._read_body(receive)
        except (TimeoutError, _TooLarge, _Disconnected):
            return False
        return True

    def _too_large(self) -> tuple[int, str, str]:
        limit = self.limits.max_body_bytes
        return (
            413,
            f"the request body is larger than the server's limit of {limit} bytes",
            ("request_too_large"),
        )

    async def _read_body(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise _TooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the whole body once, then what the connection gives (disconnect)."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _declared_length(length: str | None) -> int | None:
    """A Content-Length header's value: its number, or None when it is absent or not a
    non-negative number."""
    if length is None:
        return None
    text = length.strip()
    return int(text) if text.isdigit() else None


async def _reply(
    scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str,
    *, close: bool,
) -> None:  # fmt: skip
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    response = JSONResponse(body, status_code=status)
    if close:  # the body was not read: the connection cannot carry another request
        response.headers["connection"] = "close"
    await response(scope, receive, send)


def install(app: Any, limits: FrontLimits, api_key: Callable[[], str | None]) -> None:
    """Put :class:`FrontMiddleware` in front of ``app``'s routes (a FastAPI / Starlette app)."""
    app.add_middleware(FrontMiddleware, limits=limits, api_key=api_key)
