"""Text and token helpers shared by the example builders (:mod:`herald.eval.line_task`,
:mod:`herald.eval.recall_task`): the tail of a text in tokens, whole-word mentions, the
cross-file context that fills a prompt from the left, and Python tokens and top-level names of a
source file.
"""

from __future__ import annotations

import io
import re
import tokenize

from herald.eval.sources import Corpus, SourceFile, TextCodec

_TOP_LEVEL = re.compile(
    r"^(?:async[ \t]+)?def[ \t]+(\w+)|^class[ \t]+(\w+)|^(\w+)[ \t]*(?::[^=\n]*)?=(?!=)",
    re.MULTILINE,
)
WORD = re.compile(r"\w+")
"""A maximal run of word characters: an identifier matches ``\\bname\\b`` exactly when it is
one such run."""


def encode_tail(codec: TextCodec, text: str, n: int, ratio: float) -> tuple[list[int], bool]:
    """The last ``n`` tokens of ``text`` (fewer if it is shorter) and whether any was dropped.

    Encodes only a generous tail of the text, from a line start, when that yields well over
    ``n`` tokens (``ratio``: characters per token). Byte-level BPE pre-tokenizers split at
    whitespace, so only the tail's first line can tokenize differently from the whole text; the
    last ``n`` tokens are the whole text's."""
    start = max(0, len(text) - int((n + 64) * ratio * 1.5))
    if start > 0:
        start = text.find("\n", start) + 1
    ids = codec.encode(text[start:])
    if start > 0 and len(ids) < n + 32:
        ids = codec.encode(text)
        start = 0
    return ids[-n:], start > 0 or len(ids) > n


def mentions(codec: TextCodec, ids: list[int], name: str) -> bool:
    """Whether the decoded ``ids`` hold ``name`` as a whole word."""
    return name in {m.group(0) for m in WORD.finditer(codec.decode(ids))}


def fill_left(corpus: Corpus, others: list[str], budget: int) -> tuple[list[int], list[dict]]:
    """Chunks of ``others`` (least to most related) filling ``budget`` tokens from the right:
    the most related chunk is last; the leftmost chunk used may be cut (its left part dropped)."""
    pieces: list[list[int]] = []
    used: list[dict] = []
    total = 0
    for rel in reversed(others):
        if total >= budget:
            break
        ids = corpus.chunk_ids(rel)
        if not ids:
            continue
        f = corpus.read(rel)
        assert f is not None
        take = min(len(ids), budget - total)
        pieces.append(ids[len(ids) - take :])
        used.append({"file": rel, "sha256": f.sha256, "truncated": take < len(ids)})
        total += take
    pieces.reverse()
    used.reverse()
    return [t for p in pieces for t in p], used


def module_names(f: SourceFile) -> set[str]:
    """Names bound at module level (``def``, ``class``, ``name =`` at column 0; a line scan)."""
    return {next(g for g in m.groups() if g) for m in _TOP_LEVEL.finditer(f.text)}


def python_tokens(f: SourceFile) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO(f.text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None


SKIP_TOKENS = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
