"""Request: one prompt's decoding state and results (vLLM's vocabulary)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from herald.config import SamplingParams
from herald.diffusion.block import BlockLayout
from herald.kv.manager import RequestTooLarge

_ids = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # an EOS token was generated
    FINISHED_LENGTH = "finished_length"  # max_new_tokens reached
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # a step that ran it failed; ``Request.error`` says why

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(eq=False)  # identity: requests are found in queues and batches by ``is``
class Request:
    """A prompt plus its decoding state.

    ``output_ids`` are the generated tokens (the prompt is not included; a stopping EOS or stop
    token is not included either). ``output_logprobs[j]`` is the natural log of the sampler's
    probability of ``output_ids[j]`` at the denoising step that accepted it (the log of its
    confidence, :mod:`herald.diffusion.sampler`: under temperature / top-k / top-p the tempered,
    filtered distribution it was drawn from). In a block diffusion LM that is the token's
    probability given the prefix and whatever of its block was already unmasked at that step,
    not a left-to-right likelihood. ``output_top_logprobs[j]`` (only when
    ``params.top_logprobs`` > 0, else empty) holds the most likely (token id, logprob) pairs of
    that same distribution at that step, most likely first, at most ``top_logprobs`` of them
    (tokens of probability 0 are left out). The three lists grow and are cut together.
    ``stop_token_id`` is the EOS or stop token that finished the request (None otherwise).
    ``steps_per_block`` records the denoising steps each completed block took. A request stays
    ``WAITING`` while it is prefilled and becomes ``RUNNING`` when it joins the decode batch.
    """

    prompt_ids: list[int]
    params: SamplingParams
    block_size: int
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    stop_token_id: int | None = None
    steps_per_block: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Decode position: absolute start of the current block; KV of [0, block_start) is committed.
    block_start: int = 0
    steps_in_block: int = 0
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.params.validate()
        self.layout = BlockLayout(len(self.prompt_ids), self.block_size, self.params.max_new_tokens)
        self.block_start = self.layout.first_block_start

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self.status)

    @property
    def num_denoise_steps(self) -> int:
        return sum(self.steps_per_block)

    def truncate_output(self, n: int) -> None:
        """Keep the first ``n`` output tokens (and their logprobs)."""
        del self.output_ids[n:], self.output_logprobs[n:], self.output_top_logprobs[n:]

    def reaches_length(self, pending: int = 0) -> bool:
        """True when the current block is the request's last by length: ``output_ids`` plus
        ``pending`` tokens not yet appended reach ``max_new_tokens``, or the block ends the
        canvas (:class:`BlockLayout`)."""
        return (
            len(self.output_ids) + pending >= self.params.max_new_tokens
            or self.block_start + self.block_size >= self.layout.total_len
        )


def new_request(
    prompt_ids: list[int],
    params: SamplingParams,
    block_size: int,
    max_seq_len: int,
    vocab_size: int,
    mask_token_id: int | None = None,
) -> Request:
    """Build a :class:`Request` after the checks every engine makes before queueing it.

    Raises:
        ValueError: bad sampling params or an empty prompt.
        RequestTooLarge (a ValueError): a prompt + ``max_new_tokens`` longer than
            ``max_seq_len`` (in whole blocks), or token ids outside ``[0, vocab_size)`` or equal
            to ``mask_token_id`` (it marks the positions the model fills: never an input token).
    """
    req = Request(list(prompt_ids), params, block_size)
    if req.layout.total_len > max_seq_len:
        # (the HTTP API calls max_new_tokens max_tokens: the message names neither)
        raise RequestTooLarge(
            f"the prompt ({_tokens(req.prompt_len)}) and up to {_tokens(params.max_new_tokens)} "
            f"to generate need {req.layout.total_len} tokens in whole blocks of {block_size}, "
            f"more than the context of {max_seq_len} (max_seq_len)",
            code="context_length_exceeded",
        )
    bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size or t == mask_token_id]
    if bad:
        raise RequestTooLarge(
            f"prompt holds token ids outside the vocabulary [0, {vocab_size}) or the mask token "
            f"{mask_token_id}: {bad[:5]}",
            param="prompt",
            code="invalid_token_ids",
        )
    return req


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"
