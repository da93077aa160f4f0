"""The FastAPI app: OpenAI- and vLLM-compatible routes over an :class:`EngineLoop`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (these need ``Authorization: Bearer <key>`` when the
server has an API key), ``GET /health``, ``GET /version`` and ``GET /metrics`` (always open).
Streaming responses are Server-Sent Events with one chunk per completed block, then
``data: [DONE]`` (:mod:`herald.server.respond`). Errors use the OpenAI shape
(:func:`herald.server.errors.error_response`): 400 bad input (including a field herald does not
implement, an unknown field, a ``mode`` or ``budget`` other than the server's, and a request too
large for the context or the CPU KV pool ever to run), 401 bad key, 404 unknown model, 503
waiting queue full (or the engine dead), 500 an internal error in this request only. A client
that disconnects has its requests aborted, which frees their engine slots and KV at the next
block boundary. docs/API.md lists every field and route.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import herald
from herald.server.chat import ChatTemplateError
from herald.server.errors import error_response, validation_message
from herald.server.generation import make_choices, model_refusal, not_served, refusal, submit
from herald.server.generation import tokenize as tokenize_text
from herald.server.metrics import CONTENT_TYPE_LATEST
from herald.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _Common,
)
from herald.server.respond import EventStream, Reply, complete, sse
from herald.server.state import ServerState

__all__ = ["ServerState", "create_app"]


def create_app(state: ServerState) -> FastAPI:
    """Build the app; its lifespan starts and stops ``state.engine_loop``'s thread."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        yield
        state.engine_loop.stop()

    app = FastAPI(title="herald", version=herald.__version__, lifespan=lifespan)
    app.state.herald = state
    app.add_middleware(_CountRefusals, metrics=state.metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in kind.lower():
            # FastAPI reads a body of another type as no JSON at all: say what is missing
            got = f"Content-Type {kind!r}" if kind else "no Content-Type"
            msg = f"the request body must be JSON with Content-Type: application/json ({got})"
            return error_response(400, msg, code="invalid_content_type")
        msg, param = validation_message(list(exc.errors()))
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _FASTAPI_BODY_ERROR:
            detail = "malformed JSON body (not UTF-8 text)"  # as json_invalid's message
        return error_response(exc.status_code, detail)

    auth = [Depends(_auth_dependency(state))]
    _add_info_routes(app, state, auth)
    _add_generation_routes(app, state, auth)
    _add_tokenizer_routes(app, state, auth)
    return app


_FASTAPI_BODY_ERROR = "There was an error parsing the body"
"""FastAPI's 400 for a body it could not read as JSON for another reason than a JSON syntax error
(bytes that are not UTF-8)."""

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _CountRefusals:
    """Counts the generation requests answered 400 or 422 (the request itself is wrong) as
    outcome ``invalid`` of ``herald_requests``. A plain ASGI wrapper of ``send``: it reads
    nothing and leaves ``receive`` (and so the client's disconnect) to the route."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start" and message["status"] in (400, 422):
                self.metrics.requests.labels("invalid").inc()
            await send(message)

        await self.app(scope, receive, counted)


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


def _add_info_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """``/health``, ``/version``, ``/metrics`` (open) and ``/v1/models`` (behind ``auth``)."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.engine_loop.is_alive():
            return error_response(503, "the engine thread is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": herald.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.running.set(state.engine_loop.num_running)
        state.metrics.waiting.set(state.engine_loop.num_waiting)
        state.metrics.set_pools(state.engine_loop.engine.usage())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    created = int(time.time())  # when the model was loaded and its routes built

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "herald",
            "root": state.model_name,
            "max_model_len": state.max_context,
            "herald": {
                "mode": state.mode,
                "kv_budget": state.kv_budget,
                "block_size": state.engine_loop.engine.config.block_size,
                **({"first_pass": state.first_pass} if state.first_pass is not None else {}),
            },
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in state.model_names]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> JSONResponse:
        if model_id not in state.model_names:
            return not_served(state, model_id)
        return JSONResponse(model_card(model_id))


async def _serve(
    state: ServerState, request: Request, body: _Common, prompts: list[str | list[int]],
    *, chat: bool, echo: bool = False,
) -> Response:  # fmt: skip
    """Check, queue and answer one request's prompts (JSON or SSE)."""
    refused = refusal(state, body)
    if refused is not None:
        return refused
    created = int(time.time())
    made = await make_choices(state, body, prompts, chat=chat, echo=echo)
    if isinstance(made, JSONResponse):
        return made
    refused = submit(state, made)
    if refused is not None:
        return refused
    reply = Reply(
        state, [c for c, _ in made], Reply.new_meta(state, body.model, created, chat=chat), chat,
        logprobs=body.top_logprobs_wanted() is not None, include_usage=body.include_usage,
        continuous_usage=body.continuous_usage, skip_special_tokens=body.skip_special_tokens,
    )  # fmt: skip
    if body.stream:
        return EventStream(sse(reply), media_type="text/event-stream")
    return await complete(reply, request)


def _render_chat(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool
) -> str | JSONResponse:
    assert state.chat_template is not None
    try:
        return state.chat_template.render(
            [m.as_dict() for m in messages], add_generation_prompt=add_generation_prompt
        )
    except ChatTemplateError as e:
        return error_response(400, str(e), param="messages")


def _add_generation_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``."""

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(state, request, body, body.prompt, chat=False, echo=body.echo)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        prompt = _render_chat(state, body.messages, body.add_generation_prompt)
        if isinstance(prompt, JSONResponse):
            return prompt
        return await _serve(state, request, body, [prompt], chat=True)


def _add_tokenizer_routes(app: FastAPI, state: ServerState, auth: list[Any]) -> None:
    """``/tokenize`` and ``/detokenize``."""

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        refused = model_refusal(state, body.model)
        if refused is not None:
            return refused
        if body.messages is not None:
            text = _render_chat(state, body.messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            text = body.prompt
        if isinstance(text, JSONResponse):
            return text
        ids = await tokenize_text(state, text)
        if isinstance(ids, JSONResponse):
            return ids
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_context,
                               "tokens": ids}  # fmt: skip
        if body.return_token_strs:
            out["token_strs"] = [state.tokenizer.backend.id_to_token(i) for i in ids]
        return JSONResponse(out)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        refused = model_refusal(state, body.model)
        if refused is not None:
            return refused
        vocab = state.engine_loop.engine.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(
                400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                param="tokens", code="invalid_token_ids",
            )  # fmt: skip
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens)})
