"""Runs examples through the engines: one *unit* = one (task, context, mode, budget).

Modes: ``dense`` (:class:`~herald.engine.dense.DenseEngine`, the reference), ``control`` (dense
over only the last ``control_tokens`` prompt tokens: how much the long context matters), and the
offloading modes ``mage``, ``infinigen``, ``herald`` (:class:`~herald.offload.engine.OffloadEngine`
with :meth:`~herald.config.OffloadConfig.for_mode` and the unit's ``kv_budget``). Every mode
decodes greedily with the same :class:`~herald.config.SamplingParams`, the examples of a unit
batched through one engine (up to ``batch_size`` running at once), the model in bfloat16 (the
offloading modes require it; dense uses it too so that budget 1.0 reproduces dense exactly).

A unit's result (a JSON-ready dict) holds every prediction and per-example score, the mean
metrics, the prompt-selection hash and timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from herald.config import EngineConfig, OffloadConfig, SamplingParams
from herald.eval.metrics import HEADLINE, predict, score
from herald.eval.tasks import Example, selection_hash
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig
from herald.progress import progress

OFFLOAD_MODES = ("mage", "infinigen", "herald")
MODES = ("dense", "control", *OFFLOAD_MODES)
DEFAULT_BUDGETS = (0.01, 0.025, 0.05, 0.10, 0.20)
OPERATING_BUDGET = {"mage": 0.025, "herald": 0.05, "infinigen": 0.20}
"""Each offloading mode's throughput operating point (paper Table II); run first."""


@dataclass(frozen=True)
class Unit:
    """One run: ``mode`` over the examples of (``task``, ``context``); ``budget`` for the
    offloading modes; ``mode == "analysis"`` is a selection-recall analysis
    (:mod:`herald.eval.recall`)."""

    task: str
    context: int
    mode: str
    budget: float | None = None

    @property
    def key(self) -> str:
        """File-name-safe id, e.g. ``line_8192_herald_0.05``."""
        tail = f"_{self.budget:g}" if self.budget is not None else ""
        return f"{self.task}_{self.context}_{self.mode}{tail}"


@dataclass(frozen=True)
class DecodeConfig:
    """How every unit decodes (recorded with each result)."""

    threshold: float = 0.95
    steps: int | None = None
    """Fixed denoising steps per block (None: confidence threshold)."""
    line_blocks: int = 2
    """max_new_tokens = this many blocks for line completion."""
    recall_blocks: int = 1
    """max_new_tokens = this many blocks for identifier recall."""
    ruler_blocks: int = 2
    """max_new_tokens = this many blocks for the RULER-style tasks (their answer line)."""
    batch_size: int = 16
    control_tokens: int = 512
    selection_threads: int | None = None
    first_pass: str = "none"
    """``OffloadConfig.first_pass`` of the ``herald`` units (e.g. ``"int8-gpu"``)."""

    def answer_blocks(self, task: str) -> int:
        """Blocks decoded per example of ``task``."""
        return {"line": self.line_blocks, "recall": self.recall_blocks}.get(task, self.ruler_blocks)

    def params(self, task: str, block_size: int) -> SamplingParams:
        blocks = self.answer_blocks(task)
        p = SamplingParams(
            max_new_tokens=blocks * block_size,
            temperature=0.0,
            threshold=self.threshold,
            num_denoise_steps=self.steps,
        )
        p.validate()
        return p


def plan_units(
    tasks: Sequence[str],
    contexts: Sequence[int],
    modes: Sequence[str],
    budgets: Sequence[float],
    *,
    control: bool = True,
    analysis: bool = False,
) -> list[Unit]:
    """Every unit of a run, most important first: per (task, context) dense, the control, each
    offloading mode at its operating budget, the analysis, then the other budgets (so that a run
    cut short by a time limit still has the headline numbers)."""
    head: list[Unit] = []
    rest: list[Unit] = []
    for context in contexts:
        for task in tasks:
            if "dense" in modes:
                head.append(Unit(task, context, "dense"))
            if control:
                head.append(Unit(task, context, "control"))
            for mode in (m for m in OFFLOAD_MODES if m in modes):
                op = OPERATING_BUDGET[mode]
                for b in budgets:
                    (head if math.isclose(b, op) else rest).append(Unit(task, context, mode, b))
            if analysis:
                head.append(Unit(task, context, "analysis"))
    return head + rest


def make_engine(
    mode: str,
    budget: float | None,
    model: BlockDiffusionLM,
    config: ModelConfig,
    *,
    max_batch_size: int,
    max_seq_len: int,
    selection_threads: int | None = None,
    first_pass: str = "none",
) -> Any:
    """A fresh engine for ``mode`` (``dense`` / ``control`` -> DenseEngine, eager; otherwise an
    OffloadEngine at ``budget``). The caller closes offloading engines (``close()``)."""
    if mode in ("dense", "control"):
        from herald.engine.dense import DenseEngine

        ecfg = EngineConfig(
            max_batch_size=max_batch_size, max_seq_len=max_seq_len, use_cuda_graph=False
        )
        return DenseEngine(model, config, ecfg)
    if mode not in OFFLOAD_MODES or budget is None:
        raise ValueError(f"unknown mode {mode!r} or missing budget")
    from herald.offload.engine import OffloadEngine

    over: dict[str, Any] = {"kv_budget": budget}
    if selection_threads is not None:
        over["selection_threads"] = selection_threads
    if mode == "herald" and first_pass != "none":
        over["first_pass"] = first_pass
    offload = OffloadConfig.for_mode(mode, **over)
    ecfg = EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, offload=offload)
    return OffloadEngine(model, config, ecfg)


def generate(
    engine: Any, prompts: Sequence[list[int]], params: SamplingParams, desc: str = ""
) -> list[Any]:
    """Queue every prompt, step the engine until all finish; returns the requests in order.
    Shows a progress bar of finished requests on stderr."""
    reqs = [engine.add_request(p, params) for p in prompts]
    bar = progress(total=len(reqs), desc=desc, unit="ex", leave=False)
    done = 0
    while engine.has_unfinished():
        engine.step()
        now = sum(r.status.finished for r in reqs)
        bar.update(now - done)
        done = now
    bar.close()
    return reqs


def run_unit(
    unit: Unit,
    examples: list[Example],
    model: BlockDiffusionLM,
    config: ModelConfig,
    tokenizer: Any,
    dcfg: DecodeConfig,
) -> dict[str, Any]:
    """Decode ``examples`` with ``unit.mode`` and score them.

    Returns the unit's result: ``metrics`` (mean ``em``, ``es`` in [0, 1] and ``score`` = the
    task's headline metric x 100), ``examples`` (id, prediction, per-example scores, the decoded
    completion, finish reason), ``timing`` (seconds) and the ``selection_sha256`` of the prompts.

    Raises:
        ValueError: unknown mode; an engine refusing a prompt (too long for it).
    """
    if not examples:
        raise ValueError(f"{unit.key}: no examples")
    params = dcfg.params(unit.task, config.block_size)
    if unit.mode == "control":
        prompts = [ex.prompt_ids[-dcfg.control_tokens :] for ex in examples]
    else:
        prompts = [ex.prompt_ids for ex in examples]
    max_len = max(len(p) for p in prompts) + params.max_new_tokens + 2 * config.block_size
    t0 = time.perf_counter()
    engine = make_engine(
        unit.mode,
        unit.budget,
        model,
        config,
        max_batch_size=min(dcfg.batch_size, len(prompts)),
        max_seq_len=max_len,
        selection_threads=dcfg.selection_threads,
        first_pass=dcfg.first_pass,
    )
    try:
        reqs = generate(engine, prompts, params, desc=unit.key)
    finally:
        # Offloading engines: stop the retrieval thread, then unpin the CPU pool they own.
        for owner in (engine, getattr(engine, "cpu_pool", None)):
            close = getattr(owner, "close", None)
            if close is not None:
                close()
    seconds = time.perf_counter() - t0
    rows = []
    for ex, req in zip(examples, reqs, strict=True):
        completion = tokenizer.decode(req.output_ids)
        pred = predict(unit.task, completion)
        s = score(unit.task, pred, ex.target)
        rows.append(
            {
                "id": ex.example_id,
                "prediction": pred,
                **s,
                "completion": completion[:200],
                "num_output_tokens": len(req.output_ids),
                "finish_reason": req.finish_reason,
                "steps_per_block": list(req.steps_per_block),
            }
        )
    em = sum(r["em"] for r in rows) / len(rows)
    es = sum(r["es"] for r in rows) / len(rows)
    steps = [s for r in rows for s in r["steps_per_block"]]
    st = engine.stats
    return {
        "unit": unit.key,
        **asdict(unit),
        "num_examples": len(rows),
        "metrics": {
            "em": em,
            "es": es,
            "score": 100.0 * (em if HEADLINE[unit.task] == "em" else es),
        },
        "selection_sha256": selection_hash(examples),
        "prompt_tokens_mean": sum(len(p) for p in prompts) / len(prompts),
        "timing": {
            "seconds": seconds,
            "prefill_seconds": st.prefill_seconds,
            "decode_seconds": st.decode_seconds,
            "num_forwards": st.num_forwards,
            "mean_steps_per_block": sum(steps) / max(1, len(steps)),
        },
        "examples": rows,
    }
