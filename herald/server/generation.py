"""One completion or chat request: its prompts queued in the engine, answered as JSON or SSE.

A request holds one *choice* per prompt (completions take a list of prompts; chat has one),
each its own engine request. Their blocks arrive interleaved; each choice's text goes through
its own :class:`~herald.server.text.TextStream` (stop strings) and its finish is its own. The
engine requests are aborted when the consumer stops early (a disconnect, a stop string, an
error in another choice), which frees their slots and KV at the next block boundary.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from herald.config import SamplingParams
from herald.engine.scheduler import QueueFullError
from herald.kv.manager import RequestTooLarge
from herald.server.engine_loop import EngineDeadError, Handle
from herald.server.errors import error_response
from herald.server.protocol import _Common
from herald.server.render import Scored
from herald.server.state import ServerState
from herald.server.text import TextStream

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
"""Completions' ``max_tokens`` when the request gives none (OpenAI's default); chat's default is
the rest of the context."""
MAX_CHARS_PER_TOKEN = 64
"""A prompt longer than this many characters per context token is refused before tokenizing."""
POLL_SECONDS = 0.5
"""How often a non-streamed request checks that its client is still there."""


class Failed(Exception):
    """A request failed inside the engine (HTTP 500 for that request only)."""


class Disconnected(Exception):
    """The client of a non-streamed request went away; its requests are aborted."""


@dataclass(eq=False)
class Choice:
    """One prompt's engine request and what has come back for it."""

    index: int
    prompt_ids: list[int]
    echo: str | None  # the prompt text, prepended to the choice's text (completions' echo)
    stream: TextStream
    scores: bool = False  # logprobs asked for
    handle: Handle | None = None
    logprobs: list[float] = field(default_factory=list)  # aligned with stream.ids
    tops: list[Scored] = field(default_factory=list)  # aligned with stream.ids when asked for
    finish: str | None = None
    reported: int = 0  # emitted tokens already handed out in events
    _pending: tuple[list[float], list[Scored]] | None = None

    @property
    def num_tokens(self) -> int:
        """Completion tokens: the emitted ones (:class:`TextStream`)."""
        return self.stream.num_kept

    @property
    def stop_reason(self) -> str | int | None:
        """What stopped it: the stop string, or the token of ``stop_token_ids``; None for EOS,
        a length finish, or while it runs."""
        if self.stream.stop_string is not None:
            return self.stream.stop_string
        req = self.handle.request if self.handle is not None else None
        if self.finish == "stop" and req is not None and req.stop_token_id is not None:
            return req.stop_token_id if req.stop_token_id in req.params.stop_token_ids else None
        return None


@dataclass
class Event:
    """New output of one choice: its newly emitted token ids (with their logprobs), the text
    delta and, on its last event, the finish reason."""

    choice: Choice
    start: int  # the index of ``ids[0]`` among the choice's emitted tokens
    ids: list[int]
    text: str
    logprobs: list[float]
    tops: list[Scored]
    finish: str | None


def not_served(state: ServerState, model_id: str) -> JSONResponse:
    return error_response(
        404, f"model {model_id!r} is not served here (try {state.model_name!r})",
        param="model", code="model_not_found",
    )  # fmt: skip


def model_refusal(state: ServerState, model: str | None) -> JSONResponse | None:
    """The 404 for a ``model`` this server does not serve, else None."""
    if model is not None and model not in state.model_names:
        return not_served(state, model)
    return None


def refusal(state: ServerState, body: _Common) -> JSONResponse | None:
    """The error response for a request this server does not run as asked, else None."""
    refused = model_refusal(state, body.model)
    if refused is not None:
        return refused
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
    return None


async def tokenize(state: ServerState, prompt: str) -> list[int] | JSONResponse:
    """``prompt``'s ids (off the event loop: a long prompt must not stall other requests), or
    the 400 for a prompt too long to tokenize or not valid Unicode."""
    ctx = state.max_context
    if len(prompt) > MAX_CHARS_PER_TOKEN * ctx:
        # NOTE: checked before tokenizing: a many-megabyte prompt would hold a worker thread
        # (and memory) for seconds only to be refused.
        return error_response(
            400, f"the prompt is {len(prompt)} characters, far more than the server's max "
            f"context of {ctx} tokens", param="prompt", code="context_length_exceeded",
        )  # fmt: skip
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (JSON's "\ud800"): no text to tokenize
        return error_response(
            400, f"the text is not valid Unicode: {prompt[e.start]!r} at character {e.start} "
            "is a lone surrogate", param="prompt", code="invalid_unicode",
        )  # fmt: skip
    ids: list[int] = await run_in_threadpool(state.tokenizer.encode, prompt)
    return ids


def max_tokens_for(state: ServerState, body: _Common, num_prompt: int, *, chat: bool) -> int:
    """The request's ``max_tokens``, else the default: the rest of the context for chat,
    :data:`DEFAULT_MAX_TOKENS` (at most the rest) for completions."""
    rest = state.max_context - num_prompt
    if body.max_tokens is not None:
        return body.max_tokens
    return rest if chat else min(DEFAULT_MAX_TOKENS, rest)


async def make_choices(
    state: ServerState, body: _Common, prompts: list[str | list[int]], *, chat: bool, echo: bool
) -> list[tuple[Choice, SamplingParams]] | JSONResponse:
    """Tokenize and check each prompt and its sampling params, or the error that refuses one."""
    limit = state.max_prompts
    if limit is not None and len(prompts) > limit:
        return error_response(
            400, f"{len(prompts)} prompts in one request, more than this server's slots and "
            f"waiting queue hold ({limit})", param="prompt",
        )  # fmt: skip
    out = []
    ctx = state.max_context
    vocab, mask = state.engine_loop.engine.config.vocab_size, state.tokenizer.mask_token_id
    bad = [t for t in body.stop_token_ids or [] if t >= vocab or t == mask]
    if bad:
        return error_response(
            400, f"stop_token_ids must be ids of the vocabulary [0, {vocab}) other than the mask "
            f"token {mask}, got {bad[:5]}", param="stop_token_ids",
        )  # fmt: skip
    for i, prompt in enumerate(prompts):
        ids = await tokenize(state, prompt) if isinstance(prompt, str) else list(prompt)
        if isinstance(ids, JSONResponse):
            return ids
        which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        if not ids:
            return error_response(400, f"{which} is empty", param="prompt")
        if len(ids) >= ctx:
            return error_response(
                400, f"{which} is {len(ids)} tokens; the server's max context is {ctx} tokens, "
                "prompt and generated tokens together (at least one generated)",
                param="prompt", code="context_length_exceeded",
            )  # fmt: skip
        max_tokens = max_tokens_for(state, body, len(ids), chat=chat)
        if body.min_tokens > max_tokens:
            return error_response(
                400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens",
            )  # fmt: skip
        params = body.sampling_params(max_tokens, state.denoise)
        try:
            params.validate()
        except ValueError as e:
            return error_response(400, str(e))
        text = None
        if echo:
            text = prompt if isinstance(prompt, str) else state.tokenizer.decode(ids)
        stream = TextStream(
            state.tokenizer, body.stop_list(), include_stop=body.include_stop_str_in_output,
            min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
        )  # fmt: skip
        scores = body.top_logprobs_wanted() is not None
        out.append((Choice(i, ids, text, stream, scores), params))
    return out


def submit(state: ServerState, choices: list[tuple[Choice, SamplingParams]]) -> JSONResponse | None:
    """Queue every choice in the engine (all or none), or the error response that refuses one."""
    loop = asyncio.get_running_loop()
    try:
        for choice, params in choices:
            choice.handle = state.engine_loop.submit(
                choice.prompt_ids, params, loop, scores=choice.scores
            )
        return None
    except RequestTooLarge as e:
        refused = error_response(400, str(e), param=e.param, code=e.code)
    except ValueError as e:
        refused = error_response(400, str(e))
    except (QueueFullError, EngineDeadError) as e:
        state.metrics.requests.labels("rejected").inc()
        refused = error_response(503, str(e))
    except Exception as e:  # an engine bug while queueing: this request fails, the server goes on
        log.exception("queueing a request failed")
        state.metrics.requests.labels("error").inc()
        refused = error_response(500, f"internal error in this request: {type(e).__name__}: {e}")
    for choice, _ in choices:
        if choice.handle is not None:
            state.engine_loop.cancel(choice.handle)
    return refused


async def _pump(choice: Choice, inbox: asyncio.Queue[tuple[Choice, str, Any]]) -> None:
    """Forward ``choice``'s engine items to the request's one inbox until its last."""
    assert choice.handle is not None
    while True:
        kind, val = await choice.handle.queue.get()
        inbox.put_nowait((choice, kind, val))
        if kind in ("done", "error"):
            return


def _apply(state: ServerState, c: Choice, kind: str, val: Any) -> Event | None:
    """One engine item of choice ``c`` -> its event (None for a logprobs item, which goes with
    the next block). Raises :class:`Failed` for an engine error."""
    if kind == "error":
        raise Failed(f"{type(val).__name__}: {val}")
    if kind == "logprobs":
        c._pending = val
        return None
    if kind == "done":
        c.finish = str(val)
        delta = c.stream.finish()
        return _event(c, delta, c.stream.num_kept)  # with the ids held back with the text
    delta = c.stream.feed(val)
    if c._pending is not None:
        c.logprobs.extend(c._pending[0])
        c.tops.extend(c._pending[1])
        c._pending = None
    if c.stream.stopped:
        c.finish = "stop"
        assert c.handle is not None
        state.engine_loop.cancel(c.handle)  # a stop string ended it early: free the slot
    return _event(c, delta, c.stream.num_ready)


def _event(c: Choice, delta: str, end: int) -> Event:
    """``c``'s event carrying ``delta`` and its ids (with their logprobs) from the last one
    reported up to ``end``."""
    start, c.reported = c.reported, end
    ids = c.stream.ids[start:end]
    return Event(c, start, ids, delta, c.logprobs[start:end], c.tops[start:end], c.finish)


async def events(
    state: ServerState, choices: list[Choice], request: Request | None
) -> AsyncIterator[Event]:
    """Every choice's events, as they come, until each has finished.

    ``request`` (non-streamed responses): poll it, raising :class:`Disconnected` once its client
    went away (a stream is cancelled instead). Raises :class:`Failed` when the engine reported
    an error. Whatever ends the iteration, unfinished choices are aborted in the engine.
    """
    inbox: asyncio.Queue[tuple[Choice, str, Any]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(c, inbox)) for c in choices]
    checked = time.monotonic()
    try:
        while any(c.finish is None for c in choices):
            try:
                item: tuple[Choice, str, Any] | None = await asyncio.wait_for(
                    inbox.get(), timeout=POLL_SECONDS
                )
            except TimeoutError:
                item = None
            if request is not None and time.monotonic() - checked >= POLL_SECONDS:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise Disconnected
            if item is None or item[0].finish is not None:
                continue
            ev = _apply(state, *item)
            if ev is not None:
                yield ev
    finally:
        for c in choices:
            if c.finish is None and c.handle is not None:
                state.engine_loop.cancel(c.handle)
        for t in pumps:
            t.cancel()
