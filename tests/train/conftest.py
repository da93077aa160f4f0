"""Fixtures of the training tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_fixtures import make_tree


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    """(site dir with 3 packages, stdlib dir with 2 packages)."""
    site = make_tree(tmp_path / "site", {"alpha": 4, "beta": 4, "gamma": 3})
    std = make_tree(tmp_path / "std", {"json": 3, "email": 3}, seed=1)
    return site, std
