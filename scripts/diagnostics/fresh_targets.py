"""Dense minus control on the targets no earlier example set holds.

Run 4's pre-registered check excluded only the earlier ``cross_file_random`` sets of the same
context; some of its targets were asked before in other settings or contexts. This secondary
analysis (registered before any control unit of that check ran: ``results/eval/README.md``,
section "Run 4") reports the paired difference of the headline score on the targets that no other
``examples/<task>_<context>.json`` under ``--results`` holds (same file, line and target text),
beside the difference on all targets, with the tier mix of each. It does not decide the check.
``--ignore`` names folders whose example sets do not count as earlier (the run's own parts).

    PYTHONPATH=. python scripts/diagnostics/fresh_targets.py results/eval/run4-check/16k-line \
        --ignore results/eval/run4-check
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from herald.eval.metrics import HEADLINE
from herald.eval.stats import paired_bootstrap

Key = tuple[str, int, str]


def target_key(example: dict) -> Key:
    """A target's identity across example sets: file, 1-based line and the target text."""
    return example["file"], int(example["line"]), example["target"]


def earlier_targets(results: Path, ignore: list[Path]) -> set[Key]:
    """Line targets of every example set under ``results`` outside the ``ignore`` folders."""
    skip = [d.resolve() for d in ignore]
    seen: set[Key] = set()
    for path in sorted(results.rglob("examples/line_*.json")):
        if any(d in path.resolve().parents for d in skip):
            continue
        seen.update(target_key(e) for e in json.loads(path.read_text())["examples"])
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a run folder with examples/ and runs/")
    ap.add_argument("--results", type=Path, default=Path("results/eval"))
    ap.add_argument(
        "--ignore", type=Path, nargs="*", default=[], help="folders not counted as earlier"
    )
    args = ap.parse_args()
    seen = earlier_targets(args.results, [args.folder, *args.ignore])
    for ex_path in sorted(args.folder.glob("examples/line_*.json")):
        ctx = ex_path.stem.split("_")[1]
        examples = {e["id"]: e for e in json.loads(ex_path.read_text())["examples"]}
        runs = {m: args.folder / "runs" / f"line_{ctx}_{m}.json" for m in ("dense", "control")}
        missing = [str(p) for p in runs.values() if not p.is_file()]
        if missing:
            raise SystemExit(f"missing unit(s): {', '.join(missing)}")
        dense, control = (json.loads(p.read_text())["examples"] for p in runs.values())
        if [d["id"] for d in dense] != [c["id"] for c in control]:
            raise SystemExit(f"line {ctx}: dense and control ran on different examples")
        metric = HEADLINE["line"]
        for name, keep in (("all targets", None), ("targets of no earlier set", seen)):
            pairs = [
                (float(d[metric]), float(c[metric]), examples[d["id"]]["tier"])
                for d, c in zip(dense, control, strict=True)
                if keep is None or target_key(examples[d["id"]]) not in keep
            ]
            if not pairs:
                print(f"line {ctx}, {name}: no targets")
                continue
            a, b, tiers = (list(x) for x in zip(*pairs, strict=True))
            lo, hi = paired_bootstrap(a, b)
            diff = 100 * (sum(a) - sum(b)) / len(a)
            mix = Counter(tiers)
            print(
                f"line {ctx}, {name}: n={len(a)} (tiers 0/1/2: {mix[0]}/{mix[1]}/{mix[2]}), "
                f"dense {100 * sum(a) / len(a):.1f} vs control {100 * sum(b) / len(b):.1f}: "
                f"{diff:+.2f} ES [{100 * lo:+.2f}, {100 * hi:+.2f}]"
            )


if __name__ == "__main__":
    main()
