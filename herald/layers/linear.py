"""The model's weight matmuls, with a float32 path for bf16/fp16 on CPUs without bf16 hardware.

On a CPU without native bf16 matmul instructions (x86 without AVX-512 BF16 or AMX-BF16),
PyTorch's bf16 ``F.linear`` runs 3-6x slower than upcasting both operands to float32,
multiplying with the float32 GEMM and rounding the result (measured with PyTorch 2.13 on one
thread of an AVX2 EPYC, the upcast of the weight included: x [32, 384] by weight [1536, 384]
took 8.0 ms in bf16 and 1.6 ms upcast; [256, 384] by [1152, 384] 47 ms and 7.5 ms; [32, 384]
by [8192, 384] 42 ms and 12 ms; fp16 alike). Both accumulate in float32 and the products of
two bf16 (or fp16) numbers are exact there, so the two differ only in the order of the sum: the
rounded results agree in ~99.99% of the elements (~99.8% in fp16, which keeps more bits).

:func:`linear` takes the float32 path for a bf16/fp16 input on the CPU when
``HERALD_CPU_MATMUL`` says so: ``auto`` (default) where the CPU lacks native bf16 matmul
(:func:`native_bf16_matmul`), ``fp32`` always, ``native`` never. CUDA and float32 inputs always
run ``F.linear`` unchanged. :class:`Linear` is ``nn.Linear`` (same parameters, same state-dict
keys) with that forward.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from herald.env import settings

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""``/proc/cpuinfo`` flags of x86 CPUs with bf16 matmul instructions."""

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def cpuinfo_has_native_bf16(cpuinfo: str) -> bool:
    """Whether a ``/proc/cpuinfo`` text describes a CPU with native bf16 matmul: True when its
    ``flags`` line names one of :data:`NATIVE_BF16_FLAGS`, or when it has no ``flags`` line
    (not an x86 CPU: assume native, i.e. change nothing)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return not NATIVE_BF16_FLAGS.isdisjoint(value.split())
    return True


@functools.cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (read once from ``/proc/cpuinfo`` on
    Linux; True elsewhere or when it cannot be read)."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True
    return cpuinfo_has_native_bf16(text)


def upcasts(x: torch.Tensor) -> bool:
    """Whether :func:`linear` computes ``x``'s product in float32 (see the module docstring)."""
    if x.device.type != "cpu" or x.dtype not in _HALF_DTYPES:
        return False
    mode = settings().cpu_matmul
    if mode == "auto":
        return not native_bf16_matmul()
    return mode == "fp32"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, in float32 and rounded to ``x.dtype`` where
    :func:`upcasts` says so."""
    if not upcasts(x):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`linear` (checkpoints load unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
