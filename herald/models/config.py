"""ModelConfig: one normalised, frozen description of a block dLLM, built from an HF config.json.

Sources: docs/MODELS.md §3 (SDAR-8B-Chat) and §5 (LLaDA2.0-mini). Keys that the two
architectures spell differently are mapped here once, so nothing downstream reads raw HF keys.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SDAR_ARCH = "SDARForCausalLM"
LLADA2_ARCH = "LLaDA2MoeModelLM"
SUPPORTED_ARCHITECTURES = (SDAR_ARCH, LLADA2_ARCH)

# Per-architecture defaults for keys that the real HF config.json files may lack (docs/MODELS.md
# §3, §5): the mask token, the inference block size and the stop ids.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    SDAR_ARCH: {"mask_token_id": 151669, "block_size": 4, "eos_token_ids": (151645, 151643)},
    LLADA2_ARCH: {"mask_token_id": 156895, "block_size": 32, "eos_token_ids": (156892,)},
}


class ConfigError(ValueError):
    """A config.json that herald cannot serve (unknown architecture, missing key, bad value)."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters plus the block-diffusion runtime ids.

    All sizes are counts (not bytes). ``rotary_dim`` is the number of leading head dims RoPE rotates
    (128 = full for SDAR, 64 = partial for LLaDA2).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Block-diffusion runtime ids.
    mask_token_id: int = 0
    block_size: int = 32
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # MoE (LLaDA2 only; zero / defaults for dense models).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # The raw config.json, kept so a checkpoint can be written back unchanged.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        """G: query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K plus V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """Normalise an HF ``config.json`` dict.

        ``mask_token_id`` / ``block_size`` come from the dict when present, else from
        :data:`ARCH_DEFAULTS`; ``overrides`` win over both.

        Raises:
            ConfigError: unknown ``architectures[0]`` (the message lists the supported ones), or a
                required key is missing.
        """
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r} in config.json; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )

        def req(key: str) -> Any:
            if key not in hf:
                raise ConfigError(f"config.json for {arch} is missing required key {key!r}")
            return hf[key]

        defaults = ARCH_DEFAULTS[arch]
        try:
            return ModelConfig._from_hf(hf, arch, defaults, req, overrides)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json for {arch} has a bad value: {e}") from None

    @staticmethod
    def _from_hf(
        hf: dict[str, Any], arch: str, defaults: dict[str, Any], req: Any, overrides: dict[str, Any]
    ) -> ModelConfig:
        num_heads = int(req("num_attention_heads"))
        hidden = int(req("hidden_size"))
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        if arch == LLADA2_ARCH:
            rotary_dim = int(
                hf.get("rotary_dim") or head_dim * float(hf.get("partial_rotary_factor", 1.0))
            )
        else:
            rotary_dim = head_dim
        eos = hf.get("eos_token_ids", defaults["eos_token_ids"])
        kw: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            num_layers=int(req("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(req("intermediate_size")),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rotary_dim=rotary_dim,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            mask_token_id=int(hf.get("mask_token_id", defaults["mask_token_id"])),
            block_size=int(hf.get("block_size", defaults["block_size"])),
            eos_token_ids=tuple(int(e) for e in eos),
            pad_token_id=hf.get("pad_token_id"),
            hf_config=dict(hf),
        )
        if arch == LLADA2_ARCH:
            kw.update(
                num_experts=int(req("num_experts")),
                num_experts_per_tok=int(req("num_experts_per_tok")),
                moe_intermediate_size=int(req("moe_intermediate_size")),
                num_shared_experts=int(hf.get("num_shared_experts", 0)),
                first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
                n_group=int(hf.get("n_group", 1)),
                topk_group=int(hf.get("topk_group", 1)),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            )
        kw.update(overrides)
        for key in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
        ):
            if not isinstance(kw[key], int) or kw[key] <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {kw[key]!r}")
        cfg = ModelConfig(**kw)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={cfg.num_heads} is not a multiple of "
                f"num_key_value_heads={cfg.num_kv_heads}"
            )
        return cfg

    @staticmethod
    def from_file(path: str | Path, **overrides: Any) -> ModelConfig:
        """Read ``config.json`` (a file or the checkpoint directory holding it).

        Raises:
            FileNotFoundError: no config.json at ``path``.
            ConfigError: see :meth:`from_hf`.
        """
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        try:
            hf = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{p} must hold a JSON object, got {type(hf).__name__}")
        try:
            return ModelConfig.from_hf(hf, **overrides)
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
