"""Slow, obviously-correct implementations written straight from docs/MODELS.md, for tests only.

Nothing here imports herald's layers: the reference forward reads an HF checkpoint's tensors by
their *HF names* (docs/MODELS.md §4, §5), so a mistake in herald's name mapping, fused-projection
layout or stacked-expert layout shows up as a mismatch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from herald.models.config import SDAR_ARCH, ModelConfig


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return w * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_pairs(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [L, heads, D], pos [L]: rotate pairs (j, j + rotary_dim/2), j < rotary_dim/2, by angle
    pos * theta^(-2j/rotary_dim); dims >= rotary_dim untouched. Angles in float64."""
    out = x.clone()
    half = rotary_dim // 2
    for j in range(half):
        ang = pos.double() * theta ** (-2.0 * j / rotary_dim)
        c = ang.cos().to(x.dtype)[:, None]
        s = ang.sin().to(x.dtype)[:, None]
        a, b = x[..., j], x[..., j + half]
        out[..., j] = a * c - b * s
        out[..., j + half] = b * c + a * s
    return out


def swiglu(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def moe_token(
    h: torch.Tensor,
    w_gate: torch.Tensor,
    bias: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    *,
    n_group: int,
    topk_group: int,
    top_k: int,
    scale: float,
) -> torch.Tensor:
    """One token [H] through the BailingMoeV2 block, with Python loops (docs/MODELS.md §6)."""
    num_experts = w_gate.shape[0]
    scores = torch.sigmoid(w_gate.float() @ h.float())  # [E]
    biased = scores + bias.float()
    per = num_experts // n_group
    group_score = [sorted(biased[g * per : (g + 1) * per].tolist())[-2:] for g in range(n_group)]
    group_rank = sorted(range(n_group), key=lambda g: -sum(group_score[g]))
    kept = set(group_rank[:topk_group])
    candidates = [e for e in range(num_experts) if e // per in kept]
    chosen = sorted(candidates, key=lambda e: -biased[e].item())[:top_k]
    w = scores[chosen]
    w = w / (w.sum() + 1e-20) * scale
    out = torch.zeros(h.shape[-1], dtype=torch.float32)
    for wk, e in zip(w, chosen, strict=True):
        g, u, d = experts[e]
        out += wk * swiglu(h[None], g, u, d)[0].float()
    y = out.to(h.dtype)
    if shared is not None:
        y = y + swiglu(h[None], *shared)[0]
    return y


def forward_logits(
    sd: dict[str, torch.Tensor], cfg: ModelConfig, ids: torch.Tensor
) -> torch.Tensor:
    """Logits [L, V] float32 of token ids [L] (positions 0..L-1) under the block-causal mask of
    ``cfg.block_size``, from an HF state dict ``sd`` (HF names)."""
    sdar = cfg.architecture == SDAR_ARCH
    nh, nkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    seq = ids.shape[0]
    pos = torch.arange(seq)
    blk = pos // cfg.block_size
    allowed = blk[:, None] >= blk[None, :]
    x = sd["model.embed_tokens.weight" if sdar else "model.word_embeddings.weight"][ids]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        n = rms(x, sd[p + "input_layernorm.weight"], eps)
        if sdar:
            q = n @ sd[p + "self_attn.q_proj.weight"].T
            k = n @ sd[p + "self_attn.k_proj.weight"].T
            v = n @ sd[p + "self_attn.v_proj.weight"].T
            qn, kn = sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"]
            wo = sd[p + "self_attn.o_proj.weight"]
        else:
            qkv = (n @ sd[p + "attention.query_key_value.weight"].T).view(seq, nh + 2 * nkv, hd)
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :]
            qn = sd[p + "attention.query_layernorm.weight"]
            kn = sd[p + "attention.key_layernorm.weight"]
            wo = sd[p + "attention.dense.weight"]
        q = rope_pairs(rms(q.reshape(seq, nh, hd), qn, eps), pos, cfg.rotary_dim, cfg.rope_theta)
        k = rope_pairs(rms(k.reshape(seq, nkv, hd), kn, eps), pos, cfg.rotary_dim, cfg.rope_theta)
        v = v.reshape(seq, nkv, hd)
        heads = []
        for h in range(nh):
            kv_head = h // (nh // nkv)
            s = (q[:, h] @ k[:, kv_head].T) / math.sqrt(hd)
            s = s.masked_fill(~allowed, float("-inf"))
            heads.append(s.softmax(-1) @ v[:, kv_head])
        x = x + torch.cat(heads, dim=-1) @ wo.T
        n = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        m = p + "mlp."
        if sdar or i < cfg.first_k_dense_replace:
            x = x + swiglu(
                n, sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"]
            )
            continue
        experts = [
            tuple(sd[f"{m}experts.{e}.{w}_proj.weight"] for w in ("gate", "up", "down"))
            for e in range(cfg.num_experts)
        ]
        shared = None
        if cfg.num_shared_experts:
            shared = tuple(sd[f"{m}shared_experts.{w}_proj.weight"] for w in ("gate", "up", "down"))
        x = x + torch.stack(
            [
                moe_token(
                    n[t],
                    sd[m + "gate.weight"],
                    sd[m + "gate.expert_bias"],
                    experts,  # type: ignore[arg-type]
                    shared,  # type: ignore[arg-type]
                    n_group=cfg.n_group,
                    topk_group=cfg.topk_group,
                    top_k=cfg.num_experts_per_tok,
                    scale=cfg.routed_scaling_factor,
                )
                for t in range(seq)
            ]
        )
    x = rms(x, sd["model.norm.weight"], eps)
    return (x @ sd["lm_head.weight"].T).float()
