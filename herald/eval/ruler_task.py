"""The RULER-style tasks of ``herald eval`` (formats: :mod:`herald.eval.ruler_formats`; builder:
:mod:`herald.eval.ruler`) on the local standard library: every eligible file of the
:class:`~herald.eval.sources.Corpus`, as it appears in the other tasks' prompts (its ``# file:``
header, the text, a blank line), is a haystack document.

Example ``i`` of a task at context C is built from its own RNG, seeded with (task, seed, C, i):
a build of n examples is a prefix of a larger build, and no example depends on another. Its
prompt holds at most C - ``RulerConfig.answer_tokens`` tokens; no needle lies in its last
``control_tokens`` tokens (the no-context control's window).
"""

from __future__ import annotations

import random

from herald.eval.ruler import Document, build_instance
from herald.eval.sources import Corpus, TextCodec
from herald.eval.tasks import Example, TaskConfig


class StdlibSource:
    """The corpus's files as haystack documents (their token ids cached by the corpus)."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus.rel_paths)

    def document(self, index: int) -> Document | None:
        rel = self.corpus.rel_paths[index]
        f = self.corpus.read(rel)
        if f is None:
            return None
        return Document(rel, f.chunk(), f.sha256, self.corpus.chunk_ids(rel))


def build_ruler(
    task: str, corpus: Corpus, codec: TextCodec, context: int, n: int, cfg: TaskConfig
) -> list[Example]:
    budget = context - cfg.ruler.answer_tokens
    if budget <= cfg.control_tokens:
        raise ValueError(
            f"{task} at context {context}: the prompt budget (context - answer_tokens "
            f"{cfg.ruler.answer_tokens} = {budget}) must exceed control_tokens "
            f"({cfg.control_tokens})"
        )
    source = StdlibSource(corpus)
    examples = []
    for i in range(n):
        rng = random.Random(f"{task}:{cfg.seed}:{context}:{i}")
        inst = build_instance(
            task, source, codec, budget, rng, cfg.ruler, tail_tokens=cfg.control_tokens
        )
        meta = {"index": i, "prompt_budget": budget, **inst.meta}
        examples.append(
            Example(f"{task}-{context}-{i:03d}", task, context, inst.prompt_ids, inst.target, meta)
        )
    return examples
