"""The pre-norm decoder shared by both architectures (everything but the names and the FFN).

SDAR and LLaDA2 compute the same layer (docs/MODELS.md §1-§2):

    n = input_layernorm(x);  q, k, v = split(W_qkv n) as [Q | K | V] slabs
    q, k = q_norm(q), k_norm(k)           RMSNorm over head_dim, shared by all heads, before RoPE
    q, k = rope(q, k, positions)          full (SDAR) or the first rotary_dim dims (LLaDA2)
    h = x + o_proj(attn(q, k, v))         attention belongs to the engine's AttentionBackend
    y = h + ffn(post_attention_layernorm(h))      SwiGLU MLP or sparse MoE
    logits = lm_head(norm(y)).float()     no shift: logits at i predict the token at i

The per-architecture modules (:mod:`herald.models.sdar`, :mod:`herald.models.llada2_moe`) choose
the FFN of each layer and map the HF tensor names onto these modules (:class:`WeightSpec`).
"""

from __future__ import annotations

import torch
from torch import nn

from herald.layers.linear import Linear
from herald.layers.rmsnorm import RMSNorm
from herald.layers.rotary import RotaryEmbedding
from herald.models.base import BlockDiffusionLM, DecoderLayer
from herald.models.config import ModelConfig
from herald.models.weights import WeightSpec

Device = torch.device | str | None

# The RoPE table covers at least this many positions even when ``max_position_embeddings`` is
# smaller (the llada2-mini preset says 16384, yet the benchmarks run 32K-token prompts plus the
# generated blocks). RoPE extrapolates exactly as HF computes it; the table costs
# ``8 * rotary_dim`` bytes per position (64 MiB at 65536 x 128). Longer: ensure_max_positions().
MIN_ROPE_POSITIONS = 65536


class QKNormDecoderLayer(DecoderLayer):
    """One layer with a fused [Q|K|V] projection, QK-norm, RoPE and a pluggable FFN.

    Modules: ``input_layernorm``, ``qkv_proj`` [(nh + 2 nkv) * hd, H], ``q_norm`` / ``k_norm``
    [hd], ``o_proj`` [H, nh * hd], ``post_attention_layernorm``, ``mlp`` (any [.., H] -> [.., H]).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        mlp: nn.Module,
        *,
        dtype: torch.dtype | None,
        device: Device,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h, hd, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.split_sizes = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.qkv_proj = Linear(h, q_size + 2 * kv_size, bias=False, dtype=dtype, device=device)
        self.q_norm = RMSNorm(hd, eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(hd, eps, dtype=dtype, device=device)
        self.o_proj = Linear(q_size, h, bias=False, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype=dtype, device=device)
        self.mlp = mlp
        self.rotary = rotary  # shared by all layers (registered once per layer; buffers dedup)

    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See :meth:`DecoderLayer.qkv`. ``v`` is a strided view of the fused projection output
        (last dim contiguous); ``q`` and ``k`` are fresh contiguous tensors."""
        bs, seq = hidden.shape[:2]
        q, k, v = self.qkv_proj(self.input_layernorm(hidden)).split(self.split_sizes, dim=-1)
        q = self.q_norm(q.view(bs, seq, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(bs, seq, self.num_kv_heads, self.head_dim))
        v = v.view(bs, seq, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """See :meth:`DecoderLayer.finish`."""
        h = hidden + self.o_proj(attn_out.reshape(*attn_out.shape[:2], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLM(BlockDiffusionLM):
    """Embedding, shared RoPE table, ``layers``, final norm and LM head.

    Subclasses build ``self.layers`` (via :meth:`make_mlp`) and list their checkpoint tensors in
    :meth:`weight_specs`. Modules: ``embed_tokens`` [V, H], ``rotary``, ``layers``, ``norm`` [H],
    ``lm_head`` [V, H] (shares ``embed_tokens.weight`` when ``tie_word_embeddings``).
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None, device: Device) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(
            config.rotary_dim,
            config.rope_theta,
            max(config.max_position_embeddings, MIN_ROPE_POSITIONS),
            device=device,
        )
        self.layers = nn.ModuleList(
            QKNormDecoderLayer(
                config,
                i,
                self.rotary,
                self.make_mlp(i, dtype=dtype, device=device),
                dtype=dtype,
                device=device,
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = Linear(h, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.tie_weights()

    def make_mlp(self, layer_id: int, *, dtype: torch.dtype | None, device: Device) -> nn.Module:
        """The FFN of layer ``layer_id``."""
        raise NotImplementedError

    @classmethod
    def weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """Every tensor of the HF checkpoint for ``config``, in checkpoint order."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Make ``lm_head`` share ``embed_tokens.weight`` if the config ties them (re-run after
        materialising a meta model)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (the RoPE table) after ``to_empty()``."""
        self.rotary.reset_table()

    def ensure_max_positions(self, num_positions: int) -> None:
        """Grow the RoPE table so positions ``< num_positions`` are valid (no-op if they are)."""
        if num_positions > self.rotary.max_positions:
            self.rotary.reset_table(num_positions)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[bs, L] int64 -> [bs, L, H] model dtype."""
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [..., H] -> [..., V] float32 (matmul in the model dtype, then cast)."""
        return self.lm_head(hidden).float()


def attention_specs(
    config: ModelConfig, i: int, hf_prefix: str, names: tuple[str, str, str, str, str, str]
) -> list[WeightSpec]:
    """Specs for layer ``i``'s norms and attention projections.

    ``names``: HF names (relative to ``hf_prefix``) of (input norm, fused qkv or q/k/v prefix,
    q-norm, k-norm, out proj, post-attention norm); a qkv name ending in ``{}`` is expanded to the
    separate ``q/k/v`` projections (SDAR), otherwise it is one fused tensor (LLaDA2).
    """
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    t = f"layers.{i}."
    in_norm, qkv, q_norm, k_norm, out, post_norm = (hf_prefix + n for n in names)
    specs = [WeightSpec(in_norm, (h,), t + "input_layernorm.weight", init="ones")]
    if "{}" in qkv:
        for proj, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            specs.append(
                WeightSpec(
                    qkv.format(proj),
                    (size, h),
                    t + "qkv_proj.weight",
                    (slice(start, start + size),),
                )
            )
    else:
        specs.append(WeightSpec(qkv, (q + 2 * kv, h), t + "qkv_proj.weight"))
    specs += [
        WeightSpec(q_norm, (hd,), t + "q_norm.weight", init="ones"),
        WeightSpec(k_norm, (hd,), t + "k_norm.weight", init="ones"),
        WeightSpec(out, (h, q), t + "o_proj.weight"),
        WeightSpec(post_norm, (h,), t + "post_attention_layernorm.weight", init="ones"),
    ]
    return specs


def swiglu_specs(hf_prefix: str, target: str, hidden: int, inter: int) -> list[WeightSpec]:
    """``{hf_prefix}{gate,up,down}_proj.weight`` -> a :class:`SwiGLUMLP` at ``target``."""
    gu = target + "gate_up_proj.weight"
    return [
        WeightSpec(hf_prefix + "gate_proj.weight", (inter, hidden), gu, (slice(0, inter),)),
        WeightSpec(hf_prefix + "up_proj.weight", (inter, hidden), gu, (slice(inter, 2 * inter),)),
        WeightSpec(hf_prefix + "down_proj.weight", (hidden, inter), target + "down_proj.weight"),
    ]
