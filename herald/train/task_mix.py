"""The task mix: RULER-style task instances among the training windows (``--task-mix``).

A fraction of the training sequences are task sequences: an instance of one of the RULER-style
tasks of ``herald eval`` (:mod:`herald.eval.ruler_formats` has the formats, built by
:func:`herald.eval.ruler.build_instance`), whose haystack is text of the *training* corpus, then
its expected completion and an EOS, then the start of the code window that the sequence would
otherwise have held, cut to the sequence length::

    [prompt (<= C - answer_tokens tokens)][" answer\\n"][EOS][code window ...] = seq_len tokens

So the prompt starts at position 0 and is laid out on the block grid exactly as ``herald eval``
lays out a prompt of context C (the prompt at most ``C - RulerConfig.answer_tokens`` tokens,
no needle in its last ``min(512, budget // 4)`` tokens, the eval's no-context control window).

Which sequences: data position ``p`` (the sampler's count of windows served,
:class:`herald.train.data.WindowSampler`) holds a task sequence when ``floor((p + 1) f) >
floor(p f)`` for the fraction ``f`` (an exact rational), so every prefix of the stream holds the
fraction up to one sequence. The ``k``-th task sequence is task ``tasks[k mod T]`` at context
``contexts[(k div T) mod C]``; its instance is drawn from ``random.Random`` seeded with
(``seed``, ``p``). A sequence depends only on the seed, the corpus, the tokenizer and ``p``: the
mix is deterministic and a resumed run continues it (its position carries over).

The loss (:mod:`herald.train.objective`) is unchanged for a task sequence: each block is
masked at its own ratio ``t ~ U(eps, 1)`` and the cross-entropy is taken at the masked
positions, so the answer's block is denoised as ``herald eval`` decodes it (the prompt's clean
blocks before it, the answer block partly masked). Only the answer tokens (``" answer\n"``)
get extra weight, ``task_answer_weight`` (32 by default): they are the only tokens of the
sequence that need its far context, about 5-40 of 4K-32K, so with plain weights they would
carry a few ten-thousandths of the loss. With 32, at ``--task-mix 0.5``, batch 2 and 16K,
they carry ~1% of it; the haystack (training-corpus code) keeps the plain code objective, so
the code loss is trained on nearly every token as before.

Disjoint from the evaluation: the evaluation's haystacks are files of the interpreter's standard
library (:mod:`herald.eval.sources`); the training corpus walks only the third-party site
directories, never enters a stdlib root, and drops files that copy the stdlib
(:func:`herald.train.corpus.scan_third_party`). :class:`CorpusTaskSource` checks it again, file
by file: a file whose nearest enclosing root (of the site and stdlib roots, the interpreter's
stdlib among them) is a stdlib root is refused (``ValueError``), and a file whose text equals a
held-out stdlib file's is left out. The documents are the texts the corpus scan already read:
building a task sequence reads no file.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from herald.eval.ruler import Document, build_instance
from herald.eval.ruler_formats import RULER_TASKS, RulerConfig
from herald.eval.sources import TextCodec
from herald.train.config import TrainConfig, task_mix_contexts
from herald.train.corpus import SourceFile, format_document, stdlib_dirs
from herald.train.data import PreparedData
from herald.train.tokenizer_train import EOS_ID

CONTROL_TOKENS = 512
"""``herald eval``'s no-context control window: needles stay out of a prompt's last tokens."""


def task_ordinal(position: int, fraction: Fraction) -> int:
    """Task sequences among data positions ``0 .. position - 1``."""
    return position * fraction.numerator // fraction.denominator


def is_task_position(position: int, fraction: Fraction) -> bool:
    """Whether data position ``position`` holds a task sequence (module docstring)."""
    return task_ordinal(position + 1, fraction) > task_ordinal(position, fraction)


def as_fraction(value: float) -> Fraction:
    """``value`` (in [0, 1]) as an exact, short rational (0.1 -> 1/10)."""
    return Fraction(value).limit_denominator(10**6)


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def _depth_of_root(path: Path, roots: Iterable[Path]) -> int:
    """The number of parts of the deepest of ``roots`` holding ``path`` (-1: none)."""
    return max((len(r.parts) for r in roots if r == path or r in path.parents), default=-1)


def check_not_stdlib(
    files: Sequence[SourceFile],
    site_roots: Sequence[str | Path],
    stdlib_roots: Sequence[str | Path],
) -> None:
    """Refuse files of the standard library: a file belongs to the deepest root (of
    ``site_roots`` and ``stdlib_roots`` plus the interpreter's stdlib) that holds it; a tie
    goes to the stdlib, and a file with no known origin or outside every site root is refused.

    Raises:
        ValueError: naming the first refused file.
    """
    std = {_real(s) for s in stdlib_roots} | set(stdlib_dirs())
    site = {_real(r) for r in site_roots}
    for f in files:
        if not f.origin:
            raise ValueError(f"task mix: {f.path} has no origin; only files read from the "
                             "training roots may be haystacks")  # fmt: skip
        path = _real(f.origin)
        in_site, in_std = _depth_of_root(path, site), _depth_of_root(path, std)
        if in_site < 0 or in_std >= in_site:
            raise ValueError(
                f"task mix: refusing {path}: it lies in the standard library (the evaluation's "
                "haystacks), not in a training site directory"
            )


class CorpusTaskSource:
    """The training corpus's files as haystack documents (:class:`herald.eval.ruler.TextSource`):
    each one formatted as in the training stream and the eval prompts (its ``# file:`` header,
    the text, a blank line); files whose text equals a stdlib file's (``stdlib_texts``) are
    left out.

    Raises:
        ValueError: a file of the standard library (:func:`check_not_stdlib`), or no file left.
    """

    def __init__(
        self,
        files: Sequence[SourceFile],
        site_roots: Sequence[str | Path],
        stdlib_roots: Sequence[str | Path],
        stdlib_texts: Iterable[str] = (),
    ) -> None:
        check_not_stdlib(files, site_roots, stdlib_roots)
        banned = {hashlib.sha256(t.encode()).digest() for t in stdlib_texts}
        self.files = [f for f in files if hashlib.sha256(f.text.encode()).digest() not in banned]
        self.dropped = len(files) - len(self.files)
        if not self.files:
            raise ValueError("task mix: no training file to build haystacks from")

    def __len__(self) -> int:
        return len(self.files)

    def document(self, index: int) -> Document | None:
        f = self.files[index]
        digest = hashlib.sha256(f.text.encode()).hexdigest()
        return Document(f.path, format_document(f.path, f.text), digest)


@dataclass(frozen=True)
class TaskSequence:
    """One task sequence's tokens (prompt, completion, EOS) and where its answer lies."""

    ids: np.ndarray
    """[n] int64: the prompt's tokens, the completion's, EOS."""
    answer: slice
    """The completion's tokens (``" answer\\n"``) in ``ids``."""
    task: str
    context: int
    target: str


class TaskMixer:
    """Turns the task positions of each batch into task sequences (module docstring).

    Args:
        source: haystack documents (:class:`CorpusTaskSource`).
        codec: the model's tokenizer (as ``herald eval`` encodes prompts).
        fraction: share of the sequences that are task sequences, in (0, 1].
        tasks: RULER-style task names; contexts: prompt contexts C, each <= ``seq_len``.
        eos_id: the EOS id put after the completion.
    """

    def __init__(
        self,
        source: Any,
        codec: TextCodec,
        *,
        fraction: float,
        tasks: Sequence[str],
        contexts: Sequence[int],
        seq_len: int,
        seed: int,
        eos_id: int,
        ruler: RulerConfig = RulerConfig(),  # noqa: B008 (frozen)
    ) -> None:
        bad = [t for t in tasks if t not in RULER_TASKS]
        if bad or not tasks:
            raise ValueError(f"task mix: unknown tasks {bad}; choose from {RULER_TASKS}")
        if any(c > seq_len or c <= ruler.answer_tokens for c in contexts) or not contexts:
            raise ValueError(f"task mix contexts {list(contexts)} must lie in "
                             f"({ruler.answer_tokens}, {seq_len}]")  # fmt: skip
        self.source, self.codec, self.ruler = source, codec, ruler
        self.fraction = as_fraction(fraction)
        self.tasks, self.contexts = tuple(tasks), tuple(contexts)
        self.seq_len, self.seed, self.eos_id = seq_len, seed, eos_id
        self._pool: Any = None  # worker processes (start_workers)
        self._pending: dict[int, Any] = {}  # position -> its sequence, being built
        self._submitted = 0  # positions below this one were submitted
        self._ahead = 1

    def sequence(self, position: int) -> TaskSequence | None:
        """The task sequence of data position ``position``, or None (a code window)."""
        if not is_task_position(position, self.fraction):
            return None
        k = task_ordinal(position, self.fraction)
        task = self.tasks[k % len(self.tasks)]
        context = self.contexts[(k // len(self.tasks)) % len(self.contexts)]
        return self._build(
            task, context, random.Random(f"herald-train-task:{self.seed}:{position}")
        )

    def probe(self) -> None:
        """Build one instance of every task at the smallest context (the tightest fit), so that
        a task the contexts cannot hold fails before training starts.

        Raises:
            ValueError: naming the task and the context.
        """
        for task in self.tasks:
            self._build(task, min(self.contexts), random.Random(f"herald-probe:{self.seed}"))

    def _build(self, task: str, context: int, rng: random.Random) -> TaskSequence:
        budget = context - self.ruler.answer_tokens
        tail = min(CONTROL_TOKENS, budget // 4)
        try:
            inst = build_instance(task, self.source, self.codec, budget, rng, self.ruler, tail)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"task mix: {task} at context {context}: {e}") from None
        completion = self.codec.encode(inst.completion)
        n_prompt = len(inst.prompt_ids)
        ids = np.asarray([*inst.prompt_ids, *completion, self.eos_id], dtype=np.int64)
        if ids.size > self.seq_len:
            raise ValueError(f"task mix: a {task} sequence of {ids.size} tokens exceeds "
                             f"--seq-len {self.seq_len}")  # fmt: skip
        return TaskSequence(ids, slice(n_prompt, n_prompt + len(completion)), task, context,
                            inst.target)  # fmt: skip

    def apply(
        self, batch: np.ndarray, first_position: int, aux: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """``batch`` ([bs, L] windows of data positions ``first_position ...``) with its task
        positions replaced; ``aux`` (a per-token mask beside the windows, or None) likewise,
        False over the task part; and the answer mask [bs, L] bool (the completions)."""
        out = batch.copy()
        aux_out = None if aux is None else aux.copy()
        answer = np.zeros(batch.shape, dtype=bool)
        for b in range(batch.shape[0]):
            seq = self._lookup(first_position + b)
            if seq is None:
                continue
            n = seq.ids.size
            out[b, :n], out[b, n:] = seq.ids, batch[b, : batch.shape[1] - n]
            if aux_out is not None and aux is not None:
                aux_out[b, :n], aux_out[b, n:] = False, aux[b, : batch.shape[1] - n]
            answer[b, seq.answer] = True
        return out, aux_out, answer

    def start_workers(self, workers: int, ahead: int) -> None:
        """Build the task sequences of the next ``ahead`` data positions in ``workers`` forked
        processes while the training steps run (the results are those of :meth:`sequence`:
        each is a function of its position). Forks now: call before CUDA is initialised."""
        global _WORKER_MIXER
        if workers < 1 or sys.platform != "linux":
            return
        _WORKER_MIXER = self
        try:
            # NOTE: fork (the workers share the corpus texts); before CUDA is initialised.
            self._pool = multiprocessing.get_context("fork").Pool(workers)
        finally:
            _WORKER_MIXER = None
        self._ahead = max(1, ahead)

    def close(self) -> None:
        """Stop the worker processes (if any)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()
        self._pending.clear()

    def _lookup(self, position: int) -> TaskSequence | None:
        """:meth:`sequence`, from the workers when they run (submitting the next positions)."""
        if self._pool is None:
            return self.sequence(position)
        start = max(self._submitted, position)
        for p in range(start, position + self._ahead):
            if is_task_position(p, self.fraction):
                self._pending[p] = self._pool.apply_async(_worker_sequence, (p,))
        self._submitted = max(start, position + self._ahead)
        for stale in [p for p in self._pending if p < position]:
            del self._pending[stale]
        job = self._pending.pop(position, None)
        return job.get() if job is not None else self.sequence(position)

    def counts(self, start: int, end: int) -> dict[str, int]:
        """Task sequences per task among data positions ``start .. end - 1``."""
        counts: Counter[str] = Counter()
        for p in range(start, end):
            if is_task_position(p, self.fraction):
                counts[self.tasks[task_ordinal(p, self.fraction) % len(self.tasks)]] += 1
        return dict(sorted(counts.items()))

    def summary(self, start: int, end: int, answer_weight: float) -> dict[str, Any]:
        """The mix's settings and the task sequences of data positions ``start .. end - 1``."""
        return {
            "fraction": float(self.fraction),
            "tasks": list(self.tasks),
            "contexts": list(self.contexts),
            "answer_weight": answer_weight,
            "sequences": self.counts(start, end),
        }


_WORKER_MIXER: TaskMixer | None = None
"""The mixer of the worker processes (set in the parent while it forks them)."""


def _worker_sequence(position: int) -> TaskSequence | None:
    assert _WORKER_MIXER is not None, "a task-mix worker without its mixer"
    return _WORKER_MIXER.sequence(position)


def build_mixer(
    files: Sequence[SourceFile],
    site_roots: Sequence[str | Path],
    stdlib_roots: Sequence[str | Path],
    stdlib_texts: Iterable[str],
    codec: TextCodec,
    **kw: Any,
) -> TaskMixer:
    """A :class:`TaskMixer` over a :class:`CorpusTaskSource` of ``files`` (``kw`` as there)."""
    source = CorpusTaskSource(files, site_roots, stdlib_roots, stdlib_texts)
    mixer = TaskMixer(source, codec, **kw)
    mixer.probe()
    return mixer


def mixer_for(cfg: TrainConfig, data: PreparedData, codec: TextCodec) -> TaskMixer | None:
    """The task mix of a run (None when ``cfg.task_mix`` is 0); ``data`` must hold both corpora
    (:func:`herald.train.data.prepare_data` with ``keep_corpus``)."""
    if cfg.task_mix == 0:
        return None
    if data.corpus is None or data.stdlib is None:
        raise ValueError("task mix: the prepared data holds no corpus (keep_corpus)")
    return build_mixer(
        data.corpus.files,
        data.corpus.roots,
        data.stdlib.roots,
        (f.text for f in data.stdlib.files),
        codec,
        fraction=cfg.task_mix,
        tasks=cfg.task_mix_tasks,
        contexts=task_mix_contexts(cfg),
        seq_len=cfg.seq_len,
        seed=cfg.seed,
        eos_id=EOS_ID,
    )
