"""Shared fixtures of the evaluation tests: the tiny-sdar byte-level tokenizer and the stdlib
corpus (built once per session; both are read-only)."""

from __future__ import annotations

import pytest

from herald.eval.sources import Corpus
from herald.eval.tasks import TaskConfig
from herald.models.registry import get_preset
from herald.tokenizer import byte_level_tokenizer

# Small sizes for the CPU: 64-token control window, 64-token in-file cap, 150-token distance.
SMALL = TaskConfig(control_tokens=64, infile_tokens=64, min_distance=150)


@pytest.fixture(scope="session")
def tok():
    return byte_level_tokenizer(get_preset("tiny-sdar"))


@pytest.fixture(scope="session")
def corpus(tok):
    return Corpus(codec=tok)
