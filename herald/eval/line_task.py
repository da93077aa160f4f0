"""The ``line`` task's builder (RepoBench-P-style next-line completion, described in
:mod:`herald.eval.tasks`): the prompt of a target line (cross-file context on the left, then the
file's header, imports and the code above the target) and the seeded walk over packages that
picks the targets of each setting (:mod:`herald.eval.line_targets`).
"""

from __future__ import annotations

import ast
import random
from typing import Any

from herald.eval.line_targets import (
    first_use_candidates,
    imported_package_names,
    later_use_candidates,
    line_candidates,
)
from herald.eval.sources import Corpus, SourceFile, TextCodec
from herald.eval.task_text import encode_tail, fill_left, mentions, module_names
from herald.eval.tasks import Example, TaskConfig


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
    infile, truncated = encode_tail(codec, text, cap, ratio)
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
                body, _ = encode_tail(codec, body_text, cap - len(head) - len(imp), ratio)
                shown = codec.decode(body)
                kept = [(stmt, ids) for stmt, ids in stmts if stmt not in shown]
                if kept == stmts:
                    break
                stmts = kept
            infile = head + imp + body
            import_tokens = len(imp)
    others = [r for r in corpus.packages[f.package] if r != f.rel]
    ctx, used = fill_left(corpus, corpus.related_order(f.rel, others), context - len(infile))
    meta = {
        "infile_tokens": len(infile),
        "infile_truncated": truncated,
        "import_tokens": import_tokens,
        "context_files": used,
    }
    return ctx + infile, meta


def build_line(
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
                cross = imported_package_names(f)
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
        if not any(mentions(codec, ids[-cfg.control_tokens :], name) for name in names):
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
                    names_cache[r] = module_names(other) if other is not None else set()
                package_names |= names_cache[r]
        cands_cache[f.rel] = line_candidates(f, imported_package_names(f), package_names)
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
