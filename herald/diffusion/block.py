"""Block layout of one request (docs/MODELS.md §7, §10).

Blocks are aligned to absolute position 0: the prompt occupies positions ``0..P-1``, the whole
prompt blocks ``0 .. (P // B) * B`` are prefilled, and the first decoded block holds the prompt tail
(``P % B`` tokens) followed by masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockLayout:
    """Where the prompt ends and which blocks are decoded, all in tokens.

    Raises ``ValueError`` for an empty prompt or a non-positive block size.
    """

    prompt_len: int
    block_size: int
    max_new_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_len <= 0:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of whole prompt blocks, prefilled before decoding."""
        return (self.prompt_len // self.block_size) * self.block_size

    @property
    def first_block_start(self) -> int:
        return self.num_prefill_tokens

    @property
    def prompt_tail_len(self) -> int:
        """Prompt tokens inside the first decoded block."""
        return self.prompt_len - self.num_prefill_tokens

    @property
    def total_len(self) -> int:
        """Canvas length: prompt + max_new_tokens rounded up to whole blocks."""
        b = self.block_size
        return math.ceil((self.prompt_len + self.max_new_tokens) / b) * b

    @property
    def num_decode_blocks(self) -> int:
        return (self.total_len - self.first_block_start) // self.block_size
