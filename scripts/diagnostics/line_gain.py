"""The line task's context gain (dense minus control, ES) pooled over disjoint example sets, and
two checkpoints compared on one set (results/eval/README.md, section "Run 5").

``pool``: one checkpoint's line units on several example sets whose targets are disjoint (each
set excluded the earlier ones); prints each set's gain and the gain over all their examples, with
a bootstrap interval that resamples every set's examples separately (stratified), and per tier.

``compare``: two folders holding the same examples (same targets, same order), e.g. two
checkpoints on one selection; prints dense, control and the gain of each, and the paired
interval of their differences (B minus A).

    PYTHONPATH=. python scripts/diagnostics/line_gain.py pool --context 16384 \\
        results/eval/gpu-run3-random/16k-line results/eval/gpu-run3-holdout/16k-line \\
        results/eval/run3-seed5/16k-line
    PYTHONPATH=. python scripts/diagnostics/line_gain.py compare --context 16384 \\
        results/eval/run3-seed5/16k-line results/eval/run5-check/16k-line
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from herald.eval.metrics import HEADLINE

REPS = 4000


def load_set(folder: Path, context: int) -> tuple[list[tuple], list[float], list[float]]:
    """(target keys, dense scores, control scores) of ``folder``'s line units at ``context``;
    target key = (file, line, target text, tier)."""
    examples = json.loads((folder / "examples" / f"line_{context}.json").read_text())["examples"]
    by_id = {e["id"]: e for e in examples}
    units = {}
    for mode in ("dense", "control"):
        path = folder / "runs" / f"line_{context}_{mode}.json"
        if not path.is_file():
            raise SystemExit(f"missing unit {path}")
        units[mode] = json.loads(path.read_text())["examples"]
    ids = [d["id"] for d in units["dense"]]
    if ids != [c["id"] for c in units["control"]]:
        raise SystemExit(f"{folder}: dense and control ran on different examples")
    metric = HEADLINE["line"]
    keys = [(by_id[i]["file"], int(by_id[i]["line"]), by_id[i]["target"], by_id[i]["tier"],
             by_id[i]["package"]) for i in ids]  # fmt: skip
    dense = [100 * float(d[metric]) for d in units["dense"]]
    control = [100 * float(c[metric]) for c in units["control"]]
    return keys, dense, control


def stratified_interval(
    diffs: list[list[float]], level: float = 0.95
) -> tuple[float, float, float]:
    """Bootstrap interval of the mean over all examples of several sets, each set's examples
    resampled separately (seeded), and the bootstrap standard error."""
    rng = random.Random(0)
    n = sum(len(d) for d in diffs)
    means = []
    for _ in range(REPS):
        total = 0.0
        for d in diffs:
            total += sum(d[rng.randrange(len(d))] for _ in range(len(d)))
        means.append(total / n)
    mu = sum(means) / REPS
    se = (sum((m - mu) ** 2 for m in means) / (REPS - 1)) ** 0.5
    means.sort()
    lo = means[int((1 - level) / 2 * REPS)]
    hi = means[int((1 + level) / 2 * REPS) - 1]
    return lo, hi, se


def line(name: str, diffs: list[list[float]], level: float = 0.95) -> str:
    """One summary line: name, n, mean [interval at ``level``] and z = mean / bootstrap SE."""
    flat = [x for d in diffs for x in d]
    mean = sum(flat) / len(flat)
    lo, hi, se = stratified_interval(diffs, level)
    z = mean / se if se > 0 else float("nan")
    return f"{name}: n={len(flat)}, {mean:+.2f} ES [{lo:+.2f}, {hi:+.2f}], z {z:.2f}"


def pool(folders: list[Path], context: int, level: float = 0.95) -> None:
    seen: set[tuple] = set()
    gains: list[list[float]] = []
    tiers: dict[int, list[list[float]]] = {}
    per_package: dict[str, list[float]] = {}
    for folder in folders:
        keys, dense, control = load_set(folder, context)
        targets = {k[:3] for k in keys}
        if targets & seen:
            raise SystemExit(f"{folder} shares {len(targets & seen)} targets with an earlier set")
        seen |= targets
        gain = [d - c for d, c in zip(dense, control, strict=True)]
        gains.append(gain)
        print(line(f"{folder}", [gain], level))
        for k, g in zip(keys, gain, strict=True):
            per_package.setdefault(k[4], []).append(g)
        for t in sorted({k[3] for k in keys}):
            part = [g for g, k in zip(gain, keys, strict=True) if k[3] == t]
            tiers.setdefault(t, []).append(part)
    print(f"intervals at {100 * level:g}%")
    print(line("pooled (stratified by set)", gains, level))
    for t, parts in sorted(tiers.items()):
        print(line(f"  tier {t}", [p for p in parts if p], level))
    print(by_package(per_package, level))


def by_package(per: dict[str, list[float]], level: float = 0.95) -> str:
    """The pooled gain with packages as the unit (the targets of one package share files and
    context, so they are not independent draws; ``per``: package -> its targets' gains over
    every set): each package's mean gain with a one-sample t statistic over the packages (every
    package weighs the same), and the mean over targets with a bootstrap interval that resamples
    whole packages."""
    means = [sum(v) / len(v) for v in per.values()]
    k = len(means)
    mu = sum(means) / k
    sd = (sum((m - mu) ** 2 for m in means) / (k - 1)) ** 0.5 if k > 1 else float("nan")
    t = mu * k**0.5 / sd if sd > 0 else float("nan")
    lo, hi = min(means), max(means)
    # the mean over targets, with whole packages resampled (a cluster bootstrap): the same
    # estimand as the pooled line, its interval allowing for targets of one package being alike
    sums = [(sum(v), len(v)) for v in per.values()]
    rng = random.Random(0)
    boot = []
    for _ in range(REPS):
        pick = [sums[rng.randrange(k)] for _ in range(k)]
        boot.append(sum(p[0] for p in pick) / sum(p[1] for p in pick))
    boot.sort()
    weighted = sum(p[0] for p in sums) / sum(p[1] for p in sums)
    c_lo, c_hi = boot[int((1 - level) / 2 * REPS)], boot[int((1 + level) / 2 * REPS) - 1]
    return (
        f"by package: {k} packages, mean of package means {mu:+.2f} ES "
        f"(range {lo:+.2f} to {hi:+.2f}), t({k - 1}) {t:.2f}; mean over targets {weighted:+.2f} "
        f"ES, packages resampled [{c_lo:+.2f}, {c_hi:+.2f}] at {100 * level:g}%"
    )


def compare(a: Path, b: Path, context: int) -> None:
    ka, da, ca = load_set(a, context)
    kb, db, cb = load_set(b, context)
    if ka != kb:
        raise SystemExit(f"{a} and {b} hold different examples")
    for name, x in ((a, (da, ca)), (b, (db, cb))):
        d, c = x
        print(f"{name}: dense {sum(d) / len(d):.2f}, control {sum(c) / len(c):.2f}")
        print(line("  gain", [[p - q for p, q in zip(d, c, strict=True)]]))
    print(line("dense, B - A", [[q - p for p, q in zip(da, db, strict=True)]]))
    print(line("control, B - A", [[q - p for p, q in zip(ca, cb, strict=True)]]))
    gain = [(w - x) - (y - z) for w, x, y, z in zip(db, cb, da, ca, strict=True)]
    print(line("gain, B - A", [gain]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pool", help="one checkpoint, disjoint example sets")
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--context", type=int, required=True)
    p.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    c = sub.add_parser("compare", help="two folders on the same examples")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--context", type=int, required=True)
    args = ap.parse_args()
    if args.cmd == "pool":
        if not 0 < args.level < 1:
            ap.error(f"--level must be in (0, 1), got {args.level}")
        pool(args.folders, args.context, args.level)
    else:
        compare(args.a, args.b, args.context)


if __name__ == "__main__":
    main()
