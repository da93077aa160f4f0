"""SDAR (``SDARForCausalLM``): the Qwen3-style dense block dLLM (docs/MODELS.md §3-§4).

Layer math is :mod:`herald.models.common` with a SwiGLU MLP in every layer, full RoPE over
``head_dim``, untied LM head. Checkpoint names are Qwen3's, 1:1 (docs/MODELS.md §4, 11 tensors per
layer plus 3: 399 for SDAR-8B-Chat); ``q_proj``/``k_proj``/``v_proj`` load into the fused
``qkv_proj`` and ``gate_proj``/``up_proj`` into the fused ``gate_up_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.layers.mlp import SwiGLUMLP
from herald.models.common import DecoderLM, Device, attention_specs, swiglu_specs
from herald.models.config import SDAR_ARCH, ModelConfig
from herald.models.weights import WeightSpec


class SDARForCausalLM(DecoderLM):
    """SDAR-8B-Chat and its tiny variants; see :class:`DecoderLM` for the interface."""

    architecture = SDAR_ARCH

    def make_mlp(self, layer_id: int, *, dtype: torch.dtype | None, device: Device) -> nn.Module:
        cfg = self.config
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)

    @classmethod
    def weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """HF names and shapes (docs/MODELS.md §4), e.g.
        ``model.layers.N.self_attn.q_proj.weight``."""
        h, v = config.hidden_size, config.vocab_size
        specs = [WeightSpec("model.embed_tokens.weight", (v, h), "embed_tokens.weight")]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            specs += attention_specs(
                config,
                i,
                p,
                (
                    "input_layernorm.weight",
                    "self_attn.{}_proj.weight",
                    "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight",
                    "self_attn.o_proj.weight",
                    "post_attention_layernorm.weight",
                ),
            )
            specs += swiglu_specs(p + "mlp.", f"layers.{i}.mlp.", h, config.intermediate_size)
        specs.append(WeightSpec("model.norm.weight", (h,), "norm.weight", init="ones"))
        if not config.tie_word_embeddings:
            specs.append(WeightSpec("lm_head.weight", (v, h), "lm_head.weight"))
        return specs
