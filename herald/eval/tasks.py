"""Long-context examples built at run time from the standard library.

Every task is deterministic for a seed and a tokenizer:

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

RULER-style tasks (``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``,
``vt``, ``cwe``; :data:`RULER_TASKS`)
    Needles (key -> value lines, variable chains) hidden at random depths in a haystack of
    standard-library files, or a list of words to count; one question at the end, scored by exact
    match. Formats and exact-match rules: :mod:`herald.eval.ruler_formats`; builder:
    :mod:`herald.eval.ruler` (any text source); on the standard library:
    :mod:`herald.eval.ruler_task`. A context of C tokens is the whole sequence, as in RULER: the
    prompt holds at most C - ``RulerConfig.answer_tokens`` tokens (:func:`prompt_tokens`).

Every example's ``meta`` records the files (path, sha256), line numbers and choices. This module
holds the examples' types and :func:`build_examples`; the builders are :mod:`herald.eval.line_task`
(its target lines: :mod:`herald.eval.line_targets`), :mod:`herald.eval.recall_task` and
:mod:`herald.eval.ruler_task`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from herald.eval.ruler_formats import RULER_TASKS, RulerConfig
from herald.eval.sources import Corpus, TextCodec

TASKS = ("line", "recall", *RULER_TASKS)
DEFAULT_TASKS = ("line", "recall")
"""The tasks ``herald eval`` runs when ``--task`` is not given."""
TASK_GROUPS = {"ruler": RULER_TASKS}
"""Names that ``--task`` expands to several tasks."""
LINE_SETTINGS = ("cross_file_first", "cross_file_random", "cross_file_later")


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
    ruler: RulerConfig = field(default_factory=RulerConfig)
    """The RULER-style tasks' sizes."""

    def infile_cap(self, context: int) -> int:
        """line: tokens of in-file context at ``context``: ``infile_tokens``, at most half."""
        return max(1, min(self.infile_tokens, context // 2))


TASK_FIELDS = {
    "line": ("infile_tokens", "min_package_chars", "line_setting"),
    "recall": ("min_distance", "distance_margin"),
    **{task: ("ruler",) for task in RULER_TASKS},
}
"""The :class:`TaskConfig` fields each task reads besides ``seed`` and ``control_tokens`` (the
others do not change its examples)."""


def prompt_tokens(task: str, context: int, cfg: TaskConfig) -> int:
    """The most prompt tokens ``task`` builds at ``context``: the context, less the RULER-style
    tasks' ``answer_tokens``."""
    return context - cfg.ruler.answer_tokens if task in RULER_TASKS else context


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
            ``cfg.min_distance + cfg.distance_margin`` (recall), or a RULER-style task's
            prompt budget not above ``cfg.control_tokens``.
    """
    for name in ("control_tokens", "infile_tokens", "min_distance"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"TaskConfig.{name} must be >= 1, got {getattr(cfg, name)}")
    # The builders import this module (Example, TaskConfig): imported here, not at the top.
    if task == "line":
        if cfg.line_setting not in LINE_SETTINGS:
            raise ValueError(f"unknown line setting {cfg.line_setting!r}; one of {LINE_SETTINGS}")
        from herald.eval.line_task import build_line

        return build_line(corpus, codec, context, num_examples, cfg)
    if task == "recall":
        from herald.eval.recall_task import build_recall

        return build_recall(corpus, codec, context, num_examples, cfg)
    if task in RULER_TASKS:
        from herald.eval.ruler_task import build_ruler

        return build_ruler(task, corpus, codec, context, num_examples, cfg)
    raise ValueError(f"unknown task {task!r}; one of {TASKS}")
