"""The RULER-style instance builder: one prompt of a task (:mod:`herald.eval.ruler_formats`
describes the formats and the exact-match rules) built from any text source and a seeded RNG,
fitted to a token budget with the model's tokenizer.

:func:`build_instance` is independent of where the text comes from: ``herald eval`` gives it
the local standard library (:mod:`herald.eval.ruler_task`); a training data pipeline can give it
its own corpus (a :class:`TextSource`), and train on ``instance.text + instance.completion``.

Needle tasks: the haystack is the source's documents in a random order, concatenated whole
(the last one cut at a line end) until the budget minus the needles and the question is filled.
Each needle line is placed at the start of a haystack line at a depth drawn uniformly over the
part of the haystack that lies before the last ``tail_tokens`` tokens of the prompt (so that a
control that sees only those tokens cannot read any answer); the lines of a group (a variable
chain) keep their order. A plan whose keys, values or names occur in the haystack is drawn again.
The whole prompt is then encoded once; when it exceeds the budget (token merges across the
joins), the haystack is refilled shorter and the needles placed again at the same depths.

``cwe``: words (lowercase, 4 to 12 letters) collected from the source's documents in a random
order; as many rarely repeated words as fit the budget.
"""

from __future__ import annotations

import math
import random
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Protocol

from herald.eval.ruler_formats import (
    ANSWER_RULE,
    CWE_HEADER,
    Needle,
    RulerConfig,
    answer_text,
    cwe_question,
    plan,
    question_block,
)
from herald.eval.sources import TextCodec

_WORD = re.compile(r"(?<![A-Za-z0-9_])[a-z]{4,12}(?![A-Za-z0-9_])")
_MARGIN = 16
"""Tokens kept between the last needle and the tail window, at first (doubled on a miss)."""


@dataclass(frozen=True)
class Document:
    """One haystack document: ``name`` and ``sha256`` are recorded, ``text`` is used as is (end it
    with a blank line to separate it from the next), ``ids`` are its tokens if already known."""

    name: str
    text: str
    sha256: str = ""
    ids: list[int] | None = None


class TextSource(Protocol):
    """A sequence of documents; ``document(i)`` may be None (a document that cannot be used)."""

    def __len__(self) -> int: ...

    def document(self, index: int) -> Document | None: ...


@dataclass
class RulerInstance:
    """One prompt: ``text`` (exactly ``codec.decode(prompt_ids)`` for a byte-level tokenizer),
    ``prompt_ids`` (at most the budget), the expected ``answer`` items, ``target`` (their
    answer line) and ``meta``: the plan's choices, the question, each needle's text, character
    offset in ``text`` and answer item (``needles``, in prompt order; ``depths``: the offsets as
    fractions of the prompt's characters), the documents used (``context_files``: name, sha256,
    truncated), the prompt's token count."""

    task: str
    text: str
    prompt_ids: list[int]
    answer: list[str]
    target: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def completion(self) -> str:
        """The expected completion: a space, the answer line, a newline."""
        return f" {self.target}\n"


def _fill(
    source: TextSource, codec: TextCodec, order: list[int], n_tokens: int
) -> tuple[str, list[int], list[dict[str, Any]]]:
    """The source's documents in ``order`` until ``n_tokens`` tokens, the last one cut at a line
    end: (text, its tokens as the documents' tokens concatenated, the documents used)."""
    texts: list[str] = []
    ids: list[int] = []
    used: list[dict[str, Any]] = []
    for i in order:
        room = n_tokens - len(ids)
        if room <= 0:
            break
        doc = source.document(i)
        if doc is None or not doc.text:
            continue
        doc_ids = doc.ids if doc.ids is not None else codec.encode(doc.text)
        text, truncated = doc.text, len(doc_ids) > room
        if truncated:
            cut = codec.decode(doc_ids[:room])
            text = cut[: cut.rfind("\n") + 1]
            if text.count("\n") < 2:  # a header alone: leave the room empty
                break
            doc_ids = codec.encode(text)
        texts.append(text)
        ids += doc_ids
        used.append({"file": doc.name, "sha256": doc.sha256, "truncated": truncated})
        if truncated:
            break
    return "".join(texts), ids, used


def _line_starts(text: str, end: int) -> list[int]:
    """Offsets of the line starts of ``text`` up to ``end`` (0 first)."""
    starts = [0]
    i = text.find("\n")
    while 0 <= i < end:
        starts.append(i + 1)
        i = text.find("\n", i + 1)
    return [s for s in starts if s <= end]


def _place(
    hay: str, groups: list[list[Needle]], depths: list[list[float]], end: int
) -> tuple[str, list[tuple[int, Needle]]]:
    """``hay`` with every needle line inserted at the first line start at or after its depth (a
    fraction of ``end``, the last character a needle may precede): (text, (offset, needle) in
    text order)."""
    starts = _line_starts(hay, end)
    spots = []  # (insertion offset in hay, group, line)
    for g, ds in enumerate(depths):
        for j, d in enumerate(ds):
            k = min(bisect_left(starts, d * end), len(starts) - 1)
            spots.append((starts[k], g, j))
    spots.sort(key=lambda s: (s[0], depths[s[1]][s[2]], s[1], s[2]))
    out: list[str] = []
    placed: list[tuple[int, Needle]] = []
    at = size = 0
    for pos, g, j in spots:
        out.append(hay[at:pos])
        size += pos - at
        needle = groups[g][j]
        placed.append((size, needle))
        out.append(needle.text + "\n")
        size += len(needle.text) + 1
        at = pos
    out.append(hay[at:])
    return "".join(out), placed


def _tail_start(codec: TextCodec, text: str, ids: list[int], tail: int) -> int:
    """The character offset in ``text`` where its last ``tail`` tokens begin."""
    if tail <= 0:
        return len(text)
    return len(text) - len(codec.decode(ids[-tail:]))


def _needle_instance(
    task: str,
    source: TextSource,
    codec: TextCodec,
    budget: int,
    rng: random.Random,
    cfg: RulerConfig,
    tail_tokens: int,
) -> RulerInstance:
    p = plan(task, rng, cfg)
    depths = [sorted(rng.random() for _ in g) for g in p.groups]
    order = list(range(len(source)))
    rng.shuffle(order)
    margin = _MARGIN
    shrink = 0
    for _ in range(12):
        q = question_block(p.question)
        q_ids = len(codec.encode("\n" + q))
        fixed = sum(len(codec.encode(n.text + "\n")) for g in p.groups for n in g) + q_ids
        hay, hay_ids, docs = _fill(source, codec, order, budget - fixed - shrink - 4)
        if any(s in hay for s in p.forbidden):
            p = plan(task, rng, cfg)  # a key, value or name occurs in the text: draw again
            continue
        keep = max(0, tail_tokens - q_ids) + margin
        if len(hay_ids) <= keep:
            raise ValueError(
                f"{task}: a budget of {budget} tokens leaves no room for needles before the last "
                f"{tail_tokens} tokens"
            )
        end = len(codec.decode(hay_ids[: len(hay_ids) - keep]))
        end = hay.rfind("\n", 0, end) + 1
        text, placed = _place(hay, p.groups, depths, end)
        text = text.rstrip("\n") + "\n\n" + q
        ids = codec.encode(text)
        if len(ids) > budget:
            shrink += len(ids) - budget
            continue
        last = max(off + len(n.text) for off, n in placed)
        if last >= _tail_start(codec, text, ids, tail_tokens):
            margin *= 2
            continue
        answer = p.answer
        if ANSWER_RULE[task] == "set":  # as they appear
            answer = [n.item for _, n in placed if n.item is not None]
        meta = {
            **p.info,
            "question": p.question,
            "needles": [{"text": n.text, "offset": off, "answer": n.item} for off, n in placed],
            "depths": [round(off / len(text), 4) for off, _ in placed],
            "prompt_tokens": len(ids),
            "context_files": docs,
        }
        return RulerInstance(task, text, ids, answer, answer_text(answer), meta)
    raise RuntimeError(f"{task}: could not fit the prompt into {budget} tokens")


def _vocabulary(
    source: TextSource, order: list[int], n: int, banned: set[str]
) -> tuple[list[str], list[dict[str, Any]]]:
    """At least ``n`` distinct words from the documents in ``order`` (first appearance order),
    and the documents read."""
    words: dict[str, None] = {}
    used: list[dict[str, Any]] = []
    for i in order:
        if len(words) >= n:
            break
        doc = source.document(i)
        if doc is None:
            continue
        used.append({"file": doc.name, "sha256": doc.sha256, "truncated": False})
        for m in _WORD.finditer(doc.text):
            if m.group(0) not in banned:
                words.setdefault(m.group(0))
    return list(words), used


def _cwe_text(common: list[str], rare: list[str], cfg: RulerConfig, seed: float) -> str:
    entries = common * cfg.cwe_common_freq + rare * cfg.cwe_rare_freq
    random.Random(f"{seed}:{len(rare)}").shuffle(entries)
    body = "".join(f"# {i}. {w}\n" for i, w in enumerate(entries, 1))
    return CWE_HEADER + body + "\n" + question_block(cwe_question(cfg))


def _cwe_instance(
    source: TextSource, codec: TextCodec, budget: int, rng: random.Random, cfg: RulerConfig
) -> RulerInstance:
    order = list(range(len(source)))
    rng.shuffle(order)
    banned = set(re.findall(r"[a-z]+", cwe_question(cfg).lower() + CWE_HEADER.lower()))
    # an entry "# 123. word\n" is at least 3 tokens: enough words for any fill of the budget
    need = cfg.cwe_common + budget // (3 * cfg.cwe_rare_freq) + 1
    words, docs = _vocabulary(source, order, need, banned)
    rng.shuffle(words)
    common, pool = words[: cfg.cwe_common], words[cfg.cwe_common :]
    if len(common) < cfg.cwe_common:
        raise ValueError(f"cwe: the source has only {len(words)} distinct words")
    seed = rng.random()
    n_rare = min(len(pool), budget // (6 * cfg.cwe_rare_freq))  # a first guess
    ids = codec.encode(_cwe_text(common, pool[:n_rare], cfg, seed))
    per_entry = len(ids) / (cfg.cwe_common * cfg.cwe_common_freq + n_rare * cfg.cwe_rare_freq)
    spare = budget - len(ids)
    n_rare = max(0, min(len(pool), n_rare + math.floor(spare / (per_entry * cfg.cwe_rare_freq))))
    best: tuple[str, list[int], int] | None = None  # the longest list that fits
    for _ in range(16):
        text = _cwe_text(common, pool[:n_rare], cfg, seed)
        ids = codec.encode(text)
        step = (budget - len(ids)) / (per_entry * cfg.cwe_rare_freq)
        if len(ids) <= budget:
            if best is None or n_rare > best[2]:
                best = (text, ids, n_rare)
            if step < 1 or n_rare == len(pool):
                break  # no room for one more word
            n_rare = min(len(pool), n_rare + math.floor(step))
        elif n_rare == 0 or (best is not None and n_rare <= best[2] + 1):
            break
        else:
            n_rare = max(best[2] + 1 if best else 0, n_rare + math.floor(step))
    if best is None:
        raise ValueError(f"cwe: the common words alone exceed {budget} tokens")
    text, ids, n_rare = best
    first = {w: text.find(f". {w}\n") for w in common}
    answer = sorted(common, key=first.__getitem__)
    meta = {
        "question": cwe_question(cfg),
        "common": answer,
        "num_rare": n_rare,
        "prompt_tokens": len(ids),
        "context_files": docs,
    }
    return RulerInstance("cwe", text, ids, answer, answer_text(answer), meta)


def build_instance(
    task: str,
    source: TextSource,
    codec: TextCodec,
    budget: int,
    rng: random.Random,
    cfg: RulerConfig = RulerConfig(),  # noqa: B008 (frozen, never mutated)
    tail_tokens: int = 0,
) -> RulerInstance:
    """One instance of ``task`` (:data:`~herald.eval.ruler_formats.RULER_TASKS`) whose prompt
    holds at most ``budget`` tokens of ``codec``; no needle (asked or distractor) lies in the
    prompt's last ``tail_tokens`` tokens. Deterministic for (the source's documents, the
    tokenizer, the state of ``rng``, ``cfg``).

    Raises:
        ValueError: unknown task, a budget too small, a source too small.
    """
    cfg.validate()
    if task == "cwe":
        return _cwe_instance(source, codec, budget, rng, cfg)
    if task not in ANSWER_RULE:
        raise ValueError(f"unknown RULER task {task!r}; one of {tuple(ANSWER_RULE)}")
    return _needle_instance(task, source, codec, budget, rng, cfg, tail_tokens)
