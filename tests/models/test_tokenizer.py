"""Tokenizer: byte-level fallback, checkpoint tokenizers, and mask-text safety."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers
from tokenizers import AddedToken

from herald.models.registry import get_preset
from herald.models.tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer

TEXTS = ["", "hello", "héllo wörld ✓ 🚀\n\ttabs", "def f(x):\n    return x ** 2\n"]
ALL_PRESETS = ["tiny-sdar", "tiny-llada2", "sdar-8b-chat", "llada2-mini"]


@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2"])
def test_byte_level_round_trip(preset: str) -> None:
    tok = byte_level_tokenizer(get_preset(preset))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_text_spelling_the_mask_never_encodes_to_the_mask_id(preset: str) -> None:
    cfg = get_preset(preset)
    tok = byte_level_tokenizer(cfg)
    mask_text = tok.backend.id_to_token(cfg.mask_token_id)
    assert mask_text is not None and tok.backend.token_to_id(mask_text) == cfg.mask_token_id
    for text in [mask_text, f"a{mask_text}b", f"{mask_text}{mask_text} x <|MASK|> <|mask|>"]:
        ids = tok.encode(text)
        assert cfg.mask_token_id not in ids
        assert tok.decode(ids) == text


def test_other_special_tokens_are_recognised() -> None:
    cfg = get_preset("tiny-sdar")
    tok = byte_level_tokenizer(cfg)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><|MASK|>")
    assert ids[0] == 257 and 258 in ids and 259 not in ids
    assert tok.eos_token_ids == (258, 256) and tok.mask_token_id == 259
    assert tok.decode([104, 259, 105, 258]) == "hi<|im_end|>"  # mask dropped
    assert tok.decode([104, 258], skip_special_tokens=True) == "h"


def test_full_size_fallback_places_specials_at_the_config_ids() -> None:
    sdar = byte_level_tokenizer(get_preset("sdar-8b-chat"))
    assert sdar.backend.token_to_id("<|MASK|>") == 151669
    assert sdar.backend.token_to_id("<|im_end|>") == 151645
    assert sdar.backend.token_to_id("<|endoftext|>") == 151643
    assert sdar.vocab_size == 151936
    llada = byte_level_tokenizer(get_preset("llada2-mini"))
    assert llada.backend.token_to_id("<|mask|>") == 156895
    assert llada.backend.token_to_id("<|endoftext|>") == 156892
    assert llada.eos_token_ids == (156892,)
    # Ids with no text (a random model emits them) decode to a visible placeholder.
    assert llada.decode([104, 300, 105]) == "h<|id_300|>i"


def test_checkpoint_tokenizer_files_load(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint("tiny-llada2")
    cfg = get_preset("tiny-llada2")
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["mask_token"] == "<|mask|>"
    tok = load_tokenizer(ckpt, cfg)
    ref = byte_level_tokenizer(cfg)
    text = "x <|mask|> <|endoftext|> é"
    assert tok.encode(text) == ref.encode(text) and 257 not in tok.encode(text)
    assert load_tokenizer(None, cfg).encode(text) == ref.encode(text)


def _bpe_tokenizer() -> tokenizers.Tokenizer:
    """A small word-level-ish BPE tokenizer trained on the fly (a stand-in for a real one)."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"])
    tok.train_from_iterator(
        ["hello world MASK the tokens <|> [ ]", "block diffusion models"] * 20, trainer
    )
    return tok


def test_real_style_tokenizer_with_special_and_config_spellings(tmp_path: Path) -> None:
    backend = _bpe_tokenizer()
    backend.add_special_tokens(
        [AddedToken("<|MASK|>", special=True), AddedToken("<eos>", special=True)]
    )
    mask_id = backend.token_to_id("<|MASK|>")
    eos_id = backend.token_to_id("<eos>")
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"mask_token": {"content": "<|MASK|>"}})
    )
    cfg = get_preset("tiny-sdar", mask_token_id=mask_id, eos_token_ids=(eos_id,))
    tok = load_tokenizer(tmp_path, cfg)
    ids = tok.encode("hello <|MASK|> world<eos>")
    assert mask_id not in ids and ids[-1] == eos_id
    assert (
        tok.decode(ids + [mask_id], skip_special_tokens=True).replace(" ", "")
        == "hello<|MASK|>world"
    )


def test_non_special_added_mask_token_is_still_split() -> None:
    backend = _bpe_tokenizer()
    backend.add_tokens(["[MASK]"])  # not special: encode_special_tokens would not stop it
    mask_id = backend.token_to_id("[MASK]")
    tok = Tokenizer(backend, mask_token_id=mask_id, eos_token_ids=())
    ids = tok.encode("hello [MASK] world")
    assert mask_id not in ids and len(ids) > 3


def test_a_checkpoint_directory_without_tokenizer_json_is_refused(tmp_path) -> None:
    """Not replaced by the byte-level tokenizer: a real checkpoint would then serve with a
    tokenizer that is not its own."""
    from herald.models.loader import load_config, load_model, write_random_checkpoint

    ckpt = write_random_checkpoint("tiny-sdar", tmp_path / "ck", seed=0)
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_model(str(ckpt), "cpu")
    assert load_config("tiny-sdar").vocab_size > 0  # presets still load without a directory
