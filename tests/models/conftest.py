"""Fixtures for the model tests: tiny random checkpoints written once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from herald.models.loader import write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_checkpoint(preset, sharded=False, dtype=float32) -> dir`` (cached per arguments)."""
    cache: dict[tuple[str, bool, torch.dtype], Path] = {}

    def make(preset: str, sharded: bool = False, dtype: torch.dtype = torch.float32) -> Path:
        key = (preset, sharded, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{preset}-{'sharded' if sharded else 'single'}")
            shard = 256 * 1024 if sharded else 1 << 40
            cache[key] = write_random_checkpoint(
                preset, out, seed=0, dtype=dtype, max_shard_bytes=shard
            )
        return cache[key]

    return make
