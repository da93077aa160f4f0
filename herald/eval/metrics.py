"""Scoring: turn a completion into a prediction and compare it with the target.

Edit similarity is the standard library's ``difflib.SequenceMatcher(None, a, b,
autojunk=False).ratio()`` = 2 M / (len(a) + len(b)), M the characters of the matching blocks
SequenceMatcher finds. It is close to, but not always equal to, the normalised Indel similarity
that LongBench's RepoBench-P scorer (fuzzywuzzy / rapidfuzz ``ratio``) reports: SequenceMatcher
finds matching blocks greedily (longest first), not a longest common subsequence. difflib is used
because it is present wherever Python is (rapidfuzz is not installed on the GPU machine).
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def edit_similarity(a: str, b: str) -> float:
    """SequenceMatcher ratio in [0, 1]; 1.0 for two empty strings."""
    if not a and not b:
        return 1.0
    return SequenceMatcher(None, a, b, autojunk=False).ratio()


def first_line(completion: str) -> str:
    """The predicted next line: the first non-blank line that starts after a line break of the
    completion (RepoBench's scorer likewise takes the first non-empty line). The line task's
    prompt stops before the newline that ends the line above the target (see
    :func:`herald.eval.line_task.line_prompt_text`), so text before the completion's first newline
    would finish that line, not start the target; ``""`` if the completion has no such line."""
    for line in completion.split("\n")[1:]:
        if line.strip():
            return line.rstrip("\r")
    return ""


def first_identifier(completion: str) -> str:
    """The identifier a completion starts with (after spaces/tabs, not newlines), or ``""``."""
    m = _IDENT.match(completion.lstrip(" \t"))
    return m.group(0) if m else ""


def predict(task: str, completion: str) -> str:
    """The prediction of ``task`` (``line`` or ``recall``) from a decoded completion."""
    if task == "line":
        return first_line(completion)
    if task == "recall":
        return first_identifier(completion)
    raise ValueError(f"unknown task {task!r}")


def score(task: str, prediction: str, target: str) -> dict[str, float]:
    """``{"em": 0/1, "es": [0, 1]}``. Lines compare with surrounding whitespace stripped
    (indentation is not scored, as in RepoBench); identifiers compare exactly."""
    if task == "line":
        prediction, target = prediction.strip(), target.strip()
    return {
        "em": float(prediction == target),
        "es": edit_similarity(prediction, target),
    }


HEADLINE = {"line": "es", "recall": "em"}
"""The metric of each task that enters the Table I average (x100): edit similarity for line
completion (LongBench reports RepoBench-P as edit similarity), exact match for recall."""
