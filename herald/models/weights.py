"""Checkpoint tensor <-> model tensor mapping, and spec-driven random initialisation.

Each architecture lists its HF checkpoint tensors as :class:`WeightSpec` rows (docs/MODELS.md
§4, §5): the exact HF name and shape, and the in-memory tensor (a sub-view of a fused or stacked
parameter) that holds it. The loader, the random-checkpoint writer and the in-place random init all
walk the same rows, so the three can never disagree about names, shapes or layout.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

InitKind = Literal["normal", "ones", "bias"]

# Std of the random ``expert_bias`` (selection only; "small random").
EXPERT_BIAS_STD = 0.01


@dataclass(frozen=True, eq=False)
class WeightSpec:
    """One tensor of an HF checkpoint and where it lives in a herald model.

    Attributes:
        name: HF checkpoint name, e.g. ``model.layers.3.self_attn.k_proj.weight``.
        shape: its shape in the checkpoint.
        target: dotted name of the model parameter/buffer holding it.
        index: basic index into ``target`` selecting the sub-view (``()`` = the whole tensor), e.g.
            ``(slice(4096, 5120),)`` for the k rows of a fused qkv, ``(7, slice(0, 512))`` for
            expert 7's gate rows of a stacked ``[E, 2I, H]``.
        init: random init kind: ``normal`` (std = initializer_range), ``ones`` (norm weights),
            ``bias`` (``expert_bias``: normal with :data:`EXPERT_BIAS_STD`).
        file_dtype: dtype forced when writing a checkpoint (``expert_bias`` is float32), else None
            (the writer's dtype).
    """

    name: str
    shape: tuple[int, ...]
    target: str
    index: tuple[int | slice, ...] = ()
    init: InitKind = "normal"
    file_dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def get_target(model: nn.Module, spec: WeightSpec) -> torch.Tensor:
    """The model tensor view that holds ``spec`` (writes through to the parameter/buffer)."""
    module_name, _, attr = spec.target.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    tensor = getattr(module, attr)
    if not isinstance(tensor, torch.Tensor):
        raise AttributeError(f"{spec.target} is not a tensor of {type(model).__name__}")
    return tensor[spec.index] if spec.index else tensor


def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor RNG seed: independent of tensor order, shard layout and device."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_tensor(
    spec: WeightSpec,
    *,
    seed: int,
    std: float,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A fresh random tensor for ``spec``: drawn in float32 on ``device``, then cast to ``dtype``.

    Same (seed, name, device) -> same values, whichever path (file writer or in-place init) asks.
    """
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, spec.name))
    t = torch.empty(spec.shape, dtype=torch.float32, device=device)
    t.normal_(0.0, EXPERT_BIAS_STD if spec.init == "bias" else std, generator=gen)
    return t.to(dtype)


@torch.no_grad()
def init_random_weights_(
    model: nn.Module, specs: Iterable[WeightSpec], *, seed: int = 0, std: float = 0.02
) -> None:
    """Fill every tensor named by ``specs`` in place, on the model's own device.

    Full-size models: call on a model already on the GPU (no host copies; a few seconds).
    """
    for spec in specs:
        target = get_target(model, spec)
        target.copy_(random_tensor(spec, seed=seed, std=std, device=target.device))
