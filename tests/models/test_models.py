"""Model definitions: exact checkpoint names/shapes, the layer split, the math vs docs/MODELS.md."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_PRESETS, ExactAttention
from naive import forward_logits
from safetensors.torch import load_file

from herald.models.loader import load_model
from herald.models.registry import build_model, get_preset, init_random_weights, weight_specs
from herald.models.weights import get_target

SDAR_LAYER = {
    "input_layernorm.weight": (4096,),
    "self_attn.q_proj.weight": (4096, 4096),
    "self_attn.k_proj.weight": (1024, 4096),
    "self_attn.v_proj.weight": (1024, 4096),
    "self_attn.o_proj.weight": (4096, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.k_norm.weight": (128,),
    "post_attention_layernorm.weight": (4096,),
    "mlp.gate_proj.weight": (12288, 4096),
    "mlp.up_proj.weight": (12288, 4096),
    "mlp.down_proj.weight": (4096, 12288),
}
LLADA2_ATTN = {
    "input_layernorm.weight": (2048,),
    "attention.query_key_value.weight": (3072, 2048),
    "attention.query_layernorm.weight": (128,),
    "attention.key_layernorm.weight": (128,),
    "attention.dense.weight": (2048, 2048),
    "post_attention_layernorm.weight": (2048,),
}
LLADA2_DENSE = {
    "mlp.gate_proj.weight": (5120, 2048),
    "mlp.up_proj.weight": (5120, 2048),
    "mlp.down_proj.weight": (2048, 5120),
}
LLADA2_MOE = {
    "mlp.gate.weight": (256, 2048),
    "mlp.gate.expert_bias": (256,),
    **{f"mlp.experts.{e}.{p}_proj.weight": (512, 2048) for e in range(256) for p in ("gate", "up")},
    **{f"mlp.experts.{e}.down_proj.weight": (2048, 512) for e in range(256)},
    "mlp.shared_experts.gate_proj.weight": (512, 2048),
    "mlp.shared_experts.up_proj.weight": (512, 2048),
    "mlp.shared_experts.down_proj.weight": (2048, 512),
}


def _check_full_size(preset: str, expected: dict[str, tuple[int, ...]]) -> None:
    config = get_preset(preset)
    specs = weight_specs(config)
    assert {s.name: s.shape for s in specs} == expected
    assert len(specs) == len(expected)  # no duplicates
    model = build_model(config, "meta", torch.bfloat16)  # shapes only, no memory
    for s in specs:
        assert tuple(get_target(model, s).shape) == s.shape, s.name
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for n, b in model.named_buffers() if "rotary" not in n)
    assert sum(s.numel for s in specs) == params + buffers


def test_sdar_8b_chat_has_the_399_spec_tensors() -> None:
    expected = {f"model.layers.{i}.{k}": v for i in range(36) for k, v in SDAR_LAYER.items()}
    expected |= {
        "model.embed_tokens.weight": (151936, 4096),
        "model.norm.weight": (4096,),
        "lm_head.weight": (151936, 4096),
    }
    assert len(expected) == 399
    _check_full_size("sdar-8b-chat", expected)
    # model.safetensors.index.json total_size of SDAR-8B-Chat (bf16).
    assert sum(s.numel for s in weight_specs(get_preset("sdar-8b-chat"))) * 2 == 16_381_470_720


def test_llada2_mini_has_the_spec_tensors() -> None:
    expected: dict[str, tuple[int, ...]] = {
        "model.word_embeddings.weight": (157184, 2048),
        "model.norm.weight": (2048,),
        "lm_head.weight": (157184, 2048),
    }
    for i in range(20):
        expected |= {f"model.layers.{i}.{k}": v for k, v in LLADA2_ATTN.items()}
        ffn = LLADA2_DENSE if i == 0 else LLADA2_MOE
        expected |= {f"model.layers.{i}.{k}": v for k, v in ffn.items()}
    assert len(expected) == 3 + 20 * 6 + 3 + 19 * (2 + 3 * 256 + 3)
    _check_full_size("llada2-mini", expected)
    total = sum(s.numel for s in weight_specs(get_preset("llada2-mini")))
    assert 16.2e9 < total < 16.3e9  # "16B total" (docs/MODELS.md §5)


@pytest.mark.parametrize("preset", TINY_PRESETS)
@torch.no_grad()
def test_specs_cover_every_parameter_element(preset: str) -> None:
    model = build_model(get_preset(preset), "cpu", torch.float32)
    for t in [*model.parameters(), *(b for n, b in model.named_buffers() if "rotary" not in n)]:
        t.fill_(float("nan"))
    init_random_weights(model, seed=0)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert not t.isnan().any(), name
    assert model.layers[-1].mlp.__class__.__name__ == (
        "SwiGLUMLP" if preset == "tiny-sdar" else "SparseMoE"
    )


@pytest.mark.parametrize("preset", TINY_PRESETS)
@torch.no_grad()
def test_forward_equals_finish_of_attention_of_qkv(preset: str) -> None:
    model = build_model(get_preset(preset), "cpu", torch.float32, seed=1)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40).expand(2, 40)
    attn = ExactAttention(32)
    hidden = model.embed(ids)
    for layer in model.layers:
        q, k, v = layer.qkv(hidden, pos)
        cfg = model.config
        assert q.shape == (2, 40, cfg.num_heads, cfg.head_dim)
        assert k.shape == v.shape == (2, 40, cfg.num_kv_heads, cfg.head_dim)
        manual = layer.finish(hidden, attn.forward(layer.layer_id, q, k, v))
        assert torch.equal(layer(hidden, pos, attn), manual)
        hidden = manual
    assert torch.equal(model.final_norm(hidden), model(ids, pos, attn))


@pytest.mark.parametrize("preset", TINY_PRESETS)
@torch.no_grad()
def test_logits_match_the_naive_spec_forward(
    preset: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    """herald's model vs a forward written from docs/MODELS.md that reads the checkpoint by HF
    names."""
    ckpt = tiny_checkpoint(preset)
    model, config, _ = load_model(ckpt, "cpu", torch.float32)
    sd = load_file(str(ckpt / "model.safetensors"))
    ids = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(3))
    ids[30:] = config.mask_token_id
    expected = forward_logits(sd, config, ids)
    got = model.compute_logits(model(ids[None], torch.arange(45)[None], ExactAttention(32)))[0]
    assert got.dtype == torch.float32
    scale = expected.abs().max()
    assert ((got - expected).abs().max() / scale) < 1e-4


@pytest.mark.parametrize("preset", TINY_PRESETS)
@torch.no_grad()
def test_tiny_logits_are_not_degenerate(preset: str) -> None:
    """Random tiny models must give peaked-and-flat mixtures so threshold decoding is exercised."""
    model = build_model(get_preset(preset), "cpu", torch.float32, seed=0)
    confs = []
    for seed in range(4):
        ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(seed))
        ids[0, 40:] = model.config.mask_token_id
        h = model(ids, torch.arange(64)[None], ExactAttention(32))
        logits = model.compute_logits(h)[0]
        assert logits.std(-1).min() > 1.0
        assert not torch.allclose(logits[40], logits[41])
        confs.append(logits[40:].softmax(-1).max(-1).values)
    conf = torch.cat(confs)
    assert (conf > 0.95).any() and (conf < 0.95).float().mean() > 0.3


@pytest.mark.parametrize("preset", TINY_PRESETS)
@torch.no_grad()
def test_batch_rows_are_independent(preset: str) -> None:
    model = build_model(get_preset(preset), "cpu", torch.float32, seed=2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    pos = torch.stack([torch.arange(32), torch.arange(64, 96)])
    both = model(ids, pos, ExactAttention())
    for b in range(2):
        alone = model(ids[b : b + 1], pos[b : b + 1], ExactAttention())
        assert torch.allclose(both[b], alone[0], atol=1e-5)


@torch.no_grad()
def test_bf16_model_runs_and_keeps_expert_bias_fp32() -> None:
    model = build_model(get_preset("tiny-llada2"), "cpu", torch.bfloat16, seed=0)
    ids = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(0))
    h = model(ids, torch.arange(33)[None], ExactAttention(32))
    assert h.dtype == torch.bfloat16 and not h.isnan().any()
    assert model.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    assert model.compute_logits(h).dtype == torch.float32


def test_rope_table_covers_long_contexts() -> None:
    model = build_model(get_preset("llada2-mini"), "meta")
    assert model.rotary.max_positions >= 65536  # the preset says 16384; benchmarks run 32K
    small = build_model(get_preset("tiny-sdar", max_position_embeddings=128), "cpu", seed=0)
    small.ensure_max_positions(70000)
    assert small.rotary.cos_table.shape == (70000, 32)


@torch.no_grad()
def test_tied_embeddings_share_one_tensor() -> None:
    cfg = get_preset("tiny-sdar", tie_word_embeddings=True)
    assert "lm_head.weight" not in {s.name for s in weight_specs(cfg)}
    model = build_model(cfg, "cpu", torch.float32, seed=0)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llada2-mini", "sdar-8b-chat"])
@torch.no_grad()
def test_full_size_random_model_builds_fast_on_gpu(preset: str) -> None:
    """Benchmarks build full-size random models directly on the GPU (no files)."""
    import time

    t0 = time.perf_counter()
    model = build_model(get_preset(preset), "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 120
    ids = torch.randint(0, 150000, (2, 96), device="cuda")
    pos = torch.arange(96, device="cuda").expand(2, 96)
    logits = model.compute_logits(model(ids, pos, ExactAttention(32)))
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    assert logits.std(-1).min() > 0
