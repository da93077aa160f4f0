"""Architecture name -> model class, named presets, and model construction.

Presets are HF-format ``config.json`` dicts shipped in ``herald/models/presets/``:

* ``sdar-8b-chat``, ``llada2-mini``: the real configs at full size (docs/MODELS.md §3, §5);
* ``tiny-sdar``, ``tiny-llada2``: the same structures, small enough for CPU tests (hidden 128,
  4 layers, 8 query / 2 KV heads of 32 dims, vocab 320 = 256 bytes + special tokens, block 32).

:func:`build_model` builds on the ``meta`` device and materialises on the target device without
initialising parameters, so a full-size model costs one allocation per tensor and no CPU work;
``seed=`` then fills random weights in place on that device (what the benchmarks use).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from herald.models.common import DecoderLM
from herald.models.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig
from herald.models.llada2_moe import LLaDA2MoeModelLM
from herald.models.sdar import SDARForCausalLM
from herald.models.weights import WeightSpec, init_random_weights_

PRESET_DIR = Path(__file__).parent / "presets"

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    SDARForCausalLM.architecture: SDARForCausalLM,
    LLaDA2MoeModelLM.architecture: LLaDA2MoeModelLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def list_presets() -> list[str]:
    """Names accepted by :func:`get_preset`, sorted."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_hf_config(name: str) -> dict[str, Any]:
    """The raw HF ``config.json`` dict of preset ``name``.

    Raises:
        KeyError: unknown preset; the message lists the known ones.
    """
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    cfg: dict[str, Any] = json.loads(path.read_text())
    return cfg


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name``; ``overrides`` replace fields (e.g.
    ``block_size=4``, ``max_position_embeddings=65536``).

    Raises:
        KeyError: unknown preset (the message lists the known ones).
    """
    return ModelConfig.from_hf(preset_hf_config(name), **overrides)


def model_class(architecture: str) -> type[DecoderLM]:
    """The class serving HF ``architectures[0]``.

    Raises:
        ConfigError: unsupported architecture (the message lists the supported ones).
    """
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        ) from None


def weight_specs(config: ModelConfig) -> list[WeightSpec]:
    """Every tensor of the HF checkpoint of ``config`` (names, shapes, model targets)."""
    return model_class(config.architecture).weight_specs(config)


def count_params(config: ModelConfig) -> int:
    """Parameters in the checkpoint of ``config`` (tied embeddings counted once)."""
    return sum(spec.numel for spec in weight_specs(config))


def default_device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on CUDA, float32 elsewhere (CPU bf16 matmuls are slow and less exact)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def init_std(config: ModelConfig) -> float:
    """Std of random matrices: the config's ``initializer_range`` (0.02 in the real configs)."""
    return float(config.hf_config.get("initializer_range", 0.02))


def init_random_weights(model: DecoderLM, seed: int = 0) -> None:
    """Fill ``model`` with random weights in place, on its device (spec-driven; see
    :func:`herald.models.weights.random_tensor`): normal(0, ``initializer_range``) matrices,
    ones for norms, normal(0, 0.01) ``expert_bias``. Same seed -> same weights as
    :func:`herald.models.loader.write_random_checkpoint` when generated on the same device."""
    specs = model.weight_specs(model.config)
    init_random_weights_(model, specs, seed=seed, std=init_std(model.config))


def build_model(
    config: ModelConfig,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    seed: int | None = None,
) -> DecoderLM:
    """Build an inference-mode model (``eval()``, no grads) for ``config`` on ``device``.

    Args:
        config: the model config (see :func:`get_preset`, :meth:`ModelConfig.from_file`).
        device: target device; default :func:`default_device`. ``"meta"`` builds shapes only.
        dtype: parameter dtype; default :func:`default_dtype` (``expert_bias`` stays float32).
        seed: when given, random weights (:func:`init_random_weights`); when None the parameters
            are *uninitialised* memory, to be filled by the loader.

    Raises:
        ConfigError: unsupported architecture.
    """
    dev = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(dev)
    model = model_class(config.architecture)(config, dtype=dtype, device="meta")
    if dev.type != "meta":
        model = model.to_empty(device=dev)
        model.tie_weights()
        model.reset_buffers()
    model.requires_grad_(False)
    model.eval()
    if seed is not None and dev.type != "meta":
        init_random_weights(model, seed)
    return model
