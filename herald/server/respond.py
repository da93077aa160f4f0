"""The answer to a completion or chat request: one JSON body, or Server-Sent Events.

A stream sends, per choice, an ``echo`` chunk first (completions with ``echo``), then one chunk
per completed block (its text delta, ``token_ids`` and logprobs), the last with the choice's
``finish_reason``; with ``stream_options.include_usage`` every chunk has ``"usage": null`` (or
its choice's running usage with ``continuous_usage_stats``) and a final chunk with empty
``choices`` carries the request's ``usage``; then ``data: [DONE]``. A stream that fails ends
with an error event in the API's error shape, then ``data: [DONE]``; so does one cut by the
server's shutdown timeout (:class:`EventStream`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from herald.server.errors import SHUTTING_DOWN, error_body, error_response
from herald.server.generation import Choice, Disconnected, Event, Failed, events
from herald.server.render import TokenPieces, chat_logprobs, completion_logprobs, usage
from herald.server.state import ServerState


@dataclass
class Reply:
    """What the answer needs: the choices, the response's ``id``/``created``/``model``, the
    route, and the request's output switches."""

    state: ServerState
    choices: list[Choice]
    meta: dict[str, Any]
    chat: bool
    logprobs: bool
    include_usage: bool = False
    continuous_usage: bool = False
    skip_special_tokens: bool = False

    def __post_init__(self) -> None:
        self.pieces = TokenPieces(
            self.state.tokenizer, skip_special_tokens=self.skip_special_tokens
        )

    @staticmethod
    def new_meta(
        state: ServerState, model: str | None, created: int, *, chat: bool
    ) -> dict[str, Any]:
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": created,
            "model": model or state.model_name,
        }

    def usage(self) -> dict[str, int]:
        prompt = sum(len(c.prompt_ids) for c in self.choices)
        return usage(prompt, sum(c.num_tokens for c in self.choices))

    def scores(self, c: Choice, start: int, ids: list[int], lps: list[float],
               tops: list[Any]) -> dict[str, Any] | None:  # fmt: skip
        """The logprobs object of ``c``'s emitted tokens ``start ..`` (``ids``), or None."""
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.pieces, ids, lps, tops)
        base = len(c.echo or "")
        offsets = self.pieces.offsets(c.stream.kept_ids)[start : start + len(ids)]
        return completion_logprobs(self.pieces, ids, lps, tops, [base + o for o in offsets])


async def complete(reply: Reply, request: Request) -> Response:
    """The non-streamed answer: wait for every choice to finish."""
    state = reply.state
    try:
        async for _ in events(state, reply.choices, request):
            pass
    except Failed as e:
        state.metrics.requests.labels("error").inc()
        return error_response(500, f"internal error in this request: {e}")
    except Disconnected:
        state.metrics.requests.labels("aborted").inc()
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    except asyncio.CancelledError:
        # The graceful shutdown ran out of time and cancelled the requests still running (their
        # engine work was aborted as events() ended): an answer in the API's error shape, not a
        # bare 500 and a logged traceback.
        state.metrics.requests.labels("aborted").inc()
        return error_response(503, SHUTTING_DOWN, code="server_shutting_down")
    state.metrics.requests.labels("ok").inc()
    out = []
    for c in reply.choices:
        ids = c.stream.kept_ids
        n = len(ids)
        choice: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish,
            "stop_reason": c.stop_reason,
            "logprobs": reply.scores(c, 0, ids, c.logprobs[:n], c.tops[:n]),
        }
        if reply.chat:
            choice["message"] = {"role": "assistant", "content": c.stream.text}
        else:
            choice["text"] = (c.echo or "") + c.stream.text
        choice["token_ids"] = ids  # herald extension
        out.append(choice)
    obj = "chat.completion" if reply.chat else "text_completion"
    return JSONResponse({**reply.meta, "object": obj, "choices": out, "usage": reply.usage()})


def _chunk(reply: Reply, c: Choice, ev: Event | None, first: bool) -> dict[str, Any]:
    """The SSE chunk of ``ev`` (None: ``c``'s echo chunk)."""
    choice: dict[str, Any] = {"index": c.index}
    text = (c.echo or "") if ev is None else ev.text
    if reply.chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
        choice["token_ids"] = ev.ids if ev is not None else []  # herald extension
    if ev is None:
        choice["logprobs"], choice["finish_reason"], choice["stop_reason"] = None, None, None
    else:
        choice["logprobs"] = reply.scores(c, ev.start, ev.ids, ev.logprobs, ev.tops)
        choice["finish_reason"] = ev.finish
        choice["stop_reason"] = c.stop_reason if ev.finish is not None else None
    obj = "chat.completion.chunk" if reply.chat else "text_completion"
    chunk = {**reply.meta, "object": obj, "choices": [choice]}
    if reply.include_usage:
        chunk["usage"] = usage(len(c.prompt_ids), c.num_tokens) if reply.continuous_usage else None
    return chunk


_DONE = "data: [DONE]\n\n"
"""A stream's last event."""


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse(reply: Reply) -> AsyncIterator[str]:
    """The SSE body (module docstring)."""
    state = reply.state
    started: set[int] = set()
    try:
        for c in reply.choices:
            if c.echo is not None:
                started.add(c.index)
                yield _data(_chunk(reply, c, None, True))
        async for ev in events(state, reply.choices, None):
            if not (ev.text or ev.ids or ev.finish is not None):
                continue  # a block whose text is all held back (a stop string may start there)
            first = ev.choice.index not in started
            started.add(ev.choice.index)
            yield _data(_chunk(reply, ev.choice, ev, first))
        state.metrics.requests.labels("ok").inc()
        if reply.include_usage:
            obj = "chat.completion.chunk" if reply.chat else "text_completion"
            yield _data({**reply.meta, "object": obj, "choices": [], "usage": reply.usage()})
    except (asyncio.CancelledError, GeneratorExit):
        # the client went away mid-stream (Starlette cancels the body), or the shutdown timeout
        # cancelled the request (EventStream ends the stream); events() aborted the engine
        # requests
        state.metrics.requests.labels("aborted").inc()
        raise
    except Failed as e:
        state.metrics.requests.labels("error").inc()
        yield _data(error_body(500, f"internal error in this request: {e}"))
    finally:
        for c in reply.choices:  # when the body ended before events() began
            if c.finish is None and c.handle is not None:
                state.engine_loop.cancel(c.handle)
    yield _DONE


class EventStream(StreamingResponse):
    """The SSE response of :func:`sse`, which ends cleanly when the graceful shutdown runs out
    of time.

    uvicorn cancels the requests still running then. A plain ``StreamingResponse`` lets the
    ``CancelledError`` out, which uvicorn logs as an "Exception in ASGI application" traceback
    before it drops the connection; the client sees a stream cut short with no reason. Here the
    stream ends as a non-streamed request cut so is answered: an error event of code
    ``server_shutting_down`` (a 503's body), then ``data: [DONE]``; the one line logged is
    herald's warning that the shutdown cut N requests (:func:`~herald.server.launch.make_server`
    turns uvicorn's ERROR line into it). A client's disconnect does not come here:
    Starlette ends the body itself then, the request's task is not cancelled.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = ended = False

        async def tracked(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body":
                ended = ended or bytes(message.get("body", b"")).endswith(_DONE.encode())
            await send(message)

        try:
            await super().__call__(scope, receive, tracked)
        except asyncio.CancelledError:
            if not started:
                start = {"type": "http.response.start", "status": self.status_code}
                await send({**start, "headers": self.raw_headers})
            tail = b""
            if not ended:
                err = error_body(503, SHUTTING_DOWN, code="server_shutting_down")
                tail = (_data(err) + _DONE).encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
