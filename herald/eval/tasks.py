"""Long-context examples built at run time from the standard library (issue 6, part 3).

Two tasks, both deterministic for a seed and a tokenizer:

``line`` (RepoBench-P style next-line completion)
    Pick a package (``email/``, ``asyncio/``, ...), a file of it and a target line. The prompt is
    the package's other files, each under a ``# file: path`` header, ordered least to most related
    (the files the target imports sit last, next to it), then the target file's in-file context,
    ending at the last non-blank character before the target line (see ``line_prompt_text``: a
    prompt ending in a newline would be a token boundary the model never saw before an indented
    line). The cross-file part is truncated from the LEFT so that the prompt is ``context``
    tokens; the in-file context is always kept, capped at ``infile_tokens`` tokens: when the
    prefix is longer, it is (as RepoBench's ``import_statement`` + ``cropped_code``) the file's
    ``# file:`` header, its module-level import statements (at most half the cap) and the code
    just above the target, cut on the left. Target lines are single-line logical lines of 10-160
    characters (simple statements or compound-statement headers such as ``if x:`` or
    ``except E:``) that are not comments, docstrings, imports or decorators and do not already
    occur in the file above. Three settings, after RepoBench's (``TaskConfig.line_setting``):

    - ``cross_file_first``: the line where a name the file imports (above that line)
      from another file of its package is first read (a use, not a binding such as a parameter
      of the same spelling), and none of the names it first reads occurs in the last
      ``control_tokens`` tokens of the prompt: the no-context control cannot copy them, only the
      long context (the import statements and the other files) holds them.
    - ``cross_file_random`` (default): a random line, preferring lines that use a name imported
      from another file of the package (tier 2), then lines using a name defined at top level in
      another file (tier 1), then any (tier 0); so some targets use no cross-file name (not
      RepoBench's ``cross_file_random``, which ``cross_file_later`` follows). The setting on which
      the bundled model's long-context gain was confirmed on held-out targets
      (``results/eval/README.md``).
    - ``cross_file_later``: RepoBench's ``cross_file_random`` (a read of such an
      imported name that is not its first in the file) with ``cross_file_first``'s condition:
      none of the imported names the line reads occurs in the control window, so the control
      sees neither their import nor their earlier uses; only the long context does
      (``results/eval/README.md`` has what the bundled model scores on each setting).

    The same targets are asked at every context length (paired; the in-file context and the
    control window do not depend on it once ``context`` holds both), only the amount of
    cross-file context changes.

``recall`` (long-range identifier recall)
    In one file, an identifier defined (``def``/``class``, a module- or class-level assignment, or
    ``self.<name> = ...``) at least ``min_distance`` tokens before a later use. The prompt ends just
    before that use (trailing spaces dropped), at a token boundary of the file's text
    (``ends_at_token_boundary``: not inside a token such as ``._``); the identifier must not
    occur anywhere in the last ``control_tokens`` tokens of the prompt (so the no-context control
    cannot copy it), must not be a keyword, builtin or common name, and the use must not start a
    statement or be an assignment target. The definition lies inside the prompt (distance <=
    context - margin), so the example set depends on ``context``; the rest of the prompt is
    filled, on the left, with related files (package siblings, or the modules a top-level file
    imports).

Every example's ``meta`` records the files (path, sha256), line numbers and choices.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import io
import json
import keyword
import random
import re
import tokenize
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from herald.eval.sources import Corpus, SourceFile, TextCodec
from herald.pyimports import absolute_module

TASKS = ("line", "recall")
LINE_SETTINGS = ("cross_file_first", "cross_file_random", "cross_file_later")

COMMON_NAMES = frozenset(
    """self cls args kwargs name value values key keys data result results path obj func text
    line lines msg item items node nodes size index start stop end count type kind mode other
    parent child first last left right base info error errors flags file files options default
    state source target buffer body head tail list dict call close read write open send recv get
    set put pop append extend update remove clear copy format parse join split strip match group
    length level token tokens entry field fields config context test tests main run""".split()  # noqa: SIM905
)
"""Names too generic to test recall (any file has them); also excluded: keywords, builtins."""

_TOP_LEVEL = re.compile(
    r"^(?:async[ \t]+)?def[ \t]+(\w+)|^class[ \t]+(\w+)|^(\w+)[ \t]*(?::[^=\n]*)?=(?!=)",
    re.MULTILINE,
)
_WORD = re.compile(r"\w+")
"""A maximal run of word characters: an identifier matches ``\\bname\\b`` exactly when it is
one such run."""


@dataclass
class Example:
    """One prompt and its reference answer.

    ``prompt_ids``: token ids (``len <= context``); ``target``: the expected line (``line``) or
    identifier (``recall``); ``meta``: the recorded selection (files, sha256, lines, choices).
    """

    example_id: str
    task: str
    context: int
    prompt_ids: list[int]
    target: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskConfig:
    """Knobs of the builders; part of every result's recorded config."""

    seed: int = 0
    control_tokens: int = 512
    """The no-context control sees the last this-many prompt tokens."""
    infile_tokens: int = 4096
    """line: the in-file prefix is capped at this many tokens (at most context // 2)."""
    min_distance: int = 2000
    """recall: tokens between the definition line and the use, at least."""
    distance_margin: int = 64
    """recall: the definition sits at least this many tokens inside the prompt's left edge."""
    min_package_chars: int = 60_000
    """line: packages with fewer characters of eligible source are skipped (too little context
    for 16K tokens)."""
    line_setting: str = "cross_file_random"
    """line: which target lines (RepoBench's settings, :data:`LINE_SETTINGS`): the first use of a
    name imported from another file of the package, absent from the control window
    (``cross_file_first``), a random line preferring such uses (``cross_file_random``), or a later
    use of such names, absent from the control window (``cross_file_later``)."""

    def infile_cap(self, context: int) -> int:
        """line: tokens of in-file context at ``context``: ``infile_tokens``, at most half."""
        return max(1, min(self.infile_tokens, context // 2))


def selection_hash(examples: list[Example]) -> str:
    """sha256 over (id, prompt ids, target) of every example: equal hashes = same prompts."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(ex.example_id.encode())
        h.update(json.dumps(ex.prompt_ids).encode())
        h.update(ex.target.encode())
    return h.hexdigest()


def build_examples(
    task: str,
    corpus: Corpus,
    codec: TextCodec,
    context: int,
    num_examples: int,
    cfg: TaskConfig = TaskConfig(),  # noqa: B008 (frozen, never mutated)
) -> list[Example]:
    """Build ``num_examples`` examples of ``task`` whose prompts hold at most ``context`` tokens.

    ``corpus.codec`` must be ``codec``. Deterministic for (corpus files, tokenizer, ``cfg``).
    May return fewer examples than asked when the corpus has no more eligible ones. The examples
    of a build are a prefix of those of a larger build with the same settings.

    Raises:
        ValueError: unknown task, or ``context`` not above ``cfg.control_tokens`` /
            ``cfg.min_distance + cfg.distance_margin`` (recall).
    """
    for name in ("control_tokens", "infile_tokens", "min_distance"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"TaskConfig.{name} must be >= 1, got {getattr(cfg, name)}")
    if task == "line":
        if cfg.line_setting not in LINE_SETTINGS:
            raise ValueError(f"unknown line setting {cfg.line_setting!r}; one of {LINE_SETTINGS}")
        return _build_line(corpus, codec, context, num_examples, cfg)
    if task == "recall":
        return _build_recall(corpus, codec, context, num_examples, cfg)
    raise ValueError(f"unknown task {task!r}; one of {TASKS}")


# -- shared ---------------------------------------------------------------------------------------
def _encode_tail(codec: TextCodec, text: str, n: int, ratio: float) -> tuple[list[int], bool]:
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


def _mentions(codec: TextCodec, ids: list[int], name: str) -> bool:
    """Whether the decoded ``ids`` hold ``name`` as a whole word."""
    return name in {m.group(0) for m in _WORD.finditer(codec.decode(ids))}


def _fill_left(corpus: Corpus, others: list[str], budget: int) -> tuple[list[int], list[dict]]:
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


def _module_names(f: SourceFile) -> set[str]:
    """Names bound at module level (``def``, ``class``, ``name =`` at column 0; a line scan)."""
    return {next(g for g in m.groups() if g) for m in _TOP_LEVEL.finditer(f.text)}


def _tokens(f: SourceFile) -> list[tokenize.TokenInfo] | None:
    try:
        return list(tokenize.generate_tokens(io.StringIO(f.text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None


_SKIP = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)


# -- line completion ------------------------------------------------------------------------------
def _imported_package_names(f: SourceFile) -> set[str]:
    """Names ``f`` binds by importing from other files of its own package."""
    out: set[str] = set()
    if f.tree is None or not f.package:
        return out
    for node in ast.walk(f.tree):
        if isinstance(node, ast.ImportFrom):
            module = absolute_module(f.rel, node.level, node.module)
            if module is None or module.split(".")[0] != f.package:
                continue
            out.update((a.asname or a.name) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == f.package:
                    out.add(a.asname or a.name.split(".")[0])
    return out


def _statements(f: SourceFile) -> list[tuple[int, list[tokenize.TokenInfo], bool]]:
    """Every logical statement of ``f`` in order: ``(row, tokens, single_line)``, row 1-based,
    tokens without comments, NL, INDENT and DEDENT."""
    toks = _tokens(f)
    if toks is None:
        return []
    out: list[tuple[int, list[tokenize.TokenInfo], bool]] = []
    logical: list[tokenize.TokenInfo] = []
    for tok in toks:
        if tok.type in _SKIP or tok.type == tokenize.ENCODING:
            continue
        if tok.type not in (tokenize.NEWLINE, tokenize.ENDMARKER):
            logical.append(tok)
            continue
        stmt, logical = logical, []
        if stmt:
            row = stmt[0].start[0]
            single = all(t.start[0] == row and t.end[0] == row for t in stmt)
            out.append((row, stmt, single))
    return out


def _loads_by_row(f: SourceFile) -> dict[int, set[str]]:
    """Line -> the names read there (``ast.Name`` in ``Load`` context): uses, not bindings
    (``def``/``class`` names, parameters, assignment targets, ``global``) and not attributes (in
    ``self.wait()`` the attribute ``wait`` is not the ``wait`` another file defines)."""
    out: dict[int, set[str]] = {}
    if f.tree is not None:
        for node in ast.walk(f.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                out.setdefault(node.lineno, set()).add(node.id)
    return out


def _import_rows(f: SourceFile) -> dict[str, int]:
    """Name -> the first line of an import statement (module level or local) that binds it."""
    out: dict[str, int] = {}
    if f.tree is not None:
        for node in ast.walk(f.tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    if name != "*" and node.lineno < out.get(name, node.lineno + 1):
                        out[name] = node.lineno
    return out


def _eligible_target(
    f: SourceFile, row: int, stmt: list[tokenize.TokenInfo], single: bool, first_row: dict[str, int]
) -> bool:
    """A single-line statement of 10-160 characters, not a comment, docstring, import or
    decorator, at line 5 or later, not a repeat of a line above."""
    if not single or stmt[0].type == tokenize.STRING or stmt[0].string in ("import", "from", "@"):
        return False
    text = f.lines[row - 1].strip()
    words = {t.string for t in stmt if t.type == tokenize.NAME and not keyword.iskeyword(t.string)}
    return (
        10 <= len(text) <= 160
        and not text.startswith("#")
        and row >= 5
        and bool(words)
        and first_row.get(text) == row
    )


def _first_rows(f: SourceFile) -> dict[str, int]:
    first_row: dict[str, int] = {}  # stripped text -> first line holding it
    for i, line in enumerate(f.lines, 1):
        first_row.setdefault(line.strip(), i)
    return first_row


def line_candidates(f: SourceFile, cross: set[str], package: set[str]) -> list[tuple[int, int]]:
    """``cross_file_random`` targets of ``f``: ``(row, tier)``, row 1-based (module docstring);
    a line's tier counts the names it reads (:func:`_loads_by_row`)."""
    first_row = _first_rows(f)
    loads = _loads_by_row(f)
    out: list[tuple[int, int]] = []
    for row, stmt, single in _statements(f):
        if _eligible_target(f, row, stmt, single, first_row):
            used = loads.get(row, set())
            out.append((row, 2 if used & cross else 1 if used & package else 0))
    return out


def first_use_candidates(f: SourceFile, cross: set[str]) -> list[tuple[int, list[str]]]:
    """``cross_file_first`` targets of ``f``: ``(row, names)`` for each eligible target line
    that is the first line of the file to read (:func:`_loads_by_row`) names that ``f`` imports
    from another file of its package (``cross``), each imported above that line."""
    return _cross_use_candidates(f, cross, later=False)


def later_use_candidates(f: SourceFile, cross: set[str]) -> list[tuple[int, list[str]]]:
    """``cross_file_later`` targets of ``f``: ``(row, names)`` for each eligible target line
    that reads names ``f`` imports from another file of its package (``cross``), each imported
    above it and each read on an earlier line too (no first use: those are ``cross_file_first``
    targets)."""
    return _cross_use_candidates(f, cross, later=True)


def _cross_use_candidates(
    f: SourceFile, cross: set[str], later: bool
) -> list[tuple[int, list[str]]]:
    loads = _loads_by_row(f)
    imported = _import_rows(f)
    first_read: dict[str, int] = {}
    for row in sorted(loads):
        for name in loads[row] & cross:
            first_read.setdefault(name, row)
    by_row: dict[int, list[str]] = {}
    if later:
        for row, names in loads.items():
            read = names & cross
            if read and all(first_read[n] < row and imported.get(n, row) < row for n in read):
                by_row[row] = sorted(read)
    else:
        for name, row in first_read.items():
            if imported.get(name, row) < row:
                by_row.setdefault(row, []).append(name)
    first_row = _first_rows(f)
    return [
        (row, sorted(by_row[row]))
        for row, stmt, single in _statements(f)
        if row in by_row and _eligible_target(f, row, stmt, single, first_row)
    ]


def line_prompt_text(f: SourceFile, row: int) -> str:
    """The in-file prompt text for target line ``row`` (1-based) of ``f``: its ``# file:`` header
    and the lines above the target, with the trailing whitespace (the newline before the target
    and any blank lines) removed."""
    return (f.header + "".join(f.lines[: row - 1])).rstrip()


def import_statements(f: SourceFile, before: int) -> list[str]:
    """The module-level import statements of ``f`` (direct children of the module, so the text
    stays valid code) that start above line ``before`` (1-based), in file order, each as its
    source lines (RepoBench's ``import_statement``)."""
    if f.tree is None:
        return []
    return [
        "".join(f.lines[node.lineno - 1 : node.end_lineno or node.lineno])
        for node in f.tree.body
        if isinstance(node, ast.Import | ast.ImportFrom) and node.lineno < before
    ]


def _line_prompt(
    corpus: Corpus, codec: TextCodec, f: SourceFile, row: int, context: int, cfg: TaskConfig
) -> tuple[list[int], dict[str, Any]]:
    cap = cfg.infile_cap(context)
    # NOTE: the prompt stops at the last non-blank character before the target line, not after
    # its newline. Byte-level BPE merges a newline with the next line's indentation into one
    # token ("\n" + 8 spaces), so a prompt ending in a bare "\n" token tells the model that the
    # next line is NOT indented: the model then completes almost every target with a top-level
    # ``def``. The model writes the newline-and-indentation token itself; scoring strips it.
    text = line_prompt_text(f, row)
    ratio = len(f.chunk()) / max(1, len(corpus.chunk_ids(f.rel)))  # characters per token
    infile, truncated = _encode_tail(codec, text, cap, ratio)
    import_tokens = 0
    if truncated:
        # As RepoBench's in-file context: the file's header and import statements, then the
        # code just above the target (cut on the left). The imports take at most half the cap
        # (the first whole statements that fit); those the kept code already shows are not
        # repeated, and their tokens go back to the code.
        head = codec.encode(f.header)
        if len(head) < cap:
            stmts: list[tuple[str, list[int]]] = []  # (text, its tokens)
            size = len(head)
            for stmt in import_statements(f, row):
                ids = codec.encode(stmt)
                size += len(ids)
                if size > cap // 2:
                    break
                stmts.append((stmt, ids))
            body_text = text[len(f.header) :]
            for _ in range(3):
                imp = [t for _, ids in stmts for t in ids]
                body, _ = _encode_tail(codec, body_text, cap - len(head) - len(imp), ratio)
                shown = codec.decode(body)
                kept = [(stmt, ids) for stmt, ids in stmts if stmt not in shown]
                if kept == stmts:
                    break
                stmts = kept
            infile = head + imp + body
            import_tokens = len(imp)
    others = [r for r in corpus.packages[f.package] if r != f.rel]
    ctx, used = _fill_left(corpus, corpus.related_order(f.rel, others), context - len(infile))
    meta = {
        "infile_tokens": len(infile),
        "infile_truncated": truncated,
        "import_tokens": import_tokens,
        "context_files": used,
    }
    return ctx + infile, meta


def _build_line(
    corpus: Corpus, codec: TextCodec, context: int, n: int, cfg: TaskConfig
) -> list[Example]:
    if context <= cfg.control_tokens:
        raise ValueError(f"context {context} must exceed control_tokens {cfg.control_tokens}")
    rng = random.Random(f"line:{cfg.seed}")
    pkgs = []
    for name, files in sorted(corpus.packages.items()):
        chars = sum(len(f.text) for r in files if (f := corpus.read(r)) is not None)
        if len(files) >= 3 and chars >= cfg.min_package_chars:
            pkgs.append(name)
    rng.shuffle(pkgs)
    if not pkgs:
        return []
    names_cache: dict[str, set[str]] = {}
    cands_cache: dict[str, list[tuple[int, int]]] = {}
    chosen: set[tuple[str, int]] = set()
    examples: list[Example] = []
    pooled = cfg.line_setting in ("cross_file_first", "cross_file_later")
    pools = _cross_use_pools(corpus, pkgs, rng, cfg.line_setting) if pooled else {}
    exhausted: set[str] = set()  # cross_file_random: packages with no eligible line left
    i = 0
    while len(examples) < n:
        pkg = pkgs[i % len(pkgs)]
        i += 1
        if pooled:
            pick = _pick_cross_use(corpus, codec, pools[pkg], context, cfg)
            if pick is None:  # this package's pool ran out
                if not any(pools.values()):
                    break  # every candidate tried
                continue
        else:
            # An exhausted package is still visited (its random draws are made as before), so
            # the examples of a build are a prefix of those of any larger build of that seed.
            pick = _pick_random_use(
                corpus,
                codec,
                corpus.packages[pkg],
                context,
                cfg,
                rng,
                chosen,
                names_cache,
                cands_cache,
            )
            if pick is None:
                files = corpus.packages[pkg]
                if pkg not in exhausted and not any(
                    (f.rel, row) not in chosen
                    for f in map(corpus.read, files)
                    if f is not None and f.tree is not None
                    for row, _ in _file_candidates(corpus, f, files, names_cache, cands_cache)
                ):
                    exhausted.add(pkg)
                    if len(exhausted) == len(pkgs):
                        break  # every eligible line of every package asked
                continue
        f, row, choice, ids, prompt_meta = pick
        chosen.add((f.rel, row))
        target = f.lines[row - 1].rstrip("\r\n")
        meta = {
            "package": pkg,
            "file": f.rel,
            "sha256": f.sha256,
            "line": row,
            **choice,
            "prompt_tokens": len(ids),
            **prompt_meta,
        }
        examples.append(
            Example(f"line-{context}-{len(examples):03d}", "line", context, ids, target, meta)
        )
    return examples


_Pick = tuple[SourceFile, int, dict[str, Any], list[int], dict[str, Any]]
"""A chosen target: file, row, the choice's meta, prompt ids and the prompt's meta."""


def _cross_use_pools(
    corpus: Corpus, pkgs: list[str], rng: random.Random, setting: str
) -> dict[str, list[tuple[SourceFile, int, list[str]]]]:
    """``cross_file_first`` / ``cross_file_later``: every candidate of each package (file, row,
    names), in a seeded random order; :func:`_pick_cross_use` pops them."""
    candidates = first_use_candidates if setting == "cross_file_first" else later_use_candidates
    pools: dict[str, list[tuple[SourceFile, int, list[str]]]] = {}
    for pkg in pkgs:
        pool = []
        for rel in corpus.packages[pkg]:
            f = corpus.read(rel)
            if f is not None and f.tree is not None:
                cross = _imported_package_names(f)
                pool += [(f, row, names) for row, names in candidates(f, cross)]
        rng.shuffle(pool)
        pools[pkg] = pool
    return pools


def _pick_cross_use(
    corpus: Corpus,
    codec: TextCodec,
    pool: list[tuple[SourceFile, int, list[str]]],
    context: int,
    cfg: TaskConfig,
) -> _Pick | None:
    """``cross_file_first`` / ``cross_file_later``: the next candidate of ``pool`` (popped) none
    of whose imported names occurs in the control window (the last ``control_tokens`` prompt
    tokens), so that only the long context holds the names' import, definition and earlier
    uses; None when ``pool`` runs out."""
    while pool:
        f, row, names = pool.pop()
        ids, meta = _line_prompt(corpus, codec, f, row, context, cfg)
        if not any(_mentions(codec, ids[-cfg.control_tokens :], name) for name in names):
            return f, row, {"setting": cfg.line_setting, "names": names}, ids, meta
    return None


def _file_candidates(
    corpus: Corpus,
    f: SourceFile,
    files: list[str],
    names_cache: dict[str, set[str]],
    cands_cache: dict[str, list[tuple[int, int]]],
) -> list[tuple[int, int]]:
    """``cross_file_random``: :func:`line_candidates` of ``f`` (a parsed file of the package whose
    files are ``files``), computed once per build through the two caches of
    :func:`_pick_random_use`."""
    if f.rel not in cands_cache:
        package_names: set[str] = set()
        for r in files:
            if r != f.rel:
                if r not in names_cache:
                    other = corpus.read(r)
                    names_cache[r] = _module_names(other) if other is not None else set()
                package_names |= names_cache[r]
        cands_cache[f.rel] = line_candidates(f, _imported_package_names(f), package_names)
    return cands_cache[f.rel]


def _pick_random_use(
    corpus: Corpus,
    codec: TextCodec,
    files: list[str],
    context: int,
    cfg: TaskConfig,
    rng: random.Random,
    chosen: set[tuple[str, int]],
    names_cache: dict[str, set[str]],
    cands_cache: dict[str, list[tuple[int, int]]],
) -> _Pick | None:
    """``cross_file_random``: a random line of the best tier among a few files (tier 2 uses a
    name imported from another file of the package, tier 1 a name defined at top level in
    another file, tier 0 any); None if no file has an eligible line.

    ``names_cache`` (file -> its top-level names) and ``cands_cache`` (file -> its
    :func:`line_candidates`, before dropping the ``chosen`` ones) carry over between calls of one
    build: a file's candidates depend only on the file and its package, and tokenizing and
    walking each file once instead of at every visit makes a build of 1,000+ examples several
    times faster. The random draws, and so the examples, are the same as without them."""
    best: tuple[int, SourceFile, list[int]] | None = None
    for _ in range(4):  # a few files; keep the one with the best tier
        f = corpus.read(rng.choice(files))
        if f is None or f.tree is None:
            continue
        cands = [
            (row, t)
            for row, t in _file_candidates(corpus, f, files, names_cache, cands_cache)
            if (f.rel, row) not in chosen
        ]
        if not cands:
            continue
        tier = max(t for _, t in cands)
        if best is None or tier > best[0]:
            best = (tier, f, [row for row, t in cands if t == tier])
        if tier == 2:
            break
    if best is None:
        return None
    tier, f, rows = best
    row = rng.choice(rows)
    ids, meta = _line_prompt(corpus, codec, f, row, context, cfg)
    return f, row, {"setting": "cross_file_random", "tier": tier}, ids, meta


# -- long-range recall ----------------------------------------------------------------------------
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
    toks = _tokens(f)
    if not defs or toks is None:
        return []
    occurrences: dict[str, list[int]] = {}  # name -> end offsets of its whole-word matches
    for m in _WORD.finditer(f.text):
        if m.group(0) in defs:
            occurrences.setdefault(m.group(0), []).append(m.end())
    out: list[RecallUse] = []
    sig = [t for t in toks if t.type not in _SKIP or t.type in (tokenize.INDENT, tokenize.DEDENT)]
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
    if _mentions(codec, near[-cfg.control_tokens :], use.name):
        return None
    infile, truncated = _encode_tail(codec, f.header + prefix, context, ratio)
    if _mentions(codec, infile[-cfg.control_tokens :], use.name):
        return None
    if f.package:
        others = [r for r in corpus.packages.get(f.package, []) if r != f.rel]
    else:
        others = corpus.imports(f.rel)
    ctx, used = _fill_left(corpus, corpus.related_order(f.rel, others), context - len(infile))
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


def _build_recall(
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
