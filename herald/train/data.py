"""Training data: corpus -> tokenizer -> token stream (cached) -> packed, seeded windows.

The stream (:func:`herald.train.tokenizer_train.encode_documents` over the documents in
:func:`herald.train.corpus.order_documents` order) is cut into consecutive, non-overlapping
windows of ``seq_len`` tokens (the tail that does not fill a window is dropped). A window
therefore holds neighbouring files of one package (or the end of one package, EOS, and the start
of the next). Epoch ``e`` visits the windows in the permutation
``numpy.random.default_rng([seed, e])``; the position in the data is one integer, the number of
windows consumed so far (:attr:`WindowSampler.position`), which is all a resumed run needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from herald.train.code_names import code_name_stream
from herald.train.corpus import (
    Corpus,
    order_documents,
    package_ends,
    scan_stdlib,
    scan_third_party,
)
from herald.train.tokenizer_train import EOS_ID, encode_documents, sample_documents, train_bpe

STREAM_FORMAT = "herald-stream-v2"
NAMES_FORMAT = "names-v2"  # the code-name mask's rule (herald.train.code_names); bump on change


def stream_cache_key(*parts: str) -> str:
    """A short digest of the things that determine the stream (manifest, tokenizer, seed)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:20]


def _open_array(path: Path, dtype: type, n: int) -> np.ndarray | None:
    """``path`` as a read-only memmap of ``n`` ``dtype`` items, or None if absent or of
    another size."""
    if not path.is_file() or path.stat().st_size != n * np.dtype(dtype).itemsize:
        return None
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,))


def _write_array(path: Path, array: np.ndarray, dtype: type) -> np.ndarray:
    """Write ``array`` as ``dtype`` to ``path`` (atomically: a temporary file, then a rename)
    and return it as a read-only memmap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    np.ascontiguousarray(array, dtype=dtype).tofile(tmp)
    os.replace(tmp, path)
    return np.memmap(path, dtype=dtype, mode="r", shape=(int(array.size),))


def load_cached_stream(work_dir: Path, key: str) -> np.ndarray | None:
    """The cached uint16 stream for ``key`` as a read-only memmap, or None if absent/corrupt."""
    data, meta = work_dir / f"stream-{key}.u16", work_dir / f"stream-{key}.json"
    if not meta.is_file():
        return None
    try:
        n = int(json.loads(meta.read_text())["num_tokens"])
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
    return _open_array(data, np.uint16, n)


def save_stream(work_dir: Path, key: str, stream: np.ndarray) -> np.ndarray:
    """Write ``stream`` (uint16) under ``work_dir`` and return it as a read-only memmap."""
    out = _write_array(work_dir / f"stream-{key}.u16", stream, np.uint16)
    (work_dir / f"stream-{key}.json").write_text(
        json.dumps({"num_tokens": int(stream.size)}) + "\n"
    )
    return out


def load_cached_names(work_dir: Path, key: str, size: int) -> np.ndarray | None:
    """The cached code-name mask of stream ``key`` (read-only uint8 memmap), or None."""
    return _open_array(work_dir / f"stream-{key}.{NAMES_FORMAT}.u8", np.uint8, size)


def save_names(work_dir: Path, key: str, names: np.ndarray) -> np.ndarray:
    """Write the code-name mask of stream ``key`` and return it as a read-only memmap."""
    return _write_array(work_dir / f"stream-{key}.{NAMES_FORMAT}.u8", names, np.uint8)


class WindowSampler:
    """Seeded, resumable batches of ``seq_len``-token windows of a token stream.

    Args:
        stream: [N] uint16 token ids (array or memmap).
        seq_len: tokens per window.
        seed: permutation seed.
        position: windows already consumed (to resume).

    Raises:
        ValueError: the stream holds fewer than one window.
    """

    def __init__(
        self,
        stream: np.ndarray,
        seq_len: int,
        seed: int,
        position: int = 0,
        aux: np.ndarray | None = None,
    ) -> None:
        self.num_windows = int(stream.size) // seq_len
        if aux is not None and aux.shape != stream.shape:
            raise ValueError(f"aux stream of shape {aux.shape} does not match {stream.shape}")
        self.aux = aux
        self.last_windows: list[int] = []
        if self.num_windows < 1:
            raise ValueError(f"token stream of {stream.size} tokens is shorter than {seq_len}")
        self.stream = stream
        self.seq_len = seq_len
        self.seed = seed
        self.position = position
        self._epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed."""
        return self.position / self.num_windows

    def window_index(self, position: int) -> int:
        """The window served at data position ``position``."""
        epoch, i = divmod(position, self.num_windows)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._epoch = epoch
        return int(self._perm[i])

    def window(self, index: int) -> np.ndarray:
        """Window ``index`` in stream order: [seq_len] int64."""
        start = index * self.seq_len
        return np.asarray(self.stream[start : start + self.seq_len], dtype=np.int64)

    def next_batch(self, batch_size: int) -> np.ndarray:
        """The next ``batch_size`` windows: [batch_size, seq_len] int64; advances the position."""
        self.last_windows = [self.window_index(self.position + b) for b in range(batch_size)]
        rows = [self.window(i) for i in self.last_windows]
        self.position += batch_size
        return np.stack(rows)

    def aux_batch(self) -> np.ndarray:
        """The ``aux`` stream's windows of the last :meth:`next_batch`: [batch_size, seq_len]
        bool (e.g. the code-name mask of :mod:`herald.train.code_names`).

        Raises:
            ValueError: the sampler has no aux stream.
        """
        if self.aux is None:
            raise ValueError("this sampler has no aux stream")
        L = self.seq_len
        return np.stack([np.asarray(self.aux[i * L : (i + 1) * L], dtype=bool)
                         for i in self.last_windows])  # fmt: skip


@dataclass
class PreparedData:
    """Everything the loop needs from the corpus side."""

    stream: np.ndarray
    """[N] uint16 training token stream (memmap)."""
    val_windows: np.ndarray
    """[n, seq_len] int64 held-out stdlib windows (n may be 0)."""
    backend: tokenizers.Tokenizer
    manifest: dict[str, Any]
    stdlib_manifest: dict[str, Any]
    stream_key: str
    timings: dict[str, float] = field(default_factory=dict)
    code_names: np.ndarray | None = None
    """[N] uint8 (0/1) beside ``stream``: tokens of a name in code (:mod:`herald.train.code_names`),
    when asked for."""
    corpus: Corpus | None = None
    """The training corpus (its files' texts and origins), kept when asked for (the task mix's
    haystacks, :mod:`herald.train.task_mix`)."""
    stdlib: Corpus | None = None
    """The held-out stdlib corpus, kept with ``corpus``."""


def stdlib_val_windows(
    stdlib: Corpus, backend: tokenizers.Tokenizer, seq_len: int, count: int, seed: int
) -> np.ndarray:
    """``count`` validation windows: the first ``seq_len`` tokens of distinct stdlib packages
    (seeded package order, each package's files in :func:`order_documents` order; packages with
    fewer tokens and the ``test`` package are skipped). Returns [n <= count, seq_len] int64."""
    files = [f for f in stdlib.files if f.package != "test"]
    ordered = order_documents(files, seed)
    by_pkg: dict[str, list[str]] = {}
    for f in ordered:
        by_pkg.setdefault(f.package, []).append(f.document)
    rows: list[np.ndarray] = []
    for docs in by_pkg.values():  # insertion order = seeded package order
        if len(rows) >= count:
            break
        ids = encode_documents(backend, docs, [False] * len(docs))
        if ids.size >= seq_len:
            rows.append(ids[:seq_len].astype(np.int64))
    return np.stack(rows) if rows else np.zeros((0, seq_len), dtype=np.int64)


def prepare_data(
    *,
    seed: int,
    seq_len: int,
    work_dir: Path,
    backend: tokenizers.Tokenizer | None,
    vocab_size: int,
    tokenizer_sample_bytes: int,
    val_windows: int,
    site_dirs: list[Path] | None = None,
    stdlib_dirs: list[Path] | None = None,
    workers: int = 1,
    order: str = "package",
    code_names: bool = False,
    keep_corpus: bool = False,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Scan (stdlib, then third-party minus the stdlib), train the BPE unless ``backend`` is
    given (a resumed run keeps its tokenizer), encode or load the cached stream, cut the
    validation windows; ``keep_corpus``: return both scanned corpora too.

    Raises:
        ValueError: no corpus (see :func:`herald.train.corpus.scan_third_party`).
    """
    timings: dict[str, float] = {}
    t = time.perf_counter()
    stdlib = scan_stdlib(stdlib_dirs, workers=workers)
    corpus = scan_third_party(site_dirs, stdlib, stdlib_roots=stdlib_dirs, workers=workers)
    manifest, std_manifest = corpus.manifest(), stdlib.manifest()
    timings["scan_s"] = time.perf_counter() - t
    log(
        f"corpus: {manifest['file_count']} files, {manifest['bytes'] / 1e6:.1f} MB, "
        f"{manifest['num_packages']} packages from {', '.join(manifest['roots'])}; held-out "
        f"stdlib {std_manifest['file_count']} files, {std_manifest['bytes'] / 1e6:.1f} MB; "
        f"skipped {manifest['skipped']} ({timings['scan_s']:.1f} s)"
    )
    ordered = order_documents(corpus.files, seed, order)
    docs, eos_after = [f.document for f in ordered], package_ends(ordered)
    # The BPE sample is drawn from the package order whatever the stream's order, so that two
    # data orders train on the same tokenizer (and earlier runs' tokenizers stay reproducible).
    sample_pool = (
        docs if order == "package" else [f.document for f in order_documents(corpus.files, seed)]
    )
    kept = corpus if keep_corpus else None
    del corpus, ordered
    t = time.perf_counter()
    if backend is None:
        sample = sample_documents(sample_pool, tokenizer_sample_bytes, seed)
        backend = train_bpe(sample, vocab_size)
        timings["tokenizer_s"] = time.perf_counter() - t
        log(
            f"tokenizer: byte-level BPE, {backend.get_vocab_size()} ids, trained on "
            f"{sum(len(d.encode()) for d in sample) / 1e6:.1f} MB ({timings['tokenizer_s']:.1f} s)"
        )
    del sample_pool
    tok_digest = hashlib.sha256(backend.to_str().encode()).hexdigest()
    parts = [STREAM_FORMAT, manifest["contents_sha256"], tok_digest, str(seed)]
    key = stream_cache_key(*parts, *([order] if order != "package" else []))
    t = time.perf_counter()
    stream = load_cached_stream(work_dir, key)
    if stream is None:
        stream = save_stream(work_dir, key, encode_documents(backend, docs, eos_after))
    timings["encode_s"] = time.perf_counter() - t
    log(
        f"token stream ({order} order): {stream.size / 1e6:.1f} M tokens, "
        f"{manifest['bytes'] / stream.size:.2f} "
        f"bytes/token, {stream.size // seq_len} windows of {seq_len} ({timings['encode_s']:.1f} s)"
    )
    names = None
    if code_names:
        t = time.perf_counter()
        names = load_cached_names(work_dir, key, stream.size)
        if names is None:
            names = save_names(
                work_dir, key, code_name_stream(docs, stream, backend, (EOS_ID,), workers)
            )
        timings["code_names_s"] = time.perf_counter() - t
        log(
            f"code names: {float(np.mean(names)):.1%} of the stream's tokens are part of a name "
            f"in code ({timings['code_names_s']:.1f} s)"
        )
    val = stdlib_val_windows(stdlib, backend, seq_len, val_windows, seed) if val_windows else None
    return PreparedData(
        stream=stream,
        val_windows=val if val is not None else np.zeros((0, seq_len), dtype=np.int64),
        backend=backend,
        manifest=manifest,
        stdlib_manifest=std_manifest,
        stream_key=key,
        timings=timings,
        code_names=names,
        corpus=kept,
        stdlib=stdlib if keep_corpus else None,
    )
