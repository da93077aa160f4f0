"""Text <-> token ids for both architectures, built on the ``tokenizers`` library.

Two sources:

* a checkpoint directory with ``tokenizer.json`` (the real SDAR / LLaDA2 tokenizers,
  docs/MODELS.md §3, §5), plus ``tokenizer_config.json`` when present (its ``mask_token``
  spelling);
* for a preset without a checkpoint (random weights), a byte-level tokenizer: ids 0..255 are
  the bytes, the model's special tokens sit at the config's ids (mask, eos, pad, and the
  preset's ``herald_special_tokens``), and every other id below ``vocab_size`` decodes to a
  visible ``<|id_N|>`` placeholder. This is what the tiny presets
  use, and it also covers the full-size vocabularies for random-weight runs.

The mask id is the model's, from :class:`herald.models.config.ModelConfig`, never the tokenizer's
guess. Text is encoded with special tokens recognised (so chat templates work), except that text
spelling the mask token is always encoded as plain text: user input can never inject a [MASK].
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from herald.models.config import LLADA2_ARCH, SDAR_ARCH, ModelConfig

# Special-token spellings of the real vocabularies (docs/MODELS.md §3, §5), used by the byte-level
# fallback when a preset does not list its own ``herald_special_tokens``.
DEFAULT_SPECIAL_TOKENS: dict[str, dict[str, int]] = {
    SDAR_ARCH: {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|MASK|>": 151669,
    },
    LLADA2_ARCH: {"<|endoftext|>": 156892, "<|mask|>": 156895},
}


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (printable Latin-1 bytes map to
    themselves, the rest to code points from 256 up), matching ``pre_tokenizers.ByteLevel``."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer`` with the model's special ids.

    Attributes:
        mask_token_id: the model's [MASK] id.
        eos_token_ids: ids that stop generation.
        pad_token_id: padding id, or None.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        mask_token_id: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int | None = None,
        mask_strings: Iterable[str] = (),
    ) -> None:
        self.backend = backend
        self.mask_token_id = mask_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        # A copy that treats special-token text as ordinary text.
        self._plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        spellings = {s for s in mask_strings if backend.token_to_id(s) == mask_token_id}
        spellings |= {
            tok.content
            for i, tok in backend.get_added_tokens_decoder().items()
            if i == mask_token_id
        }
        alternatives = sorted(spellings, key=len, reverse=True)
        self._mask_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (may be below the model's padded ``vocab_size``)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Text -> ids. No BOS/EOS is added. Special tokens in the text (e.g. chat-template
        markers) map to their ids, except the mask token, whose text is encoded as plain text;
        the result never contains ``mask_token_id``."""
        if self._mask_re is None:
            return self._encode(text, special=True)
        ids: list[int] = []
        start = 0
        for m in self._mask_re.finditer(text):
            ids += self._encode(text[start : m.start()], special=True)
            ids += self._encode(m.group(), special=False)
            start = m.end()
        ids += self._encode(text[start:], special=True)
        return ids

    def _encode(self, text: str, *, special: bool) -> list[int]:
        if not text:
            return []
        backend = self.backend if special else self._plain
        # NOTE: encode_batch, not encode: it releases the GIL while it works (encode holds it), so
        # a long prompt tokenized on a server's worker thread does not stall the event loop.
        ids: list[int] = backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.mask_token_id not in ids:
            return ids
        # Some other spelling reached the mask id (a normaliser, a non-special added token):
        # split the text until no piece does.
        if len(text) == 1:
            raise ValueError(f"the tokenizer maps the single character {text!r} to the mask id")
        mid = len(text) // 2
        return self._encode(text[:mid], special=False) + self._encode(text[mid:], special=False)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Ids -> text. ``mask_token_id`` is always dropped; other special tokens are kept unless
        ``skip_special_tokens``."""
        keep = [int(i) for i in ids if int(i) != self.mask_token_id]
        text: str = self.backend.decode(keep, skip_special_tokens=skip_special_tokens)
        return text

    def save(self, out_dir: str | Path) -> None:
        """Write ``tokenizer.json`` and a minimal ``tokenizer_config.json`` (mask/eos/pad names)."""
        out = Path(out_dir)
        self.backend.save(str(out / "tokenizer.json"))
        names: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, i in (
            ("mask_token", self.mask_token_id),
            ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None),
            ("pad_token", self.pad_token_id),
        ):
            if i is not None and self.backend.id_to_token(i) is not None:
                names[key] = self.backend.id_to_token(i)
        (out / "tokenizer_config.json").write_text(json.dumps(names, indent=2) + "\n")


def special_tokens(config: ModelConfig) -> dict[str, int]:
    """Special-token spelling -> id for the byte-level fallback of ``config``.

    From the config's ``herald_special_tokens`` (tiny presets) or :data:`DEFAULT_SPECIAL_TOKENS`,
    restricted to ids ``>= 256`` and ``< vocab_size``; then the mask / eos / pad ids get generic
    names (``<|mask|>``, ``<|special_N|>``) if still unnamed.
    """
    table = config.hf_config.get("herald_special_tokens") or DEFAULT_SPECIAL_TOKENS.get(
        config.architecture, {}
    )
    named = {s: int(i) for s, i in table.items() if 256 <= int(i) < config.vocab_size}
    used = set(named.values())
    wanted = [config.mask_token_id, *config.eos_token_ids]
    if config.pad_token_id is not None:
        wanted.append(int(config.pad_token_id))
    for i in wanted:
        if i < 256 or i >= config.vocab_size:
            raise ValueError(f"special id {i} of {config.architecture} is not in 256..vocab_size-1")
        if i not in used:
            name = "<|mask|>" if i == config.mask_token_id and "<|mask|>" not in named else None
            named[name or f"<|special_{i}|>"] = i
            used.add(i)
    return named


def byte_level_tokenizer(config: ModelConfig) -> Tokenizer:
    """The byte-level fallback tokenizer for ``config`` (see the module docstring)."""
    specials = special_tokens(config)
    by_id = {i: s for s, i in specials.items()}
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for i in range(256, config.vocab_size):
        vocab[by_id.get(i, f"<|id_{i}|>")] = i
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(
        backend,
        mask_token_id=config.mask_token_id,
        eos_token_ids=config.eos_token_ids,
        pad_token_id=config.pad_token_id,
    )


def load_tokenizer(path: str | Path | None, config: ModelConfig) -> Tokenizer:
    """The tokenizer of checkpoint directory ``path`` (``path`` None: a preset's random model, the
    byte-level fallback).

    Uses ``path/tokenizer.json`` (and ``tokenizer_config.json``'s ``mask_token`` as an extra
    spelling of the mask); FileNotFoundError when the directory has none. Special ids come from
    ``config``.
    """
    if path is None:
        return byte_level_tokenizer(config)
    tok_file = Path(path) / "tokenizer.json"
    if not tok_file.is_file():
        # NOTE: refused, not replaced by the byte-level tokenizer: a real checkpoint would then
        # load and serve with a tokenizer that is not its own (herald init-random writes one).
        raise FileNotFoundError(
            f"{path} has no tokenizer.json: a checkpoint directory needs the tokenizer it was "
            "trained with (HF format)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{tok_file} is not a readable tokenizer file: {e}") from None
    mask_strings: list[str] = []
    cfg_file = tok_file.with_name("tokenizer_config.json")
    if cfg_file.is_file():
        try:
            mask = json.loads(cfg_file.read_text()).get("mask_token")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{cfg_file} is not a valid JSON object: {e}") from None
        if isinstance(mask, dict):
            mask = mask.get("content")
        if isinstance(mask, str):
            mask_strings.append(mask)
    return Tokenizer(
        backend,
        mask_token_id=config.mask_token_id,
        eos_token_ids=config.eos_token_ids,
        pad_token_id=config.pad_token_id,
        mask_strings=mask_strings,
    )
