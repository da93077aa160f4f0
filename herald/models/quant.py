"""Compact checkpoint storage: int8 weights with one float32 scale per output row.

Lets a larger trained model fit the repository's size budget for bundled checkpoints: every 2-D
tensor (embeddings and projections) is stored as ``int8`` with ``<name>_scale`` (float32, one per
row: ``max |row| / 127``, symmetric, round to nearest); 1-D tensors (norm weights) stay bf16. The
checkpoint's ``config.json`` says so in ``quantization_config`` (the HF key), and the loader
dequantizes to the model's dtype at load time: the model itself always computes in bf16 / float32.

Per-row int8 keeps each weight within half a step (``max |row| / 254``) of its trained value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from herald.models.config import ConfigError

QUANT_METHOD = "herald_int8_rowwise"
STORAGES = ("bf16", "int8")
SCALE_SUFFIX = "_scale"


def quantization_config() -> dict[str, Any]:
    """The ``quantization_config`` entry of an int8 checkpoint's config.json."""
    return {
        "quant_method": QUANT_METHOD,
        "bits": 8,
        "granularity": "per output row of every 2-D tensor",
        "scale_dtype": "float32",
    }


def checkpoint_storage(ckpt_dir: str | Path) -> str:
    """``"int8"`` for a checkpoint written with :data:`QUANT_METHOD`, else ``"bf16"`` (plain
    floating-point tensors of any dtype).

    Raises:
        ConfigError: config.json names another quantization method (not supported here).
    """
    cfg = Path(ckpt_dir) / "config.json"
    q = json.loads(cfg.read_text()).get("quantization_config") if cfg.is_file() else None
    if q is None:
        return "bf16"
    if not isinstance(q, dict):
        raise ConfigError(f"{cfg}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != QUANT_METHOD:
        raise ConfigError(
            f"{cfg}: quantization_config.quant_method {method!r} is not supported (herald reads "
            f"unquantized checkpoints and its own {QUANT_METHOD!r})"
        )
    if q.get("bits", 8) != 8:
        raise ConfigError(f"{cfg}: {QUANT_METHOD} stores 8 bits, config says {q.get('bits')!r}")
    return "int8"


def check_scale(name: str, scale: torch.Tensor) -> None:
    """Raise ValueError unless ``scale`` is float32 with finite, positive entries (as written by
    :func:`quantize_rowwise`): a wrong scale would load wrong weights without a sound."""
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} is {scale.dtype}, expected float32")
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ValueError(f"{name} has non-finite or non-positive entries")


def is_quantized(shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this checkpoint shape is stored as int8 (2-D tensors only)."""
    return len(shape) == 2


def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [rows, cols] (any float dtype/device) -> (int8 [rows, cols], float32 [rows]) on CPU.

    An all-zero row gets scale 1 (it dequantizes to zeros)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rowwise expects a 2-D tensor, got shape {tuple(w.shape)}")
    x = w.detach().to("cpu", torch.float32)
    amax = x.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [rows, cols] and float32 [rows] (same device) -> ``dtype`` [rows, cols]."""
    if q.dtype != torch.int8 or scale.shape != (q.shape[0],):
        raise ValueError(
            f"expected int8 [rows, cols] and a [rows] scale, got {q.dtype} {tuple(q.shape)} and "
            f"{tuple(scale.shape)}"
        )
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def stored_bytes(shapes: list[tuple[int, ...]], storage: str) -> int:
    """Bytes of the tensors of a checkpoint with these shapes in ``storage`` (headers excluded)."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    total = 0
    for shape in shapes:
        numel = math.prod(shape)
        if storage == "int8" and is_quantized(shape):
            total += numel + 4 * shape[0]
        else:
            total += 2 * numel
    return total
