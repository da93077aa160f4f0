"""How well a training data order puts a file's imports before it.

For every import edge inside a package of the training corpus (file A imports file B of its own
package, found by :mod:`herald.pyimports`; an ancestor package's ``__init__`` not counted), the
share of edges with B before A in the stream, and with B at most ``--near`` files before A (so
likely in the same training window). Compares ``herald train --data-order`` values.

    PYTHONPATH=. python scripts/diagnostics/data_order_stats.py
"""

from __future__ import annotations

import argparse
import os

from herald.pyimports import module_name
from herald.train import corpus as C


def edge_stats(order: list[C.SourceFile], near: int) -> tuple[float, float, int]:
    """(share of edges dependency-first, share within ``near`` files before, edge count); the
    edges are those :func:`herald.train.corpus.dependency_order` follows."""
    pos = {f.path: i for i, f in enumerate(order)}
    by_module: dict[str, dict[str, C.SourceFile]] = {}
    for f in sorted(order, key=lambda f: f.path):  # as dependency_order builds it
        by_module.setdefault(f.package, {})[module_name(f.path)] = f
    first = close = total = 0
    for f in order:
        for dep in C.package_imports(f, by_module[f.package]):
            gap = pos[f.path] - pos[dep.path]
            total += 1
            first += gap > 0
            close += 0 < gap <= near
    return first / max(1, total), close / max(1, total), total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--near", type=int, default=5, help="files")
    p.add_argument("--workers", type=int, default=0, help="scan processes (0 = all cores)")
    args = p.parse_args(argv)
    workers = args.workers or os.cpu_count() or 1
    std = C.scan_stdlib(workers=workers)
    corpus = C.scan_third_party(None, std, workers=workers)
    print(f"{len(corpus.files)} files")
    for order in C.DATA_ORDERS:
        ordered = C.order_documents(corpus.files, args.seed, order)
        first, close, total = edge_stats(ordered, args.near)
        print(
            f"--data-order {order}: {total} import edges inside packages; dependency first "
            f"{100 * first:.1f}%, at most {args.near} files before {100 * close:.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
