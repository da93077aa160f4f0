"""Where a forward's time goes: torch.profiler over a few forwards, kernels grouped by category.

On CUDA every device activity (kernel, memcpy, memset) of the profiled forwards counts with its
duration, CUDA-graph replays included; on the CPU, where there are no kernels, every operator's
self time does. Names are put into :data:`CATEGORIES` by :func:`categorize`: rules on the kernel
name, which cannot see which module launched a kernel (a graph replay keeps no call stack), so a
few kernels land in a neighbouring category (a float32-output router GEMM may read as a dense
GEMM); the top kernels, recorded by name, are there to check the grouping.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

CATEGORIES = (
    "attention",
    "expert GEMMs",
    "router/top-k",
    "dense GEMMs",
    "norms/rope/elementwise",
    "copies",
    "other",
)
"""The breakdown's categories, in the order they are printed."""

# herald's own Triton kernels, by their exact names
_OWN = {
    "block_attention": "attention",
    "gate_up_swiglu": "expert GEMMs",
    "down": "expert GEMMs",
}
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(pattern, re.IGNORECASE))
    for cat, pattern in (
        ("attention", r"attention|attn|fmha|flash|sdpa|softmax"),
        ("expert GEMMs", r"group(ed)?_?(mm|gemm)|groupproblemshape|grouped"),
        ("router/top-k", r"topk|top_k|sort|radix|bitonic|sigmoid|scatter|searchsorted|histc"),
        ("dense GEMMs", r"gemm|nvjet|cutlass|xmma|cublas|matmul|aten::(mm|addmm|bmm|linear)$"),
        ("copies", r"memcpy|memset|copy|\bcat\b|catarray|index|gather|fill|clone|contiguous"),
        (
            "norms/rope/elementwise",
            r"norm|rms|rope|rotary|elementwise|vectorized|reduce|silu|swiglu|^triton_|"
            r"aten::(mul|add|sub|div|neg|rsqrt|pow|mean|sum|exp|where|to|_to_copy)",
        ),
    )
)
_INDUCTOR = re.compile(r"^triton_(poi|red|per|tem)_")


def categorize(name: str) -> str:
    """The category of a kernel (CUDA) or operator (CPU) name."""
    if name in _OWN:
        return _OWN[name]
    if _INDUCTOR.match(name):
        # fused element-wise kernels are named after the ops they fuse
        if re.search(r"topk|sort|sigmoid", name):
            return "router/top-k"
        return "norms/rope/elementwise"
    for cat, rule in _RULES:
        if rule.search(name):
            return cat
    return "other"


def _device_events(prof: Any, cuda: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every timed activity: device activities on CUDA (user annotation
    ranges left out: they span kernels already counted), operator self times on the CPU."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        if cuda:
            if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
                continue
            out.append((evt.name, float(evt.time_range.elapsed_us())))
        elif evt.device_type == DeviceType.CPU and not evt.name.startswith("ProfilerStep"):
            out.append((evt.name, float(evt.self_cpu_time_total)))
    return out


def summarize(events: list[tuple[str, float]], forwards: int, top: int = 15) -> dict[str, Any]:
    """Per-forward milliseconds by category and for the ``top`` names, from (name, us) pairs of
    ``forwards`` forwards."""
    cats = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, list[float]] = {}
    for name, us in events:
        cats[categorize(name)] += us
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    total = sum(cats.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "forwards": forwards,
        "kernel_ms": total / forwards / 1e3,
        "categories_ms": {k: v / forwards / 1e3 for k, v in cats.items()},
        "top": [
            {
                "name": name[:160],
                "category": categorize(name),
                "ms": us / forwards / 1e3,
                "calls": calls / forwards,
            }
            for name, (us, calls) in ranked
        ],
    }


def profile_forward(fn: Callable[[], object], device: torch.device, forwards: int) -> dict:
    """Profile ``forwards`` calls of ``fn`` (already warm) and summarize them."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(forwards):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    return summarize(_device_events(prof, cuda), forwards)


def expert_tbps(profile: dict[str, Any], expert_bytes: int) -> float | None:
    """TB/s of the routed experts' weight bytes over the expert-GEMM kernels' time."""
    ms = profile["categories_ms"].get("expert GEMMs", 0.0)
    return expert_bytes / (ms * 1e-3) / 1e12 if ms > 0 and expert_bytes else None
