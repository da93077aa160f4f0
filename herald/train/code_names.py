"""Which tokens of the training stream are part of a Python name in code (not in a string, a
comment or a docstring): the ``code`` scope of the long-range loss emphasis.

The ``vocab`` scope flags long-range tokens by their vocabulary entry alone
(:func:`herald.train.objective.name_token_mask`), so names inside strings, docstrings and
comments are flagged too (``results/eval/README.md`` gives their shares). This
module marks a token when its bytes overlap a ``NAME`` token of Python's own tokenizer
(:mod:`tokenize`) that is not a keyword. Byte-level BPE tokens stand for whole bytes of the
document, so a token's byte range is the running sum of the byte lengths of the ids before it;
no offsets are needed from the tokenizer.
"""

from __future__ import annotations

import io
import keyword
import tokenize

import numpy as np
import tokenizers

from herald.train.corpus import fork_map


def name_spans(text: str) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` (UTF-8 offsets into ``text``) of the non-keyword ``NAME``
    tokens of ``text`` read as Python, outside f-strings (Python 3.12 tokenizes the names in an
    f-string's braces; they count as string text here, the same on every version). Source that
    does not tokenize to the end (Python 2 code, unbalanced brackets) keeps the names found
    before the error."""
    lines = io.StringIO(text).readlines()  # split at "\n" only, as tokenize expects
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line.encode()))
    ascii_text = text.isascii()
    spans: list[tuple[int, int]] = []
    fstring_start = getattr(tokenize, "FSTRING_START", None)  # Python 3.12+
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    depth = 0  # inside an f-string: its names count as string text, as on Python 3.11
    try:
        for tok in tokenize.generate_tokens(iter(lines).__next__):  # the same lines
            if fstring_start is not None and tok.type == fstring_start:
                depth += 1
            elif fstring_end is not None and tok.type == fstring_end:
                depth -= 1
            if tok.type != tokenize.NAME or depth > 0:
                continue
            if keyword.iskeyword(tok.string.lstrip("\ufeff")):
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            if ascii_text:
                a, b = starts[r0 - 1] + c0, starts[r1 - 1] + c1
            else:  # columns count characters: convert the line prefix to bytes
                a = starts[r0 - 1] + len(lines[r0 - 1][:c0].encode())
                b = starts[r1 - 1] + len(lines[r1 - 1][:c1].encode())
            spans.append((a, b))
    except (tokenize.TokenError, SyntaxError):
        pass
    return spans


def token_byte_lengths(backend: tokenizers.Tokenizer) -> np.ndarray:
    """[vocab] int64: how many bytes of a document each id stands for (byte-level BPE: one
    vocabulary character per byte; special tokens count their text, and never occur inside a
    document)."""
    out = np.zeros(backend.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        out[i] = len(piece)
    return out


def code_name_mask(text: str, ids: np.ndarray, byte_lengths: np.ndarray) -> np.ndarray:
    """[len(ids)] bool: the tokens of ``text``'s encoding ``ids`` whose bytes overlap a name in
    code (:func:`name_spans`). All False when the ids do not cover exactly the document's bytes
    (a tokenizer that is not byte-level)."""
    lengths = byte_lengths[np.asarray(ids, dtype=np.int64)]
    ends = np.cumsum(lengths)
    mask = np.zeros(len(ids), dtype=bool)
    if len(ids) == 0 or int(ends[-1]) != len(text.encode()):
        return mask
    begins = ends - lengths
    spans = name_spans(text)
    if not spans:
        return mask
    a = np.array([s for s, _ in spans])
    b = np.array([e for _, e in spans])
    # token t overlaps span k when begins[t] < b[k] and ends[t] > a[k]; the spans are sorted and
    # disjoint, so the first span ending after the token's start decides
    k = np.searchsorted(b, begins, side="right")
    inside = k < len(spans)
    kk = np.minimum(k, len(spans) - 1)
    mask[inside] = (ends[inside] > a[kk[inside]]) & (begins[inside] < b[kk[inside]])
    return mask


# The stream and documents of code_name_stream, shared with forked workers (no pickling).
_SHARED: dict[str, object] = {}


def _doc_token_ranges(doc_bytes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[len(docs), 2] token index ranges ``[start, end)`` of each document in the stream (the
    documents encoded in order; ``lengths``: each stream token's bytes, special ids 0). Token
    ``i`` ends at byte ``cum[i]``; document ``k`` holds the tokens ending in ``(D[k-1], D[k]]``,
    ``D`` the running sum of ``doc_bytes`` (an empty document holds none).

    Raises:
        ValueError: the documents do not cover the stream's bytes, or a document's end is not
            a token's end (another tokenizer or order).
    """
    cum = np.cumsum(lengths)
    hi = np.cumsum(doc_bytes)
    if (int(cum[-1]) if cum.size else 0) != (int(hi[-1]) if hi.size else 0):
        raise ValueError("the documents do not cover the token stream's bytes")
    lo = hi - doc_bytes
    starts = np.searchsorted(cum, lo, side="right")
    ends = np.where(doc_bytes > 0, np.searchsorted(cum, hi, side="left") + 1, starts)
    full = doc_bytes > 0
    if np.any(cum[ends[full] - 1] != hi[full]):
        raise ValueError("the documents' boundaries do not fall on token boundaries of the stream")
    return np.stack([starts, ends], axis=1)


def _mask_range(job: tuple[int, int]) -> tuple[int, np.ndarray]:
    lo, hi = job
    docs, stream, ranges, lengths = (_SHARED[k] for k in ("docs", "stream", "ranges", "lengths"))
    assert isinstance(docs, list) and isinstance(stream, np.ndarray)
    assert isinstance(ranges, np.ndarray) and isinstance(lengths, np.ndarray)
    start, end = int(ranges[lo:hi, 0].min()), int(ranges[lo:hi, 1].max())
    out = np.zeros(end - start, dtype=bool)
    for i in range(lo, hi):
        a, b = int(ranges[i, 0]), int(ranges[i, 1])
        out[a - start : b - start] = code_name_mask(docs[i], stream[a:b], lengths)
    return start, out


def code_name_stream(
    docs: list[str],
    stream: np.ndarray,
    backend: tokenizers.Tokenizer,
    special_ids: tuple[int, ...],
    workers: int = 1,
) -> np.ndarray:
    """[stream.size] uint8 (0/1): :func:`code_name_mask` over every document of ``stream``, the
    encoding of ``docs`` in order with ``special_ids`` (EOS) between some of them.

    Forks ``workers`` processes on Linux (call before CUDA is initialised).

    Raises:
        ValueError: the documents do not cover the stream's bytes (another tokenizer or order).
    """
    per_id = token_byte_lengths(backend)
    lengths = per_id[np.asarray(stream, dtype=np.int64)]
    for s in special_ids:
        lengths[np.asarray(stream) == s] = 0
    doc_bytes = np.array([len(d.encode()) for d in docs], dtype=np.int64)
    ranges = _doc_token_ranges(doc_bytes, lengths)
    _SHARED.update(docs=docs, stream=np.asarray(stream), ranges=ranges, lengths=per_id)
    step = max(1, len(docs) // (8 * max(1, workers)))
    jobs = [(i, min(i + step, len(docs))) for i in range(0, len(docs), step)]
    out = np.zeros(stream.size, dtype=np.uint8)
    try:
        results = fork_map(_mask_range, jobs, workers, min_items=2, chunksize=1)
    finally:
        _SHARED.clear()
    for start, m in results:
        out[start : start + m.size] = m
    return out
