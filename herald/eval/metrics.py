"""Scoring: turn a completion into a prediction and compare it with the target.

Edit similarity is the standard library's ``difflib.SequenceMatcher(None, a, b,
autojunk=False).ratio()`` = 2 M / (len(a) + len(b)), M the characters of the matching blocks
SequenceMatcher finds. It is close to, but not always equal to, the normalised Indel similarity
that LongBench's RepoBench-P scorer (fuzzywuzzy / rapidfuzz ``ratio``) reports: SequenceMatcher
finds matching blocks greedily (longest first), not a longest common subsequence. difflib is used
because it is present wherever Python is (rapidfuzz is not installed on the GPU machine).

The RULER-style tasks (:mod:`herald.eval.ruler_formats`) predict the completion's first line and
score exact match by each task's rule (``exact``, ``ordered`` or ``set`` over comma-separated
items, :func:`ruler_items`); their edit similarity compares the normalised forms (the items
joined with ``", "``, sorted for ``set`` tasks).
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

from herald.eval.ruler_formats import ANSWER_RULE, RULER_TASKS

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


def answer_line(completion: str) -> str:
    """A RULER-style prediction: the completion's text before its first line break, stripped
    (the prompt ends with ``# Answer:``, so the answer follows on the same line)."""
    return completion.split("\n", 1)[0].strip()


def ruler_items(text: str) -> list[str]:
    """The comma-separated items of an answer line, each stripped, empty ones dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


def predict(task: str, completion: str) -> str:
    """The prediction of ``task`` (``line``, ``recall`` or a RULER-style task) from a decoded
    completion."""
    if task == "line":
        return first_line(completion)
    if task == "recall":
        return first_identifier(completion)
    if task in RULER_TASKS:
        return answer_line(completion)
    raise ValueError(f"unknown task {task!r}")


def _ruler_score(task: str, prediction: str, target: str) -> dict[str, float]:
    rule = ANSWER_RULE[task]
    got, want = ruler_items(prediction), ruler_items(target)
    if rule == "exact":
        em = prediction.strip() == target.strip()
    elif rule == "ordered":
        em = got == want
    else:  # set: every expected item once, nothing else, any order
        em = sorted(got) == sorted(want)
        got, want = sorted(got), sorted(want)
    return {"em": float(em), "es": edit_similarity(", ".join(got), ", ".join(want))}


def score(task: str, prediction: str, target: str) -> dict[str, float]:
    """``{"em": 0/1, "es": [0, 1]}``. Lines compare with surrounding whitespace stripped
    (indentation is not scored, as in RepoBench); identifiers compare exactly; the RULER-style
    tasks by their rule (module docstring)."""
    if task in RULER_TASKS:
        return _ruler_score(task, prediction, target)
    if task == "line":
        prediction, target = prediction.strip(), target.strip()
    return {
        "em": float(prediction == target),
        "es": edit_similarity(prediction, target),
    }


HEADLINE = {"line": "es", "recall": "em", **{task: "em" for task in RULER_TASKS}}
"""The metric of each task that enters the Table I average (x100): edit similarity for line
completion (LongBench reports RepoBench-P as edit similarity), exact match for the others."""
