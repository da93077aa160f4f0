"""Byte-level BPE for the code model: training, the special ids, and corpus encoding.

The tokenizer is a ``tokenizers`` BPE over GPT-2-style byte-level pre-tokenization (every byte
sequence is encodable, no unknown token), trained on a seeded sample of the training documents.
Three special tokens come first, so their ids are fixed whatever the corpus:

    0 ``<|endoftext|>``  EOS: ends each package's documents in the token stream; stops generation
    1 ``<|pad|>``        padding (never in the training stream)
    2 ``<|MASK|>``       the diffusion mask token

It is saved as ``tokenizer.json`` plus ``tokenizer_config.json`` (through
:meth:`herald.models.tokenizer.Tokenizer.save`), which
:func:`herald.models.tokenizer.load_tokenizer` reads; the model's ``config.json`` carries the
same ids (``eos_token_ids``, ``pad_token_id``, ``mask_token_id``), which is where
:class:`herald.models.config.ModelConfig` takes them from.

Training documents are encoded with special-token *text* treated as plain text (source files that
spell ``<|endoftext|>`` stay ordinary bytes): the only special id in the stream is the EOS that
this module appends (after each package's documents).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from herald.models.tokenizer import Tokenizer

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
MAX_VOCAB = 65536  # the token stream is uint16


def sample_documents(documents: Sequence[str], sample_bytes: int, seed: int) -> list[str]:
    """A seeded sample of ``documents`` totalling about ``sample_bytes`` UTF-8 bytes (all when
    they are fewer), in a seeded order; same inputs -> same sample."""
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    out: list[str] = []
    total = 0
    for i in order:
        if total >= sample_bytes:
            break
        out.append(documents[i])
        total += len(documents[i].encode())
    return out


def train_bpe(
    texts: Sequence[str], vocab_size: int, *, min_frequency: int = 2
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (specials included) on ``texts``.

    Raises:
        ValueError: ``vocab_size`` outside ``[259, 65536]``.
    """
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB}, {MAX_VOCAB}], got {vocab_size}")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )

    def batches() -> Iterator[list[str]]:
        for i in range(0, len(texts), 256):
            yield list(texts[i : i + 256])

    backend.train_from_iterator(batches(), trainer, length=len(texts))
    check_special_ids(backend)
    return backend


def check_special_ids(backend: tokenizers.Tokenizer) -> None:
    """Raise ValueError unless the three special tokens sit at ids 0, 1, 2."""
    for token, want in zip(SPECIAL_TOKENS, (EOS_ID, PAD_ID, MASK_ID), strict=True):
        got = backend.token_to_id(token)
        if got != want:
            raise ValueError(f"tokenizer maps {token!r} to {got}, expected {want}")


def as_herald_tokenizer(backend: tokenizers.Tokenizer) -> Tokenizer:
    """Wrap ``backend`` with the special ids of this module (what ``load_tokenizer`` returns for a
    saved checkpoint whose config carries the same ids)."""
    check_special_ids(backend)
    return Tokenizer(
        backend,
        mask_token_id=MASK_ID,
        eos_token_ids=(EOS_ID,),
        pad_token_id=PAD_ID,
        mask_strings=(MASK_TOKEN,),
    )


def encode_documents(
    backend: tokenizers.Tokenizer,
    documents: Sequence[str],
    eos_after: Sequence[bool] | None = None,
    *,
    chunk: int = 4096,
) -> np.ndarray:
    """The token stream: each document encoded on its own, concatenated, with EOS after document
    ``i`` where ``eos_after[i]`` (default: after every document).

    Special-token text inside documents is encoded as plain text. Encoding runs in the
    ``tokenizers`` thread pool (all cores), ``chunk`` documents at a time.

    Returns:
        [num_tokens] uint16 (host memory).

    Raises:
        ValueError: the vocabulary does not fit uint16, or a special id appears in a document's
            encoding (the tokenizer is broken).
    """
    if backend.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
        raise ValueError("vocabulary larger than 65536 ids does not fit a uint16 stream")
    if eos_after is not None and len(eos_after) != len(documents):
        raise ValueError("eos_after must have one flag per document")
    plain = tokenizers.Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    parts: list[np.ndarray] = []
    eos = np.array([EOS_ID], dtype=np.uint16)
    for start in range(0, len(documents), chunk):
        encs = plain.encode_batch_fast(
            list(documents[start : start + chunk]), add_special_tokens=False
        )
        for i, enc in enumerate(encs, start):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            if eos_after is None or eos_after[i]:
                parts.append(eos)
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    body = stream[stream != EOS_ID]
    if body.size and int(body.min()) <= MASK_ID:
        raise ValueError("a document encoded to a special id; the tokenizer is inconsistent")
    return stream
