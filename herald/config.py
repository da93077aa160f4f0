"""User-facing configuration: how a request decodes (:class:`SamplingParams`), how an engine is
sized and run (:class:`EngineConfig`) and how an offloading engine selects (:class:`OffloadConfig`).

Frozen dataclasses; the attribute docstrings double as CLI help (:func:`field_help`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import re
import textwrap
from dataclasses import dataclass, fields

import torch

MAX_TEMPERATURE = 100.0
"""Largest sampling temperature accepted (at 100 the distribution is already nearly uniform)."""
MIN_TEMPERATURE = 1e-4
"""Positive temperatures below this sample as this one (float32 logits / less overflow)."""
MAX_DENOISE_STEPS = 4096
"""Largest fixed-steps T accepted (a block of B positions never needs more than B)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token that ``SamplingParams.top_logprobs`` may ask for."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded (docs/ARCHITECTURE.md, "Block diffusion decoding").

    Raises ``ValueError`` from :meth:`validate` on out-of-range values.
    """

    max_new_tokens: int = 256
    """Generated tokens at most (the prompt tail inside the first block does not count)."""
    temperature: float = 0.0
    """0 = greedy argmax (deterministic); > 0 samples from softmax(logits / temperature), with
    at most ``MAX_TEMPERATURE``; values below ``MIN_TEMPERATURE`` act as it (float32 logits
    divided by less would overflow to inf)."""
    top_k: int = 0
    """Keep the k most likely tokens before sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus filter: keep the smallest prefix of tokens whose cumulative probability > top_p."""
    threshold: float = 0.95
    """Confidence-threshold acceptance: accept every masked position whose confidence is strictly
    greater than this, and at least the single most confident one. Ignored in fixed-steps mode."""
    num_denoise_steps: int | None = None
    """Fixed-steps mode (throughput runs): T denoising steps per block, accepting
    ceil(masks_left / steps_left) most-confident positions per step. None = threshold mode."""
    seed: int | None = None
    """Seed for sampling (temperature > 0), in [-2**63, 2**64) (torch.Generator's range); each
    request owns its generator, so its output does not depend on what else is in the batch.
    None: a fresh random seed per request (equal unseeded requests draw different samples)."""
    ignore_eos: bool = False
    """Keep decoding past EOS until max_new_tokens (throughput runs); ``stop_token_ids`` still
    stop."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` among the first ``min_tokens`` output tokens do not finish the
    request: they stay in the output like any other token (they are not suppressed at
    sampling). At most ``max_new_tokens``."""
    stop_token_ids: tuple[int, ...] = ()
    """More token ids that finish the request as EOS does (``finish_reason`` "stop"; the token
    itself is not in the output), also with ``ignore_eos``. A list is taken as a tuple."""
    top_logprobs: int = 0
    """Also record, for each output token, the N most likely (token id, logprob) alternatives
    at the denoising step that accepted it (``Request.output_top_logprobs``), from the same
    distribution as the token's own logprob; 0..``MAX_TOP_LOGPROBS``, 0 = off. The token's own
    logprob (``Request.output_logprobs``) is always recorded."""

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        for name in ("temperature", "top_p", "threshold"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        steps = self.num_denoise_steps
        if steps is not None and not 0 < steps <= MAX_DENOISE_STEPS:
            raise ValueError(f"num_denoise_steps must be in [1, {MAX_DENOISE_STEPS}], got {steps}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or any(type(t) is not int or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {ids!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class OffloadMode:
    """One offloading mode: the ``selection_queries`` value its policy runs on, whether it may
    select ahead on a draft (``lookahead="draft"``), and its preset switches."""

    queries: str
    drafts: bool
    preset: dict[str, object]


OFFLOAD_MODES: dict[str, OffloadMode] = {
    "herald": OffloadMode(
        "representative",
        True,
        dict(
            selection_device="cpu",
            selection_queries="representative",
            lookahead="draft",
            kv_budget=0.05,
            output_mode="selected",
        ),
    ),
    "mage": OffloadMode(
        "block",
        False,
        dict(selection_device="gpu", selection_queries="block", lookahead="off", kv_budget=0.025),
    ),
    "infinigen": OffloadMode(
        "proxy",
        False,
        dict(selection_device="gpu", selection_queries="proxy", lookahead="off", kv_budget=0.2),
    ),
}
"""The offloading modes by name (each has a policy of that name in
:data:`herald.offload.policies.POLICIES`): ``herald`` (CPU, representative query, draft
lookahead, 5%, ``selected`` kernel output), ``mage`` (block queries at step 0, no lookahead,
2.5%, GPU selection), ``infinigen`` (proxy channels at step 0, 20%). A new mode is one entry here
and one policy."""

FIRST_PASSES = ("none", "int8", "int8-gpu")
"""Values of ``OffloadConfig.first_pass``."""

MODE_OF_QUERIES = {spec.queries: name for name, spec in OFFLOAD_MODES.items()}
"""Offloading mode of each ``OffloadConfig.selection_queries`` value."""


@dataclass(frozen=True)
class OffloadConfig:
    """Switches of the offloading engine (docs/ARCHITECTURE.md, "Modes"). Presets: :meth:`for_mode`.

    The four independent ablation switches are ``selection_device``, ``selection_queries``,
    ``lookahead`` and ``kv_budget``; ``output_mode`` picks the CPU kernel's output mode.
    """

    selection_device: str = "cpu"
    """Where the selection's exact attention runs: "cpu" (next to the full KV, the CPU kernel) or
    "gpu" (the full KV of the layer crosses PCIe every block)."""
    selection_queries: str = "representative"
    """"representative": one [MASK] query at the centre of the next block (HERALD §IV-A2);
    "block": the block's B queries at its first denoising step, exact (MAGE);
    "proxy": the block's B queries on a few proxy channels of a GPU partial-key cache at its
    first step (InfiniGen, once per block)."""
    lookahead: str = "draft"
    """"draft": select block n+1 from block n's step-0 draft while block n denoises (HERALD
    §IV-A1); "off": select after block n commits (the main stream waits)."""
    kv_budget: float = 0.05
    """k = min(ceil(kv_budget x prefix), prefix - last block) selected entries per KV head per
    layer, plus the last completed block (always kept). 1.0 keeps everything."""
    output_mode: str = "full"
    """CPU kernel output: "full" (exact attention over the whole prefix: the paper's, reads K and
    V) or "selected" (attention over the selected rows and the tail, what the sparse pool then
    attends to; reads K, and V only at those rows). The herald preset uses "selected"."""
    num_dense_layers: int = 2
    """The first layers keep their full KV on the GPU and attend exactly (HERALD §IV-B1)."""
    cpu_kv_gb: float | None = None
    """CPU pool size in GiB (default: what the engine's max batch and length need)."""
    cpu_kv_tokens: int | None = None
    """CPU pool size in tokens (one of ``cpu_kv_gb`` / ``cpu_kv_tokens``; pages of B tokens)."""
    selection_threads: int | None = None
    """CPU kernel threads (default: :func:`herald.env.selection_threads`: every core this process
    may use, or ``HERALD_SELECTION_THREADS``)."""
    proxy_ratio: float = 0.25
    """InfiniGen proxy: fraction of head_dim channels kept in the partial-key cache."""
    first_pass: str = "none"
    """First pass of the CPU selection (representative query, CPU device): "none" reads every
    prefix key in bf16; "int8" also keeps an int8 copy of K in the CPU pool (+26% pool bytes at
    head_dim 128) and scans it first: certified bounds keep candidates, only those are re-read
    in bf16, and a top-k the bounds cannot certify is recomputed by the exact kernel, so the
    indices are always the exact ones. The certificate needs each query head's softmax
    normaliser, which the int8 bounds leave open: with several query heads per KV head it rarely
    holds on real KV (results/compact/README.md), so "int8" stays off until measured faster.
    "int8-gpu": the int8 copy of K lives on the GPU instead (max batch x max length x Hkv x
    (D + 4) bytes per offloaded layer) and the representative query is scored there; the CPU
    only stores the KV (the selected rows come from its pool). Approximate: the top-k of the
    int8 importances, not the exact one (:mod:`herald.offload.selection.compact_device`); needs
    ``output_mode="selected"``."""

    retrieval_groups: int | None = None
    """HERALD's retrieval job in this many request groups, pipelined: while the GPU computes
    one group's layer output and next query, the CPU kernel selects for another, so the
    kernel's threads do not wait for the GPU between layers. Each group is a contiguous range of
    rows; a row's selection is the same in any group. Default (None): ``HERALD_RETRIEVAL_GROUPS``,
    else 1. Only on CUDA can anything overlap (on the CPU the forward runs on the kernel's
    cores); 2 is the candidate default there, not yet measured on the GPU."""

    def validate(self) -> None:
        checks = {
            "selection_device": (self.selection_device, ("cpu", "gpu")),
            "selection_queries": (self.selection_queries, tuple(MODE_OF_QUERIES)),
            "lookahead": (self.lookahead, ("draft", "off")),
            "output_mode": (self.output_mode, ("full", "selected")),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if not 0.0 < self.kv_budget <= 1.0:
            raise ValueError(f"kv_budget must be in (0, 1], got {self.kv_budget}")
        if not OFFLOAD_MODES[self.mode].drafts and self.lookahead != "off":
            raise ValueError(
                f"{self.selection_queries!r} selection needs the block's own queries: it cannot "
                "run ahead on a draft (use lookahead='off')"
            )
        if not 0.0 < self.proxy_ratio <= 1.0:
            raise ValueError(f"proxy_ratio must be in (0, 1], got {self.proxy_ratio}")
        if self.cpu_kv_gb is not None and self.cpu_kv_tokens is not None:
            raise ValueError("give the CPU pool size in GiB or in tokens, not both")
        if self.num_dense_layers < 0:
            raise ValueError("num_dense_layers must be >= 0")
        if self.retrieval_groups is not None and (
            isinstance(self.retrieval_groups, bool)
            or not isinstance(self.retrieval_groups, int)
            or self.retrieval_groups < 1
        ):
            raise ValueError(
                f"retrieval_groups must be a positive int, got {self.retrieval_groups!r}"
            )
        if self.first_pass not in FIRST_PASSES:
            raise ValueError(f"first_pass must be one of {FIRST_PASSES}, got {self.first_pass!r}")
        if self.first_pass != "none" and (self.mode != "herald" or self.selection_device != "cpu"):
            raise ValueError(
                f"first_pass={self.first_pass!r} needs HERALD's representative query "
                "(selection_queries='representative', selection_device='cpu')"
            )
        if self.first_pass == "int8-gpu" and self.output_mode != "selected":
            raise ValueError("first_pass='int8-gpu' needs output_mode='selected'")

    @property
    def mode(self) -> str:
        """The selection policy these switches run (the policy registry's key):
        ``herald`` (representative query), ``mage`` (block queries) or ``infinigen`` (proxy)."""
        return MODE_OF_QUERIES[self.selection_queries]

    @staticmethod
    def for_mode(mode: str, **overrides: object) -> OffloadConfig:
        """The preset switches of ``mode`` (:data:`OFFLOAD_MODES`); overrides win."""
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"unknown offload mode {mode!r}; one of {sorted(OFFLOAD_MODES)}")
        cfg = OffloadConfig(**{**OFFLOAD_MODES[mode].preset, **overrides})  # type: ignore[arg-type]
        cfg.validate()
        return cfg


MAX_KV_PAD = 65536
"""The largest ``kv_pad`` accepted (store capacities grow with it)."""

DEFAULT_KV_PAD = 512
"""The engines' default ``kv_pad``: outputs independent of which requests share the batch, and
equal between a dense and an offloading engine at budget 1.0, on the CPU and the GPU; cuDNN also
builds one attention plan per 512 keys instead of one per block (``results/offload/kv_pad/``)."""


def check_kv_pad(kv_pad: int, name: str = "kv_pad") -> None:
    """ValueError unless ``0 <= kv_pad <=`` :data:`MAX_KV_PAD` (the CLI checks it before the
    model loads, as ``name="--kv-pad"``)."""
    if isinstance(kv_pad, bool) or not isinstance(kv_pad, int) or not 0 <= kv_pad <= MAX_KV_PAD:
        raise ValueError(f"{name} must be an integer in [0, {MAX_KV_PAD}], got {kv_pad}")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is sized and run: the same object for the dense engine, the offloading
    engine, ``herald generate``, ``herald serve`` and the benchmarks, so that what is served is
    what is measured. ``offload`` None means the dense engine. Raises ``ValueError`` from
    :meth:`validate` (called by every engine) on out-of-range values.
    """

    max_batch_size: int = 16
    """Running requests at most: the GPU KV slots (one per request)."""
    max_seq_len: int = 2048
    """Tokens per request at most (prompt + generated), rounded up to whole blocks."""
    prefill_chunk_tokens: int = 4096
    """Prompt tokens per prefill forward (rounded down to whole blocks, at least one; at most
    ``max_prefill_tokens``). Prompts are prefilled in these pieces at fixed positions
    (``[0, P), [P, 2P), ...``), whatever other prompts share a boundary, so a prompt's KV does
    not depend on its neighbours in the queue (:mod:`herald.engine.scheduler`)."""
    max_prefill_tokens: int | None = None
    """Prompt tokens prefilled per decode forward of the running batch at most (rounded down to
    whole blocks, at least one block): the dense engine admits before every forward, the
    offloading modes once per block, up to this many times the block's forwards; a longer
    prompt is prefilled in chunks over several boundaries while the running requests keep
    decoding. It also caps the prefill forward length, so a prompt's pieces, and with them its
    KV's rounding and possibly a greedy reply, change with it: replies repeat for a fixed value
    (as for a fixed dtype and device). None: every admitted prompt is prefilled whole."""
    max_waiting: int | None = None
    """Requests waiting beyond the free slots at most; more are refused (a server answers
    HTTP 503 with Retry-After). None: unbounded."""
    kv_pad: int = DEFAULT_KV_PAD
    """Round attention key lengths up to a multiple of this, masked per row (0 = off): outputs
    do not depend on which requests share the batch, and cuDNN plans once per this many keys."""
    use_cuda_graph: bool = True
    """On CUDA, replay everything but attention from piecewise CUDA graphs, captured once per
    batch size and forward length."""
    check_finite: bool = False
    """Count forwards whose hidden states hold NaN/inf (costs a reduction per forward)."""
    offload: OffloadConfig | None = None
    """The offloading engine's switches; None: the dense engine (full KV on the model device)."""

    def validate(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError(
                f"max_prefill_tokens must be >= 1 or None, got {self.max_prefill_tokens}"
            )
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 or None, got {self.max_waiting}")
        check_kv_pad(self.kv_pad)
        if self.offload is not None:
            self.offload.validate()

    @property
    def mode(self) -> str:
        """``dense`` or the offloading mode's policy name (``OffloadConfig.mode``)."""
        return "dense" if self.offload is None else self.offload.mode

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with ``changes`` applied (validated)."""
        cfg = dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        cfg.validate()
        return cfg


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_help(cls: type, name: str, default: bool = True) -> str:
    """CLI help for dataclass field ``name`` of ``cls``: its attribute docstring (reST roles
    reduced to their text), with the default appended when ``default``. KeyError: no such
    documented field."""
    text = _field_docs(cls)[name]
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("``", "").replace("%", "%%")
    if default:
        value = {f.name: f.default for f in fields(cls)}[name]
        text += f" (default: {value})"
    return text


def resolve_device(name: str | None) -> torch.device:
    """The device a ``--device`` flag names: None = ``cuda`` if a GPU is visible, else ``cpu``.

    Raises:
        ValueError: not a device, neither cpu nor cuda, or a CUDA device that is not present.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown --device {name!r}: use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported --device {name!r}: use cpu or cuda[:N]")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} given but no CUDA GPU is available (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"--device {name}: only {count} CUDA device(s) are visible")
    return dev
