"""TextStream: token blocks -> text deltas, with stop strings.

Streaming and non-streaming responses both go through it, so the streamed deltas always join to
the non-streamed text. Text that might be the start of a stop string, or an incomplete UTF-8
sequence (decoded as U+FFFD), is held back until the next block or the end.

A stop string ends the text where it starts (or, with ``include_stop``, where it ends). The
tokens a response returns and counts are then the *emitted* tokens: the shortest prefix of the
generated tokens whose text holds the returned text. A token whose text the cut splits is
counted; the tokens after it (the rest of the block the engine committed at once) are not. With
``min_tokens``, a stop string counts only where it starts at or after the end of the first
``min_tokens`` tokens' text. A stream's ids wait with their held-back text (:attr:`TextStream.
num_ready`), so the ids and logprobs streamed add up to the non-streamed ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from herald.models.tokenizer import Tokenizer


class TextStream:
    """Decodes a growing list of ids; truncates at the first stop string.

    Args:
        tokenizer: decodes the ids.
        stops: the stop strings.
        include_stop: keep the stop string at the end of the text.
        min_tokens: a stop string inside the first ``min_tokens`` tokens' text does not count.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: Sequence[str] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._text = ""
        self._search_from: int | None = 0 if min_tokens == 0 else None
        self._kept: int | None = None  # emitted tokens, once a stop string cut the text

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def feed(self, ids: Sequence[int]) -> str:
        """Add a block of ids; returns the new text that is safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._text = self.decode(self.ids)
        if self._search_from is None and len(self.ids) >= self.min_tokens:
            self._search_from = len(self.decode(self.ids[: self.min_tokens]).rstrip("\ufffd"))
        cut = self._stop_at(self._text)
        if cut is not None:
            self.stopped = True
            self._text = self._text[:cut]
            self._kept = self._emitted_tokens(self._text)
            return self._take(len(self._text))
        end = len(self._text)
        while end > self.emitted and self._text[end - 1] == "\ufffd":
            end -= 1
        end -= self._held_for_stop(self._text[:end])
        return self._take(max(end, self.emitted))

    def finish(self) -> str:
        """The text still held back (call once, at the end)."""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        """The whole text so far (truncated at a stop string once one is seen)."""
        return self._text

    @property
    def num_kept(self) -> int:
        """The emitted tokens (module docstring): every id fed, unless a stop string cut."""
        return len(self.ids) if self._kept is None else self._kept

    @property
    def kept_ids(self) -> list[int]:
        return self.ids[: self.num_kept]

    @property
    def num_ready(self) -> int:
        """The ids a stream may send now: every id fed when all their text went out (and the
        emitted tokens once a stop string cut); while text is held back (the start of a stop
        string, an incomplete character), only the ids whose whole text went out, so that ids,
        their logprobs and the text stop together when the held text turns out to be a stop."""
        if self.stopped or self.emitted >= len(self._text):
            return self.num_kept
        sent = self._text[: self.emitted]
        lo, hi = 0, len(self.ids)  # the largest n whose text is a prefix of what went out
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sent.startswith(self.decode(self.ids[:mid])):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _take(self, end: int) -> str:
        out = self._text[self.emitted : end]
        self.emitted = end
        return out

    def _stop_at(self, text: str) -> int | None:
        if self._search_from is None:
            return None
        hits = [(i, len(s), s) for s in self.stops if (i := text.find(s, self._search_from)) >= 0]
        if not hits:
            return None
        start, length, self.stop_string = min(hits)  # the first to start (then the shorter)
        return start + length if self.include_stop else start

    def _emitted_tokens(self, text: str) -> int:
        """The fewest leading ids whose decoded text starts with ``text`` (binary search: a
        longer prefix of ids decodes to a longer prefix of the text)."""
        lo, hi = 0, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode(self.ids[:mid]).startswith(text):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
