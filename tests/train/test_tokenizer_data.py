"""Trained BPE (special ids, determinism, herald loading) and the packed-window data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from train_fixtures import module_text

from herald.models.config import ModelConfig
from herald.models.loader import hf_config_dict
from herald.tokenizer import load_tokenizer
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
