"""Synthetic site-packages / stdlib trees for the training tests (real files, tiny)."""

from __future__ import annotations

import random
from pathlib import Path


def module_text(pkg: str, j: int, seed: int = 0) -> str:
    rng = random.Random(f"{pkg}-{j}-{seed}")
    lines = [f'"""Module {j} of {pkg}."""', "import os", ""]
    for k in range(24):
        name = f"{pkg}_{rng.choice(['load', 'save', 'parse', 'emit'])}_{j}_{k}"
        lines += [
            f"def {name}(value, scale={rng.randint(1, 9)}):",
            f"    result = value * scale + {k}  # the {name} helper",
            "    return result",
            "",
        ]
    return "\n".join(lines) + "\n"


def make_tree(root: Path, packages: dict[str, int], seed: int = 0) -> Path:
    """``packages``: name -> number of modules (half of them in a ``sub`` package)."""
    for pkg, n in packages.items():
        for j in range(n):
            d = root / pkg / ("sub" if j % 2 else "")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"mod{j}.py").write_text(module_text(pkg, j, seed))
    return root
