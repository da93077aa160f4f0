"""Long prompts of real text for ``herald bench serve``: the local Python standard library.

The source files of the standard library this Python runs (``sysconfig``'s ``stdlib`` folder;
``site-packages`` and the test suites left out) are put in one seeded order; prompt ``i`` of a
length ``n`` is the model's tokens of the files from position ``i`` of that order on, read one
after the other and cut at exactly ``n`` tokens. So a prompt is deterministic (same Python, same
seed, same tokenizer: same tokens), prompts of one length differ in where they begin, and each
names the files it holds. The embedded model was trained on third-party packages with the
standard library held out, so these prompts are text it has not seen.
"""

from __future__ import annotations

import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from herald.models.tokenizer import Tokenizer

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})  # fmt: skip
"""Folders under the standard library that are not its library code."""


def stdlib_root() -> Path:
    """The folder of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The ``.py`` files under ``root`` outside :data:`EXCLUDED_DIRS`, sorted by path."""
    files = []
    for path in root.rglob("*.py"):
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]) and path.is_file():
            files.append(path)
    return sorted(files)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    files: list[str]
    """The files it holds, in order, relative to the standard library's folder (the last one
    cut where the token count is reached)."""


class StdlibPrompts:
    """Prompts of exact token counts from the standard library (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, root: Path | None = None):
        self.tokenizer, self.seed = tokenizer, seed
        self.root = stdlib_root() if root is None else root
        files = stdlib_files(self.root)
        if not files:
            raise ValueError(f"no Python source files under {self.root}: no standard library")
        random.Random(seed).shuffle(files)
        self.order = files
        self._ids: dict[int, list[int]] = {}

    def _tokens(self, k: int) -> list[int]:
        if k not in self._ids:
            try:
                text = self.order[k].read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                text = ""  # a file that is not UTF-8 text contributes nothing
            self._ids[k] = self.tokenizer.encode(text)
        return self._ids[k]

    def prompt(self, n_tokens: int, index: int) -> Prompt:
        """Prompt ``index`` of ``n_tokens`` tokens. Raises ValueError when the whole standard
        library holds fewer tokens."""
        ids: list[int] = []
        files: list[str] = []
        n = len(self.order)
        for step in range(n):
            k = (index + step) % n
            tokens = self._tokens(k)
            if not tokens:
                continue
            ids += tokens[: n_tokens - len(ids)]
            files.append(self.order[k].relative_to(self.root).as_posix())
            if len(ids) == n_tokens:
                return Prompt(ids, files)
        raise ValueError(
            f"the standard library under {self.root} holds {len(ids)} tokens, fewer than the "
            f"{n_tokens} of --prompt-tokens"
        )

    def describe(self) -> dict[str, Any]:
        """Where the prompts come from, for the records."""
        return {
            "source": "python standard library",
            "root": str(self.root),
            "python": sys.version.split()[0],
            "seed": self.seed,
            "files_available": len(self.order),
        }
