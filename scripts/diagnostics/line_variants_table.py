"""The line-variant table of ``results/eval/README.md``: dense minus control per variant folder.

Reads the ``herald eval`` folders that ``scripts/device/line_variants.sh`` writes (one per line
setting and in-file cap, each with ``runs/line_<context>_dense.json`` and ``..._control.json``)
and prints, per folder, the number of examples, both ES scores and the paired-bootstrap interval
of dense minus control at 95% and at the Bonferroni level for the number of folders compared
(1 - 0.05 / k): choosing the best of k variants on the same data needs the wider interval
(conservative where variants share targets, e.g. two in-file caps of one setting).

    PYTHONPATH=. python scripts/diagnostics/line_variants_table.py results/eval/line-variants/*/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from herald.eval.stats import paired_bootstrap


def _scores(path: Path) -> dict[str, float]:
    return {e["id"]: float(e["es"]) for e in json.loads(path.read_text())["examples"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="line_variants.sh output folders")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20_000, help="bootstrap resamples")
    args = p.parse_args(argv)
    k = len(args.folders)
    level = 1 - 0.05 / k
    print(
        f"| folder | n | dense ES | control ES | dense - control [95%] | [{100 * level:.1f}%, "
        f"Bonferroni over {k}] |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for folder in args.folders:
        runs = folder / "runs"
        paths = [runs / f"line_{args.context}_{mode}.json" for mode in ("dense", "control")]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise SystemExit(f"{folder}: no {' or '.join(missing)} (another --context?)")
        dense, control = (_scores(p) for p in paths)
        if dense.keys() != control.keys():
            raise SystemExit(f"{folder}: dense and control ran on different examples")
        ids = sorted(dense)
        a, b = [dense[i] for i in ids], [control[i] for i in ids]
        diff = 100 * (sum(a) - sum(b)) / len(ids)
        cells = []
        for lv in (0.95, level):
            lo, hi = paired_bootstrap(a, b, level=lv, reps=args.reps)
            cells.append(f"{diff:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]")
        print(
            f"| `{folder.name}` | {len(ids)} | {100 * sum(a) / len(a):.1f} | "
            f"{100 * sum(b) / len(b):.1f} | {cells[0]} | {cells[1]} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
