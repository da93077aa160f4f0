"""TextStream: token blocks -> text deltas, with stop strings.

Streaming and non-streaming responses both go through it, so the streamed deltas always join to
the non-streamed text. Text that might be the start of a stop string, or an incomplete UTF-8
sequence (decoded as U+FFFD), is held back until the next block or the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from herald.models.tokenizer import Tokenizer


class TextStream:
    """Decodes a growing list of ids; truncates at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.stopped = False
        self._text = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Add a block of ids; returns the new text that is safe to send."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._text = self.tokenizer.decode(self.ids)
        cut = self._stop_at(self._text)
        if cut is not None:
            self.stopped = True
            self._text = self._text[:cut]
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

    def _take(self, end: int) -> str:
        out = self._text[self.emitted : end]
        self.emitted = end
        return out

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
