"""Statistics of the evaluation report (:mod:`herald.eval.report`): seeded paired-bootstrap
intervals of score differences, and the budget at which a recall curve reaches a target.
"""

from __future__ import annotations

import random


def paired_bootstrap(
    a: list[float], b: list[float], level: float = 0.95, reps: int = 2000
) -> tuple[float, float]:
    """``level`` paired-bootstrap interval of mean(a) - mean(b): ``reps`` resamples of the
    example indices (seeded, so reports are reproducible); a and b are per-example scores of the
    same examples, in the same order."""
    return mean_paired_bootstrap([(a, b)], level, reps)


def mean_paired_bootstrap(
    pairs: list[tuple[list[float], list[float]]], level: float = 0.95, reps: int = 2000
) -> tuple[float, float]:
    """``level`` bootstrap interval of the mean over ``pairs`` of mean(a) - mean(b): each pair is
    one task's per-example scores of two methods on the same examples (same order); every
    resample draws each task's examples independently of the other tasks' (the tasks have
    different examples), and the tasks weigh equally whatever their sizes, so this is the
    interval of the tasks' average difference, the Avg column's Δ. One pair gives
    exactly ``paired_bootstrap``. Seeded: reports are reproducible.

    Raises ValueError for no pairs, an empty task, or a and b of different lengths."""
    if not pairs:
        raise ValueError("mean_paired_bootstrap needs at least one (a, b) pair")
    for a, b in pairs:
        if not a or len(a) != len(b):
            raise ValueError(
                f"paired scores must be non-empty and equal in length: {len(a)} vs {len(b)}"
            )
    rng = random.Random(0)
    diffs = []
    for _ in range(reps):
        total = 0.0
        for a, b in pairs:
            n = len(a)
            idx = [rng.randrange(n) for _ in range(n)]
            total += sum(a[i] - b[i] for i in idx) / n
        diffs.append(total / len(pairs))
    diffs.sort()
    tail = (1 - level) / 2
    return diffs[round(tail * reps)], diffs[round((1 - tail) * reps) - 1]


def crossing_budget(recall: dict[float, float], target: float) -> tuple[float, float] | None:
    """The first budget of ``recall`` (budget fraction -> mean recall) whose recall reaches
    ``target``, and the budget where the line between it and the budget before crosses
    ``target`` (the first budget itself when it is the smallest); None if none reaches it."""
    pts = sorted(recall.items())
    for i, (b, r) in enumerate(pts):
        if r >= target:
            if i == 0:
                return b, b
            b0, r0 = pts[i - 1]
            return b, b0 + (target - r0) * (b - b0) / (r - r0)
    return None
