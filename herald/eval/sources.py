"""The evaluation corpus: Python source files of the local standard library.

Nothing is copied into the repository: files are read at run time from
``sysconfig.get_paths()["stdlib"]`` (or another root, for tests), and every example records the
files it used with their sha256, so two runs are comparable exactly when their records agree.

Owns: which files are eligible (no test suites, no generated tables, no third-party
``site-packages``), which package a file belongs to, which corpus files a file imports, and the
order of a package's files by relatedness to a target file. Encoded token ids are cached per file.
"""

from __future__ import annotations

import ast
import hashlib
import io
import platform
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from herald.pyimports import imported_modules, module_name

EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "lib-dynload",
        # generated or data-like: codec tables, the pydoc topic dump
        "encodings",
        "pydoc_data",
    }
)
"""Directory names never entered (test suites, third-party code, generated tables)."""

MIN_FILE_CHARS = 400
"""Files shorter than this (stubs, ``__init__`` one-liners) are not eligible."""


class TextCodec(Protocol):
    """What the task builders need from a tokenizer (:class:`~herald.models.tokenizer.Tokenizer`
    fits)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def stdlib_root() -> Path:
    """The running interpreter's standard library directory (``sysconfig``)."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class SourceFile:
    """One corpus file. ``rel`` is the POSIX path relative to the corpus root (``email/utils.py``);
    ``text`` is its UTF-8 content; ``sha256`` hashes the raw bytes."""

    rel: str
    text: str
    sha256: str

    @cached_property
    def lines(self) -> list[str]:
        """Physical lines, newline kept (``lines[i]`` is line ``i + 1``), split at ``\n`` only
        as :mod:`tokenize` counts them (``str.splitlines`` also splits at form feeds)."""
        return io.StringIO(self.text).readlines()

    @cached_property
    def line_offsets(self) -> list[int]:
        """Character offset of the start of each line (``len(lines) + 1`` entries)."""
        out = [0]
        for line in self.lines:
            out.append(out[-1] + len(line))
        return out

    @cached_property
    def tree(self) -> ast.Module | None:
        """The parsed module, or None if it does not parse with this interpreter."""
        try:
            return ast.parse(self.text)
        except (SyntaxError, ValueError):
            return None

    @property
    def module(self) -> str:
        """Dotted module name (``email.utils``; a package's ``__init__`` is the package)."""
        return module_name(self.rel)

    @property
    def package(self) -> str:
        """Top-level package (``email``), or ``""`` for a top-level module (``argparse.py``)."""
        return self.rel.split("/")[0] if "/" in self.rel else ""

    @property
    def header(self) -> str:
        """The ``# file: rel`` line that opens the file in a prompt."""
        return f"# file: {self.rel}\n"

    def chunk(self) -> str:
        """The file as it appears in a prompt: its :attr:`header`, the text, a blank line."""
        body = self.text if self.text.endswith("\n") else self.text + "\n"
        return f"{self.header}{body}\n"


class Corpus:
    """Eligible ``.py`` files under ``root`` (default: :func:`stdlib_root`), read lazily.

    Args:
        root: directory to scan.
        codec: tokenizer used by :meth:`chunk_ids` (optional until then).

    Raises:
        FileNotFoundError: ``root`` is not a directory or holds no eligible file.
    """

    def __init__(self, root: Path | str | None = None, codec: TextCodec | None = None) -> None:
        self.root = Path(root) if root is not None else stdlib_root()
        if not self.root.is_dir():
            raise FileNotFoundError(f"corpus root {self.root} is not a directory")
        self.codec = codec
        self._files: dict[str, SourceFile | None] = {}
        self._ids: dict[str, list[int]] = {}
        self._imports: dict[str, list[str]] = {}
        self.rel_paths = self._scan()
        if not self.rel_paths:
            raise FileNotFoundError(f"no eligible .py files under {self.root}")

    def _scan(self) -> list[str]:
        out: list[str] = []
        for path in sorted(self.root.rglob("*.py")):
            rel = path.relative_to(self.root)
            if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
                continue
            if rel.name.startswith("_sysconfigdata") or not path.is_file():
                continue
            if path.stat().st_size < MIN_FILE_CHARS:
                continue
            out.append(rel.as_posix())
        return out

    def describe(self) -> dict[str, object]:
        """Where the corpus came from: root, interpreter version, number of eligible files."""
        return {
            "root": str(self.root),
            "python": platform.python_version(),
            "implementation": sys.implementation.name,
            "num_files": len(self.rel_paths),
        }

    def read(self, rel: str) -> SourceFile | None:
        """The file at ``rel``, or None when it is not UTF-8 (cached)."""
        if rel not in self._files:
            raw = (self.root / rel).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                self._files[rel] = None
            else:
                self._files[rel] = SourceFile(rel, text, hashlib.sha256(raw).hexdigest())
        return self._files[rel]

    def chunk_ids(self, rel: str) -> list[int]:
        """Token ids of :meth:`SourceFile.chunk` (cached). Needs ``codec``."""
        if rel not in self._ids:
            if self.codec is None:
                raise ValueError("Corpus.chunk_ids needs a codec")
            f = self.read(rel)
            self._ids[rel] = self.codec.encode(f.chunk()) if f is not None else []
        return self._ids[rel]

    @cached_property
    def packages(self) -> dict[str, list[str]]:
        """Top-level package name -> its eligible files (sorted), for directories that are
        packages (have an ``__init__.py``)."""
        out: dict[str, list[str]] = {}
        for rel in self.rel_paths:
            if "/" not in rel:
                continue
            top = rel.split("/")[0]
            if (self.root / top / "__init__.py").is_file():
                out.setdefault(top, []).append(rel)
        return out

    @cached_property
    def _by_module(self) -> dict[str, str]:
        return {module_name(rel): rel for rel in self.rel_paths}

    def resolve(self, module: str) -> str | None:
        """Dotted module name -> corpus file, or None."""
        return self._by_module.get(module)

    def imports(self, rel: str) -> list[str]:
        """Corpus files that ``rel`` imports (absolute and relative ``import`` / ``from ...
        import`` statements found by a line scan, each file once, in source order)."""
        if rel in self._imports:
            return self._imports[rel]
        f = self.read(rel)
        found: list[str] = []
        self._imports[rel] = found
        if f is None:
            return found
        for module in imported_modules(f.text, rel):
            target = self.resolve(module)
            if target is not None and target != rel and target not in found:
                found.append(target)
        return found

    def relatedness(self, target: str, rel: str) -> int:
        """3: ``target`` imports ``rel``; 2: ``rel`` imports ``target``; 1: same directory;
        0: otherwise."""
        if rel in self.imports(target):
            return 3
        if target in self.imports(rel):
            return 2
        same_dir = rel.rsplit("/", 1)[0] if "/" in rel else ""
        return 1 if same_dir == (target.rsplit("/", 1)[0] if "/" in target else "") else 0

    def related_order(self, target: str, candidates: list[str]) -> list[str]:
        """``candidates`` ordered from least to most related to ``target`` (:meth:`relatedness`,
        ties in path order). In a prompt the most related files sit last, next to the target, so
        left truncation drops the least related first."""
        return sorted(candidates, key=lambda r: (self.relatedness(target, r), r))


def fingerprint(codec: object) -> str:
    """sha256 of a tokenizer's serialised form (``backend.to_str()``), or of its repr."""
    backend = getattr(codec, "backend", None)
    to_str: Callable[[], str] | None = getattr(backend, "to_str", None)
    text = to_str() if to_str is not None else repr(codec)
    return hashlib.sha256(text.encode()).hexdigest()
