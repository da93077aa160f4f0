"""The recorded example selection of ``herald eval`` (:mod:`herald.eval.cli`): a (task,
context)'s examples built once, less the ``--exclude-examples`` targets, and written to
``examples/<task>_<context>.json`` (files, sha256, lines, Python, tokenizer, settings); a
different selection already under ``--out`` is refused.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from herald.eval.sources import Corpus, fingerprint
from herald.eval.tasks import Example, TaskConfig, build_examples, selection_hash


def select_examples(
    task: str,
    context: int,
    corpus: Corpus,
    tokenizer: Any,
    cfg: TaskConfig,
    num_examples: int,
    *,
    drop: set[tuple[str, str]],
    excluded_from: list[str],
    model: str,
    out: Path,
) -> list[Example]:
    """The first ``num_examples`` examples of ``task`` at ``context`` whose (file, target line)
    is not in ``drop``, recorded in ``out/examples/<task>_<context>.json`` (``excluded_from``:
    the ``--exclude-examples`` files of ``task``; ``model``: the ``--model`` given).

    Raises:
        ValueError: no example could be built, or ``out`` already holds another selection of
            this task and context.
    """
    t0 = time.perf_counter()
    n_build = num_examples + len(drop)  # enough that n remain after the exclusion
    exs = build_examples(task, corpus, tokenizer, context, n_build, cfg)
    if drop:
        n_built = len(exs)
        exs = [e for e in exs if (e.meta.get("file", ""), e.target) not in drop]
        print(
            f"{task} at {context}: {n_built - len(exs)} of {n_built} built examples "
            f"excluded (--exclude-examples)",
            file=sys.stderr,
        )
    exs = exs[:num_examples]
    if not exs:
        raise ValueError(f"no {task} example could be built at context {context}")
    if len(exs) < num_examples:
        print(
            f"NOTE: {task} at {context}: asked for {num_examples} examples, the "
            f"corpus has {len(exs)} eligible ones; running {len(exs)}",
            file=sys.stderr,
        )
    sel = {
        "task": task,
        "context": context,
        "effective_context": context,  # checked against the model up front
        "selection_sha256": selection_hash(exs),
        "corpus": corpus.describe(),
        "tokenizer": {"sha256": fingerprint(tokenizer), "model": model},
        "task_config": asdict(cfg),
        "build_seconds": time.perf_counter() - t0,
        "excluded_from": excluded_from,
        "examples": [{"id": e.example_id, "target": e.target, **e.meta} for e in exs],
    }
    path = out / "examples" / f"{task}_{context}.json"
    if path.is_file():
        old = json.loads(path.read_text())["selection_sha256"]
        new = selection_hash(exs)
        if old != new:
            raise ValueError(
                f"{path} holds a different selection ({old[:12]} != {new[:12]}: another "
                "stdlib, tokenizer, seed or --num-examples); use a new --out"
            )
    path.write_text(json.dumps(sel, indent=1) + "\n")
    return exs
