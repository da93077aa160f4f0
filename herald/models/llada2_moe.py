"""LLaDA2 (``LLaDA2MoeModelLM``): the BailingMoeV2-style MoE block dLLM (docs/MODELS.md §5-§6).

Layer math is :mod:`herald.models.common`: fused ``query_key_value`` ([Q | K | V] slabs,
docs/MODELS.md §5), ``query_layernorm``/``key_layernorm`` before partial RoPE (the first
``rotary_dim`` = 64 of 128 head dims), ``dense`` out projection. Layers ``< first_k_dense_replace``
(layer 0) have a dense SwiGLU MLP of ``intermediate_size``; the others a :class:`SparseMoE`
(sigmoid router with ``expert_bias``, group-limited top-k, shared expert).

Checkpoint names (docs/MODELS.md §5) are per expert (``mlp.experts.E.gate_proj.weight`` ...); they
load into the stacked ``experts_gate_up`` [E, 2I, H] / ``experts_down`` [E, H, I] parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from herald.layers.mlp import SwiGLUMLP
from herald.layers.moe import SparseMoE
from herald.models.common import DecoderLM, Device, attention_specs, swiglu_specs
from herald.models.config import LLADA2_ARCH, ModelConfig
from herald.models.weights import WeightSpec


class LLaDA2MoeModelLM(DecoderLM):
    """LLaDA2.0-mini and its tiny variants; see :class:`DecoderLM` for the interface."""

    architecture = LLADA2_ARCH

    def make_mlp(self, layer_id: int, *, dtype: torch.dtype | None, device: Device) -> nn.Module:
        cfg = self.config
        if layer_id < cfg.first_k_dense_replace:
            return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)
        return SparseMoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            num_shared_experts=cfg.num_shared_experts,
            dtype=dtype,
            device=device,
        )

    @classmethod
    def weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """HF names and shapes (docs/MODELS.md §5), e.g.
        ``model.layers.N.mlp.experts.E.up_proj.weight``."""
        h, v = config.hidden_size, config.vocab_size
        inter, n_exp = config.moe_intermediate_size, config.num_experts
        specs = [WeightSpec("model.word_embeddings.weight", (v, h), "embed_tokens.weight")]
        for i in range(config.num_layers):
            p, t = f"model.layers.{i}.", f"layers.{i}."
            specs += attention_specs(
                config,
                i,
                p,
                (
                    "input_layernorm.weight",
                    "attention.query_key_value.weight",
                    "attention.query_layernorm.weight",
                    "attention.key_layernorm.weight",
                    "attention.dense.weight",
                    "post_attention_layernorm.weight",
                ),
            )
            if i < config.first_k_dense_replace:
                specs += swiglu_specs(p + "mlp.", t + "mlp.", h, config.intermediate_size)
                continue
            specs += [
                WeightSpec(p + "mlp.gate.weight", (n_exp, h), t + "mlp.gate.weight"),
                WeightSpec(
                    p + "mlp.gate.expert_bias",
                    (n_exp,),
                    t + "mlp.gate.expert_bias",
                    init="bias",
                    file_dtype=torch.float32,
                ),
            ]
            gate_up, down = t + "mlp.experts_gate_up", t + "mlp.experts_down"
            for e in range(n_exp):
                pe = f"{p}mlp.experts.{e}."
                specs += [
                    WeightSpec(pe + "gate_proj.weight", (inter, h), gate_up, (e, slice(0, inter))),
                    WeightSpec(
                        pe + "up_proj.weight", (inter, h), gate_up, (e, slice(inter, 2 * inter))
                    ),
                    WeightSpec(pe + "down_proj.weight", (h, inter), down, (e,)),
                ]
            if config.num_shared_experts > 0:
                shared = inter * config.num_shared_experts
                specs += swiglu_specs(
                    p + "mlp.shared_experts.", t + "mlp.shared_experts.", h, shared
                )
        specs.append(WeightSpec("model.norm.weight", (h,), "norm.weight", init="ones"))
        if not config.tie_word_embeddings:
            specs.append(WeightSpec("lm_head.weight", (v, h), "lm_head.weight"))
        return specs
