"""RMSNorm and RoPE against the formulas of docs/MODELS.md §1 and §2."""

from __future__ import annotations

import torch
from naive import rms, rope_pairs

from herald.layers.rmsnorm import RMSNorm, rms_norm
from herald.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq


def test_rms_norm_is_the_spec_formula_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6), expected)
    norm = RMSNorm(64, 1e-6, dtype=torch.bfloat16)
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x), expected)
    assert torch.allclose(
        rms_norm(x.float(), w.float(), 1e-6), rms(x.float(), w.float()), atol=1e-5
    )


def test_rope_full_matches_pairwise_rotation() -> None:
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 1e6, 4096)
    q = torch.randn(2, 7, 4, 32, generator=g)
    k = torch.randn(2, 7, 2, 32, generator=g)
    positions = torch.randint(0, 4096, (2, 7), generator=g)
    rq, rk = rope(positions, q, k)
    # The angles are float32 as in HF (error ~ position * 6e-8) vs float64 here.
    for b in range(2):
        assert torch.allclose(rq[b], rope_pairs(q[b], positions[b], 32, 1e6), atol=2e-3)
        assert torch.allclose(rk[b], rope_pairs(k[b], positions[b], 32, 1e6), atol=2e-3)


def test_rope_partial_rotates_only_the_leading_dims() -> None:
    g = torch.Generator().manual_seed(2)
    partial = RotaryEmbedding(16, 6e5, 1024)  # LLaDA2 style: 16 of 32 dims
    full16 = RotaryEmbedding(16, 6e5, 1024)
    q = torch.randn(1, 9, 4, 32, generator=g)
    k = torch.randn(1, 9, 2, 32, generator=g)
    positions = torch.arange(100, 109)[None]
    pq, pk = partial(positions, q, k)
    fq, fk = full16(positions, q[..., :16].contiguous(), k[..., :16].contiguous())
    assert torch.equal(pq[..., 16:], q[..., 16:]) and torch.equal(pk[..., 16:], k[..., 16:])
    assert torch.equal(pq[..., :16], fq) and torch.equal(pk[..., :16], fk)
    assert torch.allclose(pq[0], rope_pairs(q[0], positions[0], 16, 6e5), atol=1e-5)


def test_rope_table_equals_hf_on_the_fly_formula() -> None:
    rope = RotaryEmbedding(64, 6e5, 2048)
    pos = torch.tensor([[0, 1, 2047, 1000]])
    inv = rope_inv_freq(64, 6e5)
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    freqs = (inv[None, :, None] @ pos[:, None, :].float()).transpose(1, 2)  # HF: matmul, fp32
    emb = torch.cat((freqs, freqs), dim=-1)
    assert torch.allclose(rope.cos_table[pos], emb.cos(), atol=1e-6)
    assert torch.allclose(rope.sin_table[pos], emb.sin(), atol=1e-6)


def test_rope_scores_depend_only_on_relative_position() -> None:
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(32, 1e4, 512)
    q = torch.randn(1, 1, 1, 32, generator=g).expand(1, 2, 1, 32)
    k = torch.randn(1, 1, 1, 32, generator=g).expand(1, 2, 1, 32)
    rq, _ = rope(torch.tensor([[10, 300]]), q, k)
    _, rk = rope(torch.tensor([[3, 293]]), q, k)
    assert torch.allclose((rq[0, 0] * rk[0, 0]).sum(), (rq[0, 1] * rk[0, 1]).sum(), atol=1e-4)


def test_rope_casts_cos_sin_to_the_activation_dtype() -> None:
    rope = RotaryEmbedding(32, 1e6, 128)
    q = torch.randn(1, 3, 2, 32).to(torch.bfloat16)
    pos = torch.tensor([[5, 6, 7]])
    rq, _ = rope(pos, q, q)
    cos = rope.cos_table[pos].to(torch.bfloat16).unsqueeze(2)
    sin = rope.sin_table[pos].to(torch.bfloat16).unsqueeze(2)
    assert rq.dtype == torch.bfloat16 and torch.equal(rq, apply_rotary(q, cos, sin))


def test_reset_table_extends_positions() -> None:
    rope = RotaryEmbedding(8, 1e4, 16)
    small = rope.cos_table.clone()
    rope.reset_table(64)
    assert rope.cos_table.shape == (64, 8) and torch.equal(rope.cos_table[:16], small)
