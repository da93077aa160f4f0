"""The FastAPI app: OpenAI-compatible routes over an :class:`EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (these
need ``Authorization: Bearer <key>`` when the server has an API key), ``GET /health`` and
``GET /metrics`` (always open). Streaming responses are Server-Sent Events with one chunk per
completed block, then ``data: [DONE]``. Errors use the OpenAI shape
(:func:`herald.server.protocol.error_response`): 400 bad input (including a ``mode`` or
``budget`` other than the server's, and a request too large for the context or the CPU KV pool
ever to run), 401 bad key, 404 unknown model, 503 waiting queue full (or the engine dead), 500 an
internal error in this request only. A client that disconnects has its request aborted, which
frees its engine slot and KV at the next block boundary.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from herald.config import SamplingParams
from herald.engine.scheduler import QueueFullError
from herald.kv.manager import RequestTooLarge
from herald.models.tokenizer import Tokenizer
from herald.server.chat import ChatTemplate, ChatTemplateError
from herald.server.engine_loop import EngineDeadError, EngineLoop, Handle
from herald.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from herald.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    error_response,
    validation_message,
)
from herald.server.text import TextStream

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
"""``max_tokens`` when the request gives none (OpenAI's default for completions)."""


@dataclass
class ServerState:
    """What the routes share: the engine loop, tokenizer, served model name and settings.

    The mode (dense, herald, mage or infinigen) and budget are the engine's, fixed at launch."""

    engine_loop: EngineLoop
    tokenizer: Tokenizer
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    chat_template: ChatTemplate | None = None

    def __post_init__(self) -> None:
        if self.chat_template is None:
            self.chat_template = ChatTemplate.for_model(self.model_name, self.tokenizer)

    @property
    def max_context(self) -> int:
        return self.engine_loop.engine.max_seq_len

    @property
    def mode(self) -> str:
        return self.engine_loop.engine.mode

    @property
    def kv_budget(self) -> float:
        return self.engine_loop.engine.kv_budget


class _Failed(Exception):
    """A request failed inside the engine (HTTP 500 for that request only)."""


class _Disconnected(Exception):
    """The client of a non-streamed request went away; its request is aborted."""


def create_app(state: ServerState) -> FastAPI:
    """Build the app; its lifespan starts and stops ``state.engine_loop``'s thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        yield
        state.engine_loop.stop()

    app = FastAPI(title="herald", lifespan=lifespan)
    app.state.herald = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(list(exc.errors()))
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    auth = [Depends(_auth_dependency(state))]
    _add_info_routes(app, state, auth)
    _add_generation_routes(app, state, auth)
    return app


def _auth_dependency(state: ServerState) -> Any:
    async def _auth(request: Request) -> None:
        # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware would hide the
        # client's disconnect from the route (needed to abort abandoned requests).
        if state.api_key is not None:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), state.api_key.encode()
            )
            if not ok:
                raise StarletteHTTPException(401, "invalid or missing API key")

    return _auth


def _not_served(state: ServerState, model_id: str) -> JSONResponse:
    return error_response(
        404, f"model {model_id!r} is not served here (try {state.model_name!r})",
        param="model", code="model_not_found",
    )  # fmt: skip


def _add_info_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """``/health``, ``/metrics`` (open) and ``/v1/models`` (behind ``auth``)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.engine_loop.is_alive():
            return error_response(503, "the engine thread is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.running.set(state.engine_loop.num_running)
        state.metrics.waiting.set(state.engine_loop.num_waiting)
        state.metrics.set_pools(state.engine_loop.engine.usage())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "herald",
            "max_model_len": state.max_context,
            "herald": {
                "mode": state.mode,
                "kv_budget": state.kv_budget,
                "block_size": state.engine_loop.engine.config.block_size,
            },
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> JSONResponse:
        if model_id != state.model_name:
            return _not_served(state, model_id)
        return JSONResponse(model_card())


def _add_generation_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(state, request, body, body.prompt, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        assert state.chat_template is not None
        try:
            prompt = state.chat_template.render([m.as_dict() for m in body.messages])
        except ChatTemplateError as e:
            return error_response(400, str(e), param="messages")
        return await _serve(state, request, body, prompt, chat=True)


MAX_CHARS_PER_TOKEN = 64
"""A prompt longer than this many characters per context token is refused before tokenizing."""


def _refusal(state: ServerState, body: _Common, prompt: str) -> JSONResponse | None:
    """The error response for a request this server does not run as asked, else None."""
    if body.model is not None and body.model != state.model_name:
        return _not_served(state, body.model)
    if body.mode is not None and body.mode != state.mode:
        return error_response(
            400, f"this server runs mode {state.mode!r}, not {body.mode!r}: one engine per "
            f"server, chosen at launch (herald serve --mode {body.mode})", param="mode",
        )  # fmt: skip
    if body.budget is not None and not math.isclose(body.budget, state.kv_budget, rel_tol=1e-9):
        return error_response(
            400, f"this server runs kv budget {state.kv_budget} (mode {state.mode!r}), not "
            f"{body.budget}: the budget is fixed at launch (herald serve --kv-budget)",
            param="budget",
        )  # fmt: skip
    ctx = state.max_context
    if len(prompt) > MAX_CHARS_PER_TOKEN * ctx:
        # NOTE: checked before tokenizing: a many-megabyte prompt would hold a worker thread
        # (and memory) for seconds only to be refused.
        return error_response(
            400, f"the prompt is {len(prompt)} characters, far more than the server's max "
            f"context of {ctx} tokens", param="prompt", code="context_length_exceeded",
        )  # fmt: skip
    return None


def _submit(state: ServerState, ids: list[int], params: SamplingParams) -> Handle | JSONResponse:
    """Queue the request in the engine, or the error response that refuses it."""
    try:
        return state.engine_loop.submit(ids, params, asyncio.get_running_loop())
    except RequestTooLarge as e:
        return error_response(400, str(e), param=e.param, code=e.code)
    except ValueError as e:
        return error_response(400, str(e))
    except (QueueFullError, EngineDeadError) as e:
        state.metrics.requests.labels("rejected").inc()
        return error_response(503, str(e))
    except Exception as e:  # an engine bug while queueing: this request fails, the server goes on
        log.exception("queueing a request failed")
        state.metrics.requests.labels("error").inc()
        return error_response(500, f"internal error in this request: {type(e).__name__}: {e}")


async def _serve(
    state: ServerState, request: Request, body: _Common, prompt: str, *, chat: bool
) -> Response:
    """Validate against the model, submit, and answer (JSON or SSE)."""
    refused = _refusal(state, body, prompt)
    if refused is not None:
        return refused
    ctx = state.max_context
    # Off the event loop: a long prompt's tokenization must not stall every other request.
    ids = await run_in_threadpool(state.tokenizer.encode, prompt)
    if not ids:
        return error_response(400, "the prompt is empty", param="prompt")
    if len(ids) >= ctx:
        return error_response(
            400, f"the prompt is {len(ids)} tokens, the server's max context is {ctx}",
            param="prompt", code="context_length_exceeded",
        )  # fmt: skip
    params = body.sampling_params(body.max_tokens or min(DEFAULT_MAX_TOKENS, ctx - len(ids)))
    try:
        params.validate()
    except ValueError as e:
        return error_response(400, str(e))
    handle = _submit(state, ids, params)
    if not isinstance(handle, Handle):
        return handle
    meta = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.model_name,
    }
    stream = TextStream(state.tokenizer, body.stop_list())
    if body.stream:
        return StreamingResponse(
            _sse(state, handle, stream, meta, chat=chat), media_type="text/event-stream"
        )
    return await _complete(state, request, handle, stream, meta, len(ids), chat=chat)


async def _complete(
    state: ServerState, request: Request, handle: Handle, stream: TextStream,
    meta: dict[str, Any], num_prompt: int, *, chat: bool,
) -> Response:  # fmt: skip
    """The non-streaming answer: wait for the whole completion."""
    try:
        finish = "length"
        async for _ids, _delta, reason in _events(state, handle, stream, request):
            finish = reason or finish
    except _Failed as e:
        state.metrics.requests.labels("error").inc()
        return error_response(500, f"internal error in this request: {e}")
    except _Disconnected:
        state.metrics.requests.labels("aborted").inc()
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    state.metrics.requests.labels("ok").inc()
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": stream.text}
    else:
        choice["text"] = stream.text
    choice["token_ids"] = stream.ids  # herald extension
    usage = {
        "prompt_tokens": num_prompt,
        "completion_tokens": len(stream.ids),
        "total_tokens": num_prompt + len(stream.ids),
    }
    obj = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": usage})


async def _events(
    state: ServerState, handle: Handle, stream: TextStream, request: Request | None
) -> AsyncIterator[tuple[list[int], str, str | None]]:
    """Yield (block ids, text delta, finish reason or None) until the request ends.

    Aborts the engine request when the consumer stops early (disconnect, cancellation, stop
    string). Raises :class:`_Failed` when the engine reported an error for this request.
    """
    done = False
    checked = time.monotonic()
    try:
        while not done:
            try:
                kind, val = await asyncio.wait_for(handle.queue.get(), timeout=0.5)
            except TimeoutError:
                kind, val = "", None
            # Non-streaming: poll for a client that went away (streams are cancelled instead).
            if request is not None and time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise _Disconnected
            if not kind:
                continue
            if kind == "error":
                done = True
                raise _Failed(f"{type(val).__name__}: {val}")
            if kind == "done":
                done = True
                yield [], stream.finish(), str(val)
            else:
                delta = stream.feed(val)
                if stream.stopped:
                    done = True
                    yield val, delta, "stop"
                else:
                    yield val, delta, None
    finally:
        if not done:
            state.engine_loop.cancel(handle)
        elif stream.stopped:
            state.engine_loop.cancel(handle)  # a stop string ended it early: free the slot


async def _sse(
    state: ServerState, handle: Handle, stream: TextStream, meta: dict[str, Any], *, chat: bool
) -> AsyncIterator[str]:
    """The SSE body: one chunk per completed block, a final chunk, then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = True
    try:
        async for ids, delta, reason in _events(state, handle, stream, None):
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
            if chat:
                choice["delta"] = {"content": delta}
                if first:
                    choice["delta"]["role"] = "assistant"
            else:
                choice["text"] = delta
                choice["token_ids"] = ids  # herald extension
            first = False
            yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice]})}\n\n"
        state.metrics.requests.labels("ok").inc()
    except (asyncio.CancelledError, GeneratorExit):
        # the client went away mid-stream: Starlette cancels the body; the request is aborted
        state.metrics.requests.labels("aborted").inc()
        raise
    except _Failed as e:
        state.metrics.requests.labels("error").inc()
        msg = f"internal error in this request: {e}"
        err = {"error": {"message": msg, "type": "server_error", "param": None, "code": None}}
        yield f"data: {json.dumps(err)}\n\n"
    yield "data: [DONE]\n\n"
