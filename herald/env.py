"""Every ``HERALD_*`` environment switch, parsed once, in one place.

The switches are for measuring and debugging; a serving process reads them once at start-up.
:func:`settings` parses the environment on first use and caches the result; code that changes a
variable at run time (tests, the kernel benchmark's sweeps) calls :func:`reload_settings`.
A bad value raises ``ValueError`` naming the variable, at the first :func:`settings` call.

=============================  ==================================================================
variable                       meaning
=============================  ==================================================================
``HERALD_SELECTION_BACKEND``   ``auto`` (native kernel, else PyTorch with a warning), ``native``
                               (error if the library is unavailable) or ``torch``
``HERALD_SELECTION_ISA``       ``auto`` | ``avx512`` (bf16 widened to fp32 FMA) | ``avx512bf16``
                               (``vdpbf16ps``) | ``portable``; ``auto`` is ``avx512``: on Sapphire
                               and Emerald Rapids ``vdpbf16ps`` has half the multiply-add rate
``HERALD_SELECTION_THREADS``   CPU selection kernel threads (default: every usable core,
                               :func:`selection_threads`)
``HERALD_SELECTION_SCHEDULE``  ``auto`` | ``items`` | ``tiles``: how the kernel splits its work
``HERALD_SELECTION_PREFETCH``  ``none`` | ``t0:N`` | ``t1:N`` | ``nta:N``: software prefetch hint
                               and distance in pages (default ``t0:1``)
``HERALD_SELECTION_LIB``       path of a prebuilt selection library (debugging)
``HERALD_CACHE_DIR``           where the selection library is built on first use
                               (default ``$XDG_CACHE_HOME/herald``, else ``~/.cache/herald``)
``HERALD_SDPA_BACKENDS``       comma-separated SDPA kernels allowed on CUDA (``cudnn``, ``flash``,
                               ``efficient``, ``math``); unset: PyTorch's own pick
``HERALD_COMPILE``             ``1`` (default; or true/yes/on): the fused elementwise kernels
                               run under ``torch.compile``; ``0`` (or false/no/off): eager
``HERALD_API_KEY``             the key ``herald serve`` requires as ``Authorization: Bearer KEY``
                               (``--api-key`` wins); unset or empty: no key
``HERALD_TRITON``              herald's Triton kernels: ``auto`` (default: the block attention on
                               small stores, i.e. the sparse pools, the fused MoE router and the
                               RMSNorm of bf16/fp16 models, and the GPU fetch of HERALD_FETCH),
                               ``all`` (also the fused MoE experts, the dense cache, prefill
                               chunks, and the router and RMSNorm of float32 models) or ``0``
                               (none: PyTorch routing and norms, grouped-GEMM MoE and SDPA)
``HERALD_PREFILL_ATTENTION``   the attention of prefill chunks of several whole blocks on CUDA
                               (a one-block chunk follows the denoising steps'): ``triton``
                               (herald's block-causal kernel, one compilation for every chunk
                               length, where ``HERALD_TRITON`` is not ``0``), ``sdpa`` (PyTorch's
                               SDPA with a per-query mask over K/V expanded to the query heads)
                               or ``auto`` (default: ``triton``, measured 1.7-2.5x faster than
                               ``sdpa`` at 4K-32K prompts on an H100; ``sdpa`` under
                               ``HERALD_TRITON=0`` or without Triton)
``HERALD_ALLOW_LONG_CONTEXT``  ``1`` (or true/yes/on; 0/false/no/off/unset: off): ``herald
                               serve --max-seq-len`` may exceed the model's
                               ``max_position_embeddings`` (RoPE extrapolates; with a warning),
                               as vLLM's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``; else it is capped there
``HERALD_HUGE_PAGES``          ``1`` asks Linux for 2 MiB pages under the CPU KV pool
                               (``madvise(MADV_HUGEPAGE)``, where transparent huge pages are
                               enabled); ``0`` (default) for 4 KiB pages (``MADV_NOHUGEPAGE``:
                               the selection kernel measured faster on them,
                               :mod:`herald.kv.hugepages`)
``HERALD_FETCH``               how HERALD's retrieval stream brings the selected K/V rows to the
                               GPU: ``gpu`` (a GPU kernel reads them from the page-locked CPU
                               pool, the CPU only selects; needs CUDA and Triton,
                               :mod:`herald.offload.gpu_fetch`), ``cpu`` (the selection kernel
                               copies them into pinned staging, then a host-to-device copy) or
                               ``auto`` (default: ``gpu`` on CUDA where ``HERALD_TRITON`` allows
                               herald's Triton kernels, measured faster; else ``cpu``)
``HERALD_RETRIEVAL_GROUPS``    a positive integer, or ``auto`` (default: 1): the request groups
                               HERALD's retrieval job is pipelined over (while the GPU runs one
                               group's layer output and next query, the CPU kernel selects for
                               another; :class:`herald.offload.retrieval.RetrievalWorker`); an
                               ``OffloadConfig.retrieval_groups`` set in code wins
``HERALD_CPU_MATMUL``          the model's bf16/fp16 weight matmuls on the CPU: ``auto``
                               (default: float32 where the CPU lacks bf16 matmul instructions,
                               i.e. AVX-512 BF16 or AMX-BF16, measured 3-6x faster there; else
                               the input dtype), ``native`` (always the input dtype) or ``fp32``
                               (always upcast, multiply in float32, round back;
                               :mod:`herald.layers.linear`)
=============================  ==================================================================
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

SELECTION_BACKENDS = ("auto", "native", "torch")
SELECTION_ISAS = ("auto", "avx512", "portable", "avx512bf16")
SELECTION_SCHEDULES = ("auto", "items", "tiles")
PREFETCH_HINTS = ("none", "t0", "t1", "nta")
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
TRITON_CHOICES = ("auto", "all", "0")
FETCH_CHOICES = ("auto", "cpu", "gpu")
PREFILL_ATTENTION_CHOICES = ("auto", "triton", "sdpa")
CPU_MATMUL_CHOICES = ("auto", "native", "fp32")
DEFAULT_PREFETCH = "t0:1"


@dataclass(frozen=True)
class Settings:
    """The parsed switches (see the module docstring for each)."""

    selection_backend: str = "auto"
    selection_isa: str = "auto"
    selection_threads: int | None = None
    selection_schedule: str = "auto"
    prefetch: str = DEFAULT_PREFETCH
    prefetch_hint: str = "t0"
    prefetch_distance: int = 1
    selection_lib: str | None = None
    cache_dir: str | None = None
    sdpa_backends: tuple[str, ...] | None = None
    compile: bool = True
    api_key: str | None = field(default=None, repr=False)
    triton: str = "auto"
    prefill_attention: str = "auto"
    allow_long_context: bool = False
    huge_pages: bool = False
    fetch: str = "auto"
    retrieval_groups: int | None = None  # None: auto
    cpu_matmul: str = "auto"


def _choice(env: dict[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; expected one of {', '.join(allowed)}")
    return value


def _flag(env: dict[str, str], name: str, default: bool = False) -> bool:
    """A boolean switch: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any
    case), ``default`` when unset or empty; anything else is an error."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}; expected 1/true/yes/on or 0/false/no/off")


def _threads(env: dict[str, str]) -> int | None:
    raw = env.get("HERALD_SELECTION_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"HERALD_SELECTION_THREADS={raw!r}; expected a positive integer")
    return int(raw)


def _groups(env: dict[str, str]) -> int | None:
    raw = env.get("HERALD_RETRIEVAL_GROUPS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"HERALD_RETRIEVAL_GROUPS={raw!r}; expected auto or a positive integer")
    return int(raw)


def _prefetch(env: dict[str, str]) -> tuple[str, str, int]:
    spec = env.get("HERALD_SELECTION_PREFETCH", "").strip().lower() or DEFAULT_PREFETCH
    hint, _, dist = spec.partition(":")
    if hint not in PREFETCH_HINTS or (dist and not dist.isdigit()):
        raise ValueError(f"HERALD_SELECTION_PREFETCH={spec!r}; expected none or t0|t1|nta:PAGES")
    return spec, hint, max(1, int(dist or 1))


def _sdpa(env: dict[str, str]) -> tuple[str, ...] | None:
    spec = env.get("HERALD_SDPA_BACKENDS", "")
    if not spec.strip():
        return None
    names = tuple(x.strip() for x in spec.split(",") if x.strip())
    if not names or any(x not in SDPA_BACKENDS for x in names):
        raise ValueError(
            f"HERALD_SDPA_BACKENDS={spec!r}: a comma-separated list of {', '.join(SDPA_BACKENDS)}"
        )
    return names


def parse(env: dict[str, str]) -> Settings:
    """:class:`Settings` from a mapping like ``os.environ``. Raises ValueError on a bad value."""
    spec, hint, dist = _prefetch(env)
    return Settings(
        selection_backend=_choice(env, "HERALD_SELECTION_BACKEND", SELECTION_BACKENDS, "auto"),
        selection_isa=_choice(env, "HERALD_SELECTION_ISA", SELECTION_ISAS, "auto"),
        selection_threads=_threads(env),
        selection_schedule=_choice(env, "HERALD_SELECTION_SCHEDULE", SELECTION_SCHEDULES, "auto"),
        prefetch=spec,
        prefetch_hint=hint,
        prefetch_distance=dist,
        selection_lib=env.get("HERALD_SELECTION_LIB") or None,
        cache_dir=env.get("HERALD_CACHE_DIR") or None,
        sdpa_backends=_sdpa(env),
        compile=_flag(env, "HERALD_COMPILE", default=True),
        api_key=env.get("HERALD_API_KEY") or None,
        triton=_choice(env, "HERALD_TRITON", TRITON_CHOICES, "auto"),
        prefill_attention=_choice(
            env, "HERALD_PREFILL_ATTENTION", PREFILL_ATTENTION_CHOICES, "auto"
        ),
        allow_long_context=_flag(env, "HERALD_ALLOW_LONG_CONTEXT"),
        huge_pages=_flag(env, "HERALD_HUGE_PAGES"),
        fetch=_choice(env, "HERALD_FETCH", FETCH_CHOICES, "auto"),
        retrieval_groups=_groups(env),
        cpu_matmul=_choice(env, "HERALD_CPU_MATMUL", CPU_MATMUL_CHOICES, "auto"),
    )


@functools.cache
def settings() -> Settings:
    """The switches of this process, parsed from ``os.environ`` on the first call."""
    return parse(dict(os.environ))


def reload_settings() -> Settings:
    """Parse the environment again (after a variable was changed at run time)."""
    settings.cache_clear()
    return settings()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def selection_threads(requested: int | None = None) -> int:
    """The one rule for the CPU selection kernel's thread count: ``requested``; else
    ``HERALD_SELECTION_THREADS``; else every usable core (:func:`usable_cpus`).

    Every core: the kernel streams the CPU pool from DRAM and each thread adds read bandwidth
    (on a 16-core H200 host 16 threads select ~10% faster than 14). The threads that share the
    cores with it (the engine thread's kernel launches, the retrieval thread's Python) are short
    bursts between waits; a host that must keep cores free sets ``HERALD_SELECTION_THREADS``.

    Raises ValueError when ``requested`` is not a positive int.
    """
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ValueError(f"num_threads must be a positive int, got {requested!r}")
        return requested
    env = settings().selection_threads
    if env is not None:
        return env
    return usable_cpus()


@contextlib.contextmanager
def overridden(values: dict[str, str]) -> Iterator[Settings]:
    """Set environment variables for the duration of a ``with`` block and parse them (tests,
    benchmark sweeps over the switches); the old values and settings come back after it."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield reload_settings()
    finally:
        for key, val in old.items():
            if val is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = val
        reload_settings()
