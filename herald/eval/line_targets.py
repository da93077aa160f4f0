"""Target lines of the ``line`` task (:mod:`herald.eval.tasks`, RepoBench's settings): the
eligible statements of a file and, per setting, the candidate lines with the names they read
that the file imports from other files of its package.
"""

from __future__ import annotations

import ast
import keyword
import tokenize

from herald.eval.sources import SourceFile
from herald.eval.task_text import SKIP_TOKENS, python_tokens
from herald.pyimports import absolute_module


def imported_package_names(f: SourceFile) -> set[str]:
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
    toks = python_tokens(f)
    if toks is None:
        return []
    out: list[tuple[int, list[tokenize.TokenInfo], bool]] = []
    logical: list[tokenize.TokenInfo] = []
    for tok in toks:
        if tok.type in SKIP_TOKENS or tok.type == tokenize.ENCODING:
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
    """``cross_file_random`` targets of ``f``: ``(row, tier)``, row 1-based (the tiers:
    :mod:`herald.eval.tasks`); a line's tier counts the names it reads (:func:`_loads_by_row`)."""
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
