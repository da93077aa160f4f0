"""Which modules a Python source file imports, found by a line scan (no parsing, no imports run).

Shared by the evaluation corpus (:mod:`herald.eval.sources`: a package's files ordered by
relatedness to a target) and the training stream (:mod:`herald.train.corpus`: a package's files
in dependency order), so both read a file's imports the same way.
"""

from __future__ import annotations

import re

_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)"
    r"|import[ \t]+([^\n#;]*))",
    re.MULTILINE,
)
"""``from .mod import a, (b, c)`` / ``import a.b as c`` at the start of a line (cheaper than
parsing every file; a docstring line that looks like an import only adds a candidate)."""


def module_name(rel: str) -> str:
    """Dotted module name of a ``/``-separated ``.py`` path: ``email/utils.py`` ->
    ``email.utils``; a package's ``__init__.py`` is the package (``email/__init__.py`` ->
    ``email``)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def absolute_module(rel: str, level: int, module: str | None) -> str | None:
    """The dotted name that ``from <level dots><module> import ...`` names in the file ``rel``:
    ``module`` itself when ``level`` is 0, else resolved against ``rel``'s package
    (``email/mime/text.py``, level 2, ``utils`` -> ``email.utils``); None when the dots go
    beyond the top-level package."""
    if not level:
        return module or ""
    pkg_parts = module_name(rel).split(".")
    if not rel.endswith("__init__.py"):
        pkg_parts = pkg_parts[:-1]
    if level > len(pkg_parts):
        return None
    base = pkg_parts[: len(pkg_parts) - level + 1]
    return ".".join(base + ([module] if module else []))


def imported_modules(text: str, rel: str) -> list[str]:
    """Dotted names that the file ``rel`` (``/``-separated path, e.g. ``email/utils.py``) with
    source ``text`` may import, in source order, each once: every ``import a.b`` module, every
    ``from m import x`` module ``m`` (relative ones resolved against ``rel``'s package) and
    ``m.x`` (``x`` may be a submodule). Candidates, not checked: map them to files with a
    module -> file table, unknown names are simply not found there."""
    found: dict[str, None] = {}
    for m in _IMPORT.finditer(text):
        dots, module, names, plain = m.groups()
        if plain is not None:
            for part in plain.split(","):
                found.setdefault(part.split(" as ")[0].strip())
            continue
        resolved = absolute_module(rel, len(dots), module)
        if resolved is None:
            continue  # beyond the top-level package: nothing it could name here
        module = resolved
        found.setdefault(module)
        for part in names.strip("()").split(","):  # ``from pkg import submodule``
            name = part.split(" as ")[0].strip()
            if name.isidentifier():
                found.setdefault(f"{module}.{name}")
    return [m for m in found if m]
