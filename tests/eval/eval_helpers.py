"""Shared pieces of the evaluation tests. A plain module, not a conftest.py: other test folders
import their own ``conftest`` by name, and a second conftest module would shadow theirs."""

from __future__ import annotations

import functools

from herald.eval.sources import Corpus
from herald.eval.tasks import TaskConfig
from herald.models.registry import get_preset
from herald.models.tokenizer import Tokenizer, byte_level_tokenizer

SMALL = TaskConfig(
    control_tokens=64, infile_tokens=64, min_distance=150, line_setting="cross_file_first"
)
"""CPU sizes: 64-token control window, 64-token in-file cap, 150-token recall distance; the
line fixtures test ``cross_file_first`` (each other setting has its own test)."""


@functools.cache
def tokenizer() -> Tokenizer:
    """tiny-sdar's byte-level tokenizer: byte b is id b, so ``bytes(ids)`` is the exact text."""
    return byte_level_tokenizer(get_preset("tiny-sdar"))


@functools.cache
def stdlib_corpus() -> Corpus:
    """The local standard library (read-only, shared by the tests)."""
    return Corpus(codec=tokenizer())
