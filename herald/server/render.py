"""Response pieces in OpenAI's shapes: usage and logprobs.

Log-probabilities are the sampler's: the log of the probability the sampler gave a token at the
denoising step where it was accepted (a block dLLM fills a block's positions over several steps,
most confident first, so this is not the left-to-right probability an autoregressive model
reports). The alternatives are the most likely tokens at that same step and position.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders

from herald.models.tokenizer import Tokenizer, _bytes_to_unicode

Scored = list[tuple[int, float]]
"""(token id, logprob) alternatives at one position."""


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finite(x: float) -> float:
    """JSON has no -inf: a probability that underflowed is reported as float32's lowest log."""
    return x if math.isfinite(x) else -9999.0


class TokenPieces:
    """Each token's bytes and text, for logprobs (cached per id)."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        backend = tokenizer.backend
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._unbyte = {c: b for b, c in _bytes_to_unicode().items()}
        self._special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` contributes to the text (empty for a skipped special token)."""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        if token_id == self.tokenizer.mask_token_id:
            return b""
        if token_id in self._special:
            if self.skip_special:
                return b""
            return self.tokenizer.decode([token_id]).encode()
        piece = self.tokenizer.backend.id_to_token(token_id)
        if self._byte_level and piece is not None and all(c in self._unbyte for c in piece):
            return bytes(self._unbyte[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()

    def text_of(self, token_id: int) -> str:
        """The token's text (an incomplete UTF-8 sequence shows as U+FFFD)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def offsets(self, ids: Sequence[int]) -> list[int]:
        """The character offset at which each token's text starts in the text of ``ids``."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out, n = [], 0
        for i in ids:
            out.append(n)
            n += len(dec.decode(self.bytes_of(i)))
        return out


def completion_logprobs(
    pieces: TokenPieces,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[Scored],
    offsets: Sequence[int],
) -> dict[str, Any]:
    """Completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token text: logprob}`` per token, or null when no alternatives were asked for) and
    ``text_offset`` (``offsets``: where each token starts in the choice's text)."""
    top: list[dict[str, float]] | None = None
    if tops:
        top = []
        for alts in tops:
            entry: dict[str, float] = {}
            for t, lp in alts:  # most likely first: two tokens of one text keep the likelier
                entry.setdefault(pieces.text_of(t), _finite(lp))
            top.append(entry)
    return {
        "tokens": [pieces.text_of(i) for i in ids],
        "token_logprobs": [_finite(x) for x in logprobs],
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def _entry(pieces: TokenPieces, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": pieces.text_of(token_id),
        "logprob": _finite(logprob),
        "bytes": list(pieces.bytes_of(token_id)),
    }


def chat_logprobs(
    pieces: TokenPieces, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Scored]
) -> dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal":
    null}``; ``top_logprobs`` is empty when no alternatives were asked for."""
    content = []
    for j, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
        entry = _entry(pieces, t, lp)
        entry["top_logprobs"] = [_entry(pieces, a, alp) for a, alp in tops[j]] if tops else []
        content.append(entry)
    return {"content": content, "refusal": None}
