"""Trained BPE (special ids, determinism, herald loading) and the packed-window data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_fixtures import module_text

from herald.models.config import ModelConfig
from herald.models.loader import hf_config_dict
from herald.models.tokenizer import load_tokenizer
from herald.train import tokenizer_train as T
from herald.train.config import ModelDims, model_config
from herald.train.data import WindowSampler, load_cached_stream, save_stream

DOCS = [f"# file: p/m{j}.py\n" + module_text("p", j) for j in range(6)]


@pytest.fixture(scope="module")
def backend():
    return T.train_bpe(DOCS, 400)


def test_bpe_special_ids_and_determinism(backend) -> None:
    assert 300 < backend.get_vocab_size() <= 400  # fewer when merges run out (tiny corpus)
    assert [backend.token_to_id(t) for t in T.SPECIAL_TOKENS] == [0, 1, 2]
    assert T.train_bpe(DOCS, 400).to_str() == backend.to_str()
    with pytest.raises(ValueError, match="vocab_size"):
        T.train_bpe(DOCS, 100)


def test_saved_tokenizer_loads_with_the_config_ids(backend, tmp_path: Path) -> None:
    tok = T.as_herald_tokenizer(backend)
    tok.save(tmp_path)
    cfg = model_config(ModelDims(hidden_size=64, num_heads=4, num_kv_heads=1, head_dim=16), 400)
    assert ModelConfig.from_hf(hf_config_dict(cfg)) == cfg
    assert (cfg.mask_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (2, (0,), 1)
    loaded = load_tokenizer(tmp_path, cfg)
    text = "def f(x):\n    return x  # <|MASK|> stays text, héllo ✓\n"
    ids = loaded.encode(text)
    assert 2 not in ids and loaded.decode(ids) == text
    assert loaded.encode("a<|endoftext|>")[-1] == 0  # inference recognises EOS text


def test_stream_has_eos_per_document_and_no_special_text(backend) -> None:
    docs = ["x = '<|endoftext|> <|MASK|> <|pad|>'\n", "y = 2\n"]
    stream = T.encode_documents(backend, docs, chunk=1)
    assert stream.dtype == np.uint16
    eos = np.flatnonzero(stream == T.EOS_ID).tolist()
    assert len(eos) == 2 and eos[1] == stream.size - 1  # exactly one EOS after each document
    assert not np.isin(stream, [T.PAD_ID, T.MASK_ID]).any()
    tok = T.as_herald_tokenizer(backend)
    assert tok.decode(stream[: eos[0]].tolist()) == docs[0]
    assert tok.decode(stream[eos[0] + 1 : eos[1]].tolist()) == docs[1]


def test_eos_only_where_asked(backend) -> None:
    docs = ["a = 1\n\n", "b = 2\n\n", "c = 3\n\n"]
    stream = T.encode_documents(backend, docs, [False, True, True])
    eos = np.flatnonzero(stream == T.EOS_ID).tolist()
    assert len(eos) == 2 and eos[1] == stream.size - 1
    tok = T.as_herald_tokenizer(backend)
    assert tok.decode(stream[: eos[0]].tolist()) == docs[0] + docs[1]
    with pytest.raises(ValueError, match="one flag"):
        T.encode_documents(backend, docs, [True])


def test_windows_are_seeded_and_resumable(tmp_path: Path) -> None:
    stream = np.arange(1000, dtype=np.uint16)
    cached = save_stream(tmp_path, "k", stream)
    assert np.array_equal(load_cached_stream(tmp_path, "k"), stream)
    assert load_cached_stream(tmp_path, "other") is None
    a = WindowSampler(cached, 64, seed=5)
    assert a.num_windows == 15
    batches = [a.next_batch(4) for _ in range(6)]  # crosses an epoch boundary (24 > 15)
    starts = np.concatenate([b[:, 0] for b in batches]) // 64
    assert sorted(starts[:15].tolist()) == list(range(15))  # one epoch = every window once
    assert all(np.array_equal(b[:, 1:] - b[:, :-1], np.ones((4, 63))) for b in batches)
    b = WindowSampler(cached, 64, seed=5, position=8)
    assert np.array_equal(b.next_batch(4), batches[2])
    assert not np.array_equal(WindowSampler(cached, 64, seed=6).next_batch(4), batches[0])
    with pytest.raises(ValueError, match="shorter"):
        WindowSampler(stream[:10], 64, seed=0)


def test_sampler_aux_windows_follow_the_token_windows(tmp_path: Path) -> None:
    stream = np.arange(1000, dtype=np.uint16)
    aux = (stream % 3 == 0).astype(np.uint8)
    s = WindowSampler(stream, 64, seed=5, aux=aux)
    for _ in range(5):
        tokens = s.next_batch(4)
        assert np.array_equal(s.aux_batch(), tokens % 3 == 0)
    with pytest.raises(ValueError, match="does not match"):
        WindowSampler(stream, 64, seed=5, aux=aux[:-1])
    with pytest.raises(ValueError, match="no aux"):
        WindowSampler(stream, 64, seed=5).aux_batch()


def test_code_names_mark_names_in_code_only(backend) -> None:
    from herald.train.code_names import code_name_mask, name_spans, token_byte_lengths

    text = 'import os\ndef f(a):\n    """Doc names here."""\n    return os.sep + a  # note x\n'
    got = {text.encode()[a:b].decode() for a, b in name_spans(text)}
    assert got == {"os", "f", "a", "sep"}  # no keyword, nothing from the docstring or comment
    ids = np.asarray(backend.encode(text, add_special_tokens=False).ids)
    mask = code_name_mask(text, ids, token_byte_lengths(backend))
    marked = "".join(backend.decode([int(i)]) for i, m in zip(ids, mask, strict=True) if m)
    assert "Doc" not in marked and "note" not in marked and "return" not in marked
    assert "sep" in marked and "os" in marked
    # non-ASCII text before a name: byte offsets, not character offsets
    text2 = "s = 'héllo'; name = 1\n"
    assert [text2.encode()[a:b] for a, b in name_spans(text2)] == [b"s", b"name"]
    # source that does not tokenize keeps the names before the error
    broken = "x = (1,\n"
    assert [broken.encode()[a:b] for a, b in name_spans(broken)] == [b"x"]

    def names(src: str) -> list[bytes]:
        return [src.encode()[a:b] for a, b in name_spans(src)]

    # line breaks other than "\n" (form feed, U+2028 in a string) do not shift later lines
    assert names("a = 1\n\x0cdef foo(bar):\n    return bar\n") == [b"a", b"foo", b"bar", b"bar"]
    assert names('s = "x\u2028y"\nname = 1\n') == [b"s", b"name"]
    # f-string braces are string text on every Python version; a BOM does not hide a keyword
    assert names('x = f"{y!r:>{width}}"\n') == [b"x"]
    assert names("\ufeffimport os\n") == [b"os"]


@pytest.mark.parametrize("workers", [1, 2])
def test_code_name_stream_matches_each_document(backend, workers) -> None:
    from herald.train.code_names import code_name_mask, code_name_stream, token_byte_lengths

    docs = [module_text("p", j) for j in range(40)] + ["", "x = 1\n", ""]
    eos = [i % 3 == 0 for i in range(len(docs))]
    stream = T.encode_documents(backend, docs, eos)
    got = code_name_stream(docs, stream, backend, (T.EOS_ID,), workers=workers)
    assert got.dtype == np.uint8 and got.shape == stream.shape
    lengths, want = token_byte_lengths(backend), []
    for d, e in zip(docs, eos, strict=True):
        ids = np.asarray(backend.encode(d, add_special_tokens=False).ids, dtype=np.int64)
        want.append(code_name_mask(d, ids, lengths).astype(np.uint8))
        want.append(np.zeros(int(e), dtype=np.uint8))
    assert np.array_equal(got, np.concatenate(want)) and 0 < got.mean() < 1
    with pytest.raises(ValueError, match="do not cover"):
        code_name_stream(docs[:-2], stream, backend, (T.EOS_ID,))
    with pytest.raises(ValueError, match="boundaries"):  # same bytes, another order
        code_name_stream(docs[::-1], stream, backend, (T.EOS_ID,))
