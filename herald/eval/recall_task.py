"""The ``recall`` task's builder (long-range identifier recall, described in
:mod:`herald.eval.tasks`): definitions and later uses of eligible identifiers in a file, the
token-level checks of a use (distance, control window, token boundary) and the prompt, filled on
the left with related files.
"""

from __future__ import annotations

import ast
import builtins
import keyword
import random
import tokenize
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from herald.eval.sources import Corpus, SourceFile, TextCodec
from herald.eval.task_text import SKIP_TOKENS, WORD, encode_tail, fill_left, mentions, python_tokens
from herald.eval.tasks import Example, TaskConfig

COMMON_NAMES = frozenset(
    """self cls args kwargs name value values key keys data result results path obj func text
    line lines msg item items node nodes size index start stop end count type kind mode other
    parent child first last left right base info error errors flags file files options default
    state source target buffer body head tail list dict call close read write open send recv get
    set put pop append extend update remove clear copy format parse join split strip match group
    length level token tokens entry field fields config context test tests main run""".split()  # noqa: SIM905
)
"""Names too generic to test recall (any file has them); also excluded: keywords, builtins."""


def _definitions(f: SourceFile) -> dict[str, tuple[int, str]]:
    """name -> (first definition line, kind) for def/class (any depth), module- and class-level
    assignments and ``self.<name> = ...``."""
    out: dict[str, tuple[int, str]] = {}
    if f.tree is None:
        return out

    def add(name: str, line: int, kind: str) -> None:
        if name not in out or line < out[name][0]:
            out[name] = (line, kind)

    def assigned(node: ast.stmt) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, ast.AnnAssign):
            return [node.target]
        return []

    bodies: list[list[ast.stmt]] = [f.tree.body]
    for node in ast.walk(f.tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            add(node.name, node.lineno, "def")
        elif isinstance(node, ast.ClassDef):
            add(node.name, node.lineno, "class")
            bodies.append(node.body)
        if not isinstance(node, ast.stmt):
            continue
        for t in assigned(node):
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    add(sub.attr, node.lineno, "attribute")
    for body in bodies:
        for node in body:
            for t in assigned(node):
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        add(sub.id, node.lineno, "assignment")
    return out


def eligible_identifier(name: str) -> bool:
    """Long enough, not a keyword, builtin, dunder or common name."""
    return (
        len(name) >= 4
        and not keyword.iskeyword(name)
        and not hasattr(builtins, name)
        and name not in COMMON_NAMES
        and not (name.startswith("__") and name.endswith("__"))
    )


@dataclass(frozen=True)
class RecallUse:
    """A use of ``name`` at ``offset`` (characters; line ``row``, column ``col``) defined at line
    ``def_line``."""

    name: str
    kind: str
    def_line: int
    row: int
    col: int
    offset: int


def recall_candidates(
    f: SourceFile, min_chars: int, max_chars: int, gap_chars: int
) -> list[RecallUse]:
    """Uses of eligible identifiers ``min_chars`` to ``max_chars`` after their definition line
    whose previous occurrence ends at least ``gap_chars`` before them (a character-level
    prefilter of the token-level constraints)."""
    defs = {n: d for n, d in _definitions(f).items() if eligible_identifier(n)}
    toks = python_tokens(f)
    if not defs or toks is None:
        return []
    occurrences: dict[str, list[int]] = {}  # name -> end offsets of its whole-word matches
    for m in WORD.finditer(f.text):
        if m.group(0) in defs:
            occurrences.setdefault(m.group(0), []).append(m.end())
    out: list[RecallUse] = []
    sig = [
        t for t in toks if t.type not in SKIP_TOKENS or t.type in (tokenize.INDENT, tokenize.DEDENT)
    ]
    stmt_first = ""
    for j, tok in enumerate(sig):
        prev = sig[j - 1] if j else None
        if prev is None or prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            stmt_first = tok.string
        if tok.type != tokenize.NAME or tok.string not in defs:
            continue
        name = tok.string
        def_line, kind = defs[name]
        row, col = tok.start
        if row <= def_line or prev is None:
            continue
        if prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue  # starts a statement: too open-ended
        if prev.string in ("def", "class", "import", "from", "as", "global", "nonlocal", "del"):
            continue
        if stmt_first in ("import", "from"):
            continue
        nxt = sig[j + 1] if j + 1 < len(sig) else None
        if nxt is not None and nxt.string in ("=", ":=") and nxt.type == tokenize.OP:
            continue  # an assignment target
        offset = f.line_offsets[row - 1] + col
        if not min_chars <= offset - f.line_offsets[def_line - 1] <= max_chars:
            continue
        ends = occurrences[name]
        k = bisect_left(ends, offset + 1) - 1  # last occurrence ending at or before offset
        if k >= 0 and offset - ends[k] < gap_chars:
            continue
        out.append(RecallUse(name, kind, def_line, row, col, offset))
    return out


def ends_at_token_boundary(codec: TextCodec, f: SourceFile, row: int, end: int) -> bool:
    """Whether cutting ``f.text`` at character ``end`` (on line ``row``, 1-based) is a boundary
    of the tokenizer: the tokens of the text before ``end`` are a prefix of the tokens of the text
    through the end of that line. A prompt cut inside a token (``self.`` before ``_name``, where
    ``._`` is one token, or a bare newline before an indented line) is a state the model never
    saw in training. Checked on a window from the start of the line above (byte-level
    pre-tokenizers split at whitespace, so earlier text cannot change the boundary)."""
    start = f.line_offsets[max(0, row - 2)]
    stop = f.line_offsets[min(row, len(f.line_offsets) - 1)]
    head = codec.encode(f.text[start:end])
    return codec.encode(f.text[start:stop])[: len(head)] == head


def _recall_prompt(
    corpus: Corpus,
    codec: TextCodec,
    f: SourceFile,
    use: RecallUse,
    context: int,
    cfg: TaskConfig,
    ratio: float,
) -> tuple[list[int], dict[str, Any]] | None:
    """The prompt for ``use`` or None if an exact (token-level) constraint fails."""
    prefix = f.text[: use.offset].rstrip(" \t")
    if not ends_at_token_boundary(codec, f, use.row, len(prefix)):
        return None
    near = codec.encode(prefix[f.line_offsets[use.def_line - 1] :])  # definition line .. use
    distance = len(near)
    if not cfg.min_distance <= distance <= context - cfg.distance_margin:
        return None
    # The control window (last control_tokens) lies inside ``near`` (min_distance >=
    # control_tokens); checked again on the final prompt below.
    if mentions(codec, near[-cfg.control_tokens :], use.name):
        return None
    infile, truncated = encode_tail(codec, f.header + prefix, context, ratio)
    if mentions(codec, infile[-cfg.control_tokens :], use.name):
        return None
    if f.package:
        others = [r for r in corpus.packages.get(f.package, []) if r != f.rel]
    else:
        others = corpus.imports(f.rel)
    ctx, used = fill_left(corpus, corpus.related_order(f.rel, others), context - len(infile))
    ids = ctx + infile
    meta = {
        "file": f.rel,
        "sha256": f.sha256,
        "identifier": use.name,
        "kind": use.kind,
        "def_line": use.def_line,
        "line": use.row,
        "col": use.col,
        "distance_tokens": distance,
        "prompt_tokens": len(ids),
        "infile_tokens": len(infile),
        "infile_truncated": truncated,
        "context_files": used,
    }
    return ids, meta


def build_recall(
    corpus: Corpus, codec: TextCodec, context: int, n: int, cfg: TaskConfig
) -> list[Example]:
    if cfg.min_distance < cfg.control_tokens:
        raise ValueError(
            f"min_distance ({cfg.min_distance}) must be >= control_tokens ({cfg.control_tokens})"
        )
    if context < cfg.min_distance + cfg.distance_margin or context <= cfg.control_tokens:
        raise ValueError(
            f"recall needs context >= min_distance + distance_margin "
            f"({cfg.min_distance} + {cfg.distance_margin}) and > control_tokens "
            f"({cfg.control_tokens}), got {context}"
        )
    rng = random.Random(f"recall:{cfg.seed}:{context}")
    files = list(corpus.rel_paths)
    rng.shuffle(files)
    cands: dict[str, list[RecallUse]] = {}
    ratios: dict[str, float] = {}  # characters per token of each file
    used: set[tuple[str, str]] = set()
    examples: list[Example] = []
    while len(examples) < n:
        progress = False
        for rel in files:
            if len(examples) >= n:
                break
            f = corpus.read(rel)
            if f is None:
                continue
            if rel not in cands and len(f.text) < cfg.min_distance:
                cands[rel] = []  # a token is at least one character: too short to qualify
            if rel not in cands:
                sample = f.text[:8192]  # characters per token, estimated on the file's start
                ratio = ratios[rel] = len(sample) / max(1, len(codec.encode(sample)))
                found = recall_candidates(
                    f,
                    int(0.8 * cfg.min_distance * ratio),
                    int(1.25 * (context - cfg.distance_margin) * ratio),
                    int(0.7 * cfg.control_tokens * ratio),
                )
                rng.shuffle(found)
                cands[rel] = found
            pool = [u for u in cands[rel] if (rel, u.name) not in used]
            progress |= bool(pool)  # candidates left to try in the next pass
            for use in pool[:8]:
                built = _recall_prompt(corpus, codec, f, use, context, cfg, ratios[rel])
                cands[rel].remove(use)
                if built is None:
                    continue
                ids_, meta = built
                used.add((rel, use.name))
                eid = f"recall-{context}-{len(examples):03d}"
                examples.append(Example(eid, "recall", context, ids_, use.name, meta))
                break
        if not progress:
            break
    return examples
