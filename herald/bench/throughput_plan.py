"""What the throughput benchmark measures (HERALD §VI-C): variants, sweeps, plans and parts.

A *variant* is an engine configuration (dense, or an offloading mode with its switches); a *sweep*
is one variant on one model and context with a budget, a GPU-memory cap, T and a list of batch
sizes; a *plan* is an ordered list of sweeps that regenerates the report's tables and figures. A
*point* is one batch size of a sweep: the unit that is measured, recorded (one JSONL line) and
skipped when a later run resumes.

Sweeps that name the same measurement (same model, context, variant, budget, cap, T) are merged,
so the HERALD sweep of Table II is also the last rung of Fig. 13 and the T = 20 column of Fig. 14.

A sweep's *contexts* are uniform (every request at the sweep's context: the plans' sweeps) or
mixed (each request at its own context, :func:`mixed_context_lengths`): ``--mixed-contexts``
gives every sweep a mixed twin, a sweep of its own (its own key, records and report rows)
measured batch by batch right after the uniform one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from herald.config import OffloadConfig

LLADA, SDAR = "llada2-mini", "sdar-8b-chat"
K16, K32 = 16384, 32768
CAP_H100 = 80.0  # GB: the paper's H100; the headline setting


@dataclass(frozen=True)
class Variant:
    """An engine configuration: ``mode`` and OffloadConfig overrides on top of its preset."""

    name: str
    label: str
    mode: str  # dense | herald | mage | infinigen (OffloadConfig.for_mode)
    overrides: tuple[tuple[str, str], ...] = ()
    default_budget: float | None = None

    @property
    def offload(self) -> bool:
        return self.mode != "dense"

    @property
    def rehearses(self) -> bool:
        """Whether its points time a second pass over the same shapes
        (:mod:`herald.bench.throughput_point`): dense (its key length grows per block, each new
        length a one-time attention plan) and the draft lookahead (its (batch, 2B) forward runs
        once per block, eagerly the first time and captured into a CUDA graph the second, so a
        single warm-up block leaves the capture to the first timed block)."""
        if not self.offload:
            return True
        return self.offload_config(self.default_budget or 0.05).lookahead != "off"

    def offload_config(self, budget: float, threads: int | None = None) -> OffloadConfig:
        return OffloadConfig.for_mode(
            self.mode, kv_budget=budget, selection_threads=threads, **dict(self.overrides)
        )

    def cpu_selection_queries(self, block_size: int) -> int | None:
        """Queries per request of the CPU selection kernel (1 = representative, B = the block's
        own queries), or None when selection does not run on the CPU."""
        if not self.offload:
            return None
        cfg = self.offload_config(self.default_budget or 0.05)
        if cfg.selection_queries == "proxy" or cfg.selection_device == "gpu":
            return None
        if cfg.first_pass == "int8-gpu":  # scored on the GPU: the CPU kernel never runs
            return None
        return 1 if cfg.selection_queries == "representative" else block_size


VARIANTS = {
    v.name: v
    for v in (
        Variant("dense", "Dense", "dense"),
        # the paper's kernel output, pinned: the herald preset's default is "selected"
        Variant("herald", "HERALD", "herald", (("output_mode", "full"),), 0.05),
        Variant(
            "herald-selected",
            "HERALD, `selected` kernel output",
            "herald",
            (("output_mode", "selected"),),
            0.05,
        ),
        Variant(
            "herald-int8-gpu",
            "HERALD, int8 K scored on the GPU (approximate)",
            "herald",
            (("first_pass", "int8-gpu"),),
            0.05,
        ),
        Variant("mage", "MAGE-Offload (GPU selection)", "mage", default_budget=0.025),
        Variant("mage-cpu", "MAGE, CPU selection", "mage", (("selection_device", "cpu"),), 0.025),
        Variant(
            "mage-cpu-rep",
            "CPU selection + representative query (no lookahead)",
            "herald",
            (("lookahead", "off"),),
            0.05,
        ),
        Variant("infinigen", "InfiniGen (once per block)", "infinigen", default_budget=0.2),
    )
}

# The paper's Table II (H100 80 GB): (model, context, variant) -> (batch, tokens/s).
PAPER_TABLE2 = {
    (LLADA, K16, "dense"): (32, 1864), (LLADA, K16, "infinigen"): (16, 555),
    (LLADA, K16, "mage"): (96, 749), (LLADA, K16, "herald"): (160, 3385),
    (LLADA, K32, "dense"): (16, 1168), (LLADA, K32, "infinigen"): (16, 340),
    (LLADA, K32, "mage"): (56, 403), (LLADA, K32, "herald"): (80, 2665),
    (SDAR, K16, "dense"): (15, 754), (SDAR, K16, "infinigen"): (16, 178),
    (SDAR, K16, "mage"): (64, 230), (SDAR, K16, "herald"): (68, 1367),
    (SDAR, K32, "dense"): (8, 458), (SDAR, K32, "infinigen"): (16, 89),
    (SDAR, K32, "mage"): (40, 125), (SDAR, K32, "herald"): (34, 867),
}  # fmt: skip
# The paper's Fig. 13 (LLaDA2.0-mini, 5%): context -> rung -> peak tokens/s.
PAPER_FIG13 = {
    K16: {"mage": 739, "mage-cpu": 755, "mage-cpu-rep": 2630, "herald": 3385},
    K32: {"mage": 396, "mage-cpu": 382, "mage-cpu-rep": 1699, "herald": 2665},
}
FIG13_RUNGS = ("mage", "mage-cpu", "mage-cpu-rep", "herald", "herald-selected", "herald-int8-gpu")
FIG14_STEPS = (8, 12, 16, 20, 24, 32)
FIG14_DEFAULT_BATCH = {(K16, "dense"): 32, (K32, "dense"): 16, (K16, "herald"): 160,
                       (K32, "herald"): 80}  # fmt: skip  # the paper's; used if no T=20 peak
TABLE2_VARIANTS = ("dense", "infinigen", "mage", "herald")

# Batch sizes per (model, context): dense up to what the whole H200 can hold (a sweep stops at
# its first out-of-memory point), HERALD up to what ~250 GiB of DRAM can hold (the two-GPU
# machine's host; on the one-GPU machine's ~107 GiB pool the sweep stops at its first DRAM-bound
# batch), and the baselines past their measured peaks, until GPU memory or the pool binds (MAGE's
# per-block full fetch is a fixed cost per request, so its throughput rises with the batch
# towards the per-block full-KV fetch ceiling until DRAM binds; InfiniGen's 20% fetch likewise).
BATCHES: dict[tuple[str, int], dict[str, tuple[int, ...]]] = {
    (LLADA, K16): {
        "dense": (16, 32, 48, 64, 80, 96, 128, 160),
        "herald": (32, 64, 96, 128, 160, 192, 256, 320),
        "mage": (16, 32, 64, 96, 128, 160),
        "infinigen": (16, 32, 64, 96, 128),
    },
    (LLADA, K32): {
        "dense": (8, 16, 24, 32, 40, 48, 64, 80),
        "herald": (16, 32, 48, 64, 80, 96, 112, 128, 160),
        "mage": (16, 32, 56, 80, 96),
        "infinigen": (16, 32, 48, 64, 80),
    },
    (SDAR, K16): {
        "dense": (8, 16, 24, 32, 40, 48, 64),
        "herald": (16, 32, 48, 64, 80),
        "mage": (16, 32, 48, 64),
        "infinigen": (16, 32, 48, 64),
    },
    (SDAR, K32): {
        "dense": (4, 8, 12, 16, 20, 24, 32),
        "herald": (8, 16, 24, 32, 40),
        "mage": (8, 16, 24, 32),
        "infinigen": (8, 16, 24, 32, 40, 48),
    },
}
_LIKE = {
    "herald-selected": "herald",
    "herald-int8-gpu": "herald",
    "mage-cpu-rep": "herald",
    "mage-cpu": "mage",
}


UNIFORM, MIXED = "uniform", "mixed"  # a point's contexts: Sweep.contexts, a record's "contexts"


def mixed_context_lengths(context: int, batch: int, block_size: int) -> list[int]:
    """The prompt lengths of a mixed point's ``batch`` requests: request i is
    round(i x span / (batch - 1)) blocks shorter than ``context`` (halves rounded up), span =
    context // 2 // block_size blocks. So the lengths fall evenly from ``context`` (request 0)
    to at least context / 2 (the last one), each a whole number of blocks shorter than
    ``context`` (whole blocks when ``context`` is); ``[context]`` for a batch of 1."""
    if batch == 1:
        return [context]
    span = context // 2 // block_size
    return [
        context - (2 * i * span + batch - 1) // (2 * (batch - 1)) * block_size for i in range(batch)
    ]


def record_contexts(rec: dict[str, Any]) -> str:
    """A point record's contexts: its ``"contexts"``, :data:`UNIFORM` where it has none (records
    from before ``--mixed-contexts`` existed, and uniform ones)."""
    return str(rec.get("contexts") or UNIFORM)


@dataclass(frozen=True)
class Sweep:
    """One variant on one model and context; ``batches`` empty = the peak batch of the same
    sweep at ``peak_steps`` (Fig. 14), ``peak_default`` when that sweep has no result."""

    figure: str
    model: str
    context: int
    variant: str
    budget: float | None
    gpu_cap_gb: float | None
    steps: int
    batches: tuple[int, ...]
    peak_default: int | None = None
    peak_steps: int = 20
    reuse_cap_gb: float | None = None
    """Uncapped offloading sweeps: reuse the sweep at this cap when none of its points ran out of
    GPU memory (the cap then changed nothing: offloading batches are bounded by DRAM)."""
    contexts: str = UNIFORM
    """:data:`UNIFORM`: every request at ``context``; :data:`MIXED`: request i at its own
    context (:func:`mixed_context_lengths`), the longest ``context`` (``--mixed-contexts``)."""

    @property
    def key(self) -> tuple[Any, ...]:
        return sweep_key(
            self.model, self.context, self.variant, self.budget, self.gpu_cap_gb, self.steps,
            self.contexts,
        )  # fmt: skip

    @property
    def label(self) -> str:
        cap = f"{self.gpu_cap_gb:g} GB" if self.gpu_cap_gb else "no cap"
        bud = f" {self.budget:.1%}" if self.budget else ""
        ctx = ctx_label(self.context)
        mixed = " mixed contexts" if self.contexts == MIXED else ""
        return f"{model_name(self.model)} {ctx} {self.variant}{bud} {cap} T={self.steps}{mixed}"

    def reference(self, steps: int | None = None, cap: float | None | str = "same") -> Sweep:
        """The same sweep at another T or cap (batches as in the plan are not compared)."""
        return replace(
            self,
            steps=self.steps if steps is None else steps,
            gpu_cap_gb=self.gpu_cap_gb if cap == "same" else cap,  # type: ignore[arg-type]
        )


def ctx_label(ctx: int) -> str:
    """16384 -> "16K"; contexts that are not whole K stay in tokens."""
    return f"{ctx // 1024}K" if ctx >= 1024 and ctx % 1024 == 0 else str(ctx)


def model_name(model: str) -> str:
    """A preset's name, or a checkpoint directory's last component."""
    return Path(model).name or model


def sweep_key(
    model: str,
    context: int,
    variant: str,
    budget: float | None,
    cap: float | None,
    steps: int,
    contexts: str = UNIFORM,
) -> tuple[Any, ...]:
    return (
        model,
        int(context),
        variant,
        None if budget is None else round(float(budget), 6),
        None if cap is None else float(cap),
        int(steps),
        contexts,
    )


def record_sweep_key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return sweep_key(
        rec["model"], rec["context"], rec["variant"], rec["budget"], rec["gpu_cap_gb"],
        rec["steps"], record_contexts(rec),
    )  # fmt: skip


def default_batches_help() -> str:
    """Which models and contexts have a default batch list (:data:`BATCHES`), for the help and
    the refusal: "llada2-mini or sdar-8b-chat at 16384 or 32768 tokens"."""
    models = " or ".join(dict.fromkeys(m for m, _ in BATCHES))
    contexts = " or ".join(str(c) for c in sorted({c for _, c in BATCHES}))
    return f"{models} at {contexts} tokens"


def batches_for(model: str, context: int, variant: str) -> tuple[int, ...]:
    table = BATCHES.get((model, context))
    if table is None:
        raise ValueError(
            f"no default batch list for {model} at {context} (only {default_batches_help()} "
            "have one); give --batches"
        )
    return table[_LIKE.get(variant, variant)]


def _table2(model: str, context: int, cap: float | None) -> list[Sweep]:
    out = []
    for v in TABLE2_VARIANTS:
        var = VARIANTS[v]
        reuse = CAP_H100 if (cap is None and var.offload) else None
        out.append(
            Sweep("table2", model, context, v, var.default_budget, cap, 20,
                  batches_for(model, context, v), reuse_cap_gb=reuse)
        )  # fmt: skip
    return out


def _fig13(context: int) -> list[Sweep]:
    # The paper's ablation runs every rung at 5% (Fig. 13 caption).
    return [
        Sweep("fig13", LLADA, context, v, 0.05, CAP_H100, 20, batches_for(LLADA, context, v))
        for v in FIG13_RUNGS
    ]


def _fig14(context: int) -> list[Sweep]:
    return [
        Sweep("fig14", LLADA, context, v, VARIANTS[v].default_budget, CAP_H100, t, (),
              peak_default=FIG14_DEFAULT_BATCH[(context, v)])
        for v in ("dense", "herald")
        for t in FIG14_STEPS
    ]  # fmt: skip


def build_plan(name: str) -> list[Sweep]:
    """The named plan's sweeps in run order (merged, see the module docstring).

    ``all``: per model (LLaDA2.0-mini, then SDAR-8B-Chat), Table II at the 80 GB cap (both
    contexts), Fig. 13 and Fig. 14 (LLaDA2.0-mini; Fig. 14 needs Table II's peaks first), then
    Table II on the whole GPU. ``smoke``: LLaDA2.0-mini at
    16K, dense and HERALD, two batch sizes each, one timed block (a harness check).
    """
    plans = {
        "table2": lambda: [
            s for cap in (CAP_H100, None) for m in (LLADA, SDAR) for c in (K16, K32)
            for s in _table2(m, c, cap)
        ],
        "fig13": lambda: _fig13(K16) + _fig13(K32),
        "fig14": lambda: _fig14(K16) + _fig14(K32),
        "smoke": lambda: [
            Sweep("smoke", LLADA, K16, "dense", None, CAP_H100, 20, (16, 32)),
            Sweep("smoke", LLADA, K16, "herald", 0.05, CAP_H100, 20, (32, 64)),
        ],
    }  # fmt: skip
    if name == "all":
        # grouped by model (one model build per run part); Fig. 13 / 14 after Table II's sweeps
        sweeps = [
            *(s for c in (K16, K32) for s in _table2(LLADA, c, CAP_H100)),
            *_fig13(K16),
            *_fig13(K32),
            *_fig14(K16),
            *_fig14(K32),
            *(s for c in (K16, K32) for s in _table2(LLADA, c, None)),
            *(s for cap in (CAP_H100, None) for c in (K16, K32) for s in _table2(SDAR, c, cap)),
        ]
    elif name in plans:
        sweeps = plans[name]()
    else:
        raise ValueError(f"unknown plan {name!r}; one of {sorted([*plans, 'all'])}")
    return merge(sweeps)


def merge(sweeps: list[Sweep]) -> list[Sweep]:
    """One sweep per key, at its first position; explicit batch lists are united, and a peak
    sweep (no batches) whose key another sweep measures is dropped: its point is that sweep's."""
    out: dict[tuple[Any, ...], Sweep] = {}
    for s in sweeps:
        prev = out.get(s.key)
        if prev is None or not prev.batches:
            out[s.key] = s if prev is None or s.batches else prev
        elif s.batches:
            out[s.key] = replace(prev, batches=tuple(sorted({*prev.batches, *s.batches})))
    return list(out.values())


def filter_sweeps(
    sweeps: list[Sweep],
    models: list[str] | None = None,
    contexts: list[int] | None = None,
    variants: list[str] | None = None,
    caps: list[float | None] | None = None,
    figures: list[str] | None = None,
) -> list[Sweep]:
    return [
        s
        for s in sweeps
        if (not models or s.model in models or model_name(s.model) in models)
        and (not contexts or s.context in contexts)
        and (not variants or s.variant in variants)
        and (caps is None or s.gpu_cap_gb in caps)
        and (not figures or s.figure in figures)
    ]


def split_parts(sweeps: list[Sweep], part: int, num_parts: int) -> list[Sweep]:
    """Part ``part`` (1-based) of ``num_parts`` contiguous groups of whole sweeps with about
    the same number of points each (a peak sweep counts as one point). Stable: it depends on
    the plan only, not on what was measured already."""
    if not 1 <= part <= num_parts:
        raise ValueError(f"--part {part}/{num_parts}: need 1 <= i <= n")
    weights = [max(1, len(s.batches)) for s in sweeps]
    total = sum(weights)
    out, acc = [], 0
    for s, w in zip(sweeps, weights, strict=True):
        # a sweep belongs to the part in which its first point falls
        if acc * num_parts // total == part - 1:
            out.append(s)
        acc += w
    return out


def parse_part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part wants i/n (e.g. 2/5), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--part {text}: need 1 <= i <= n")
    return i, n
