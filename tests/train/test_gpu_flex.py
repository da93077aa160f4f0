"""On CUDA: the compiled flex_attention training forward equals the dense-mask one."""

from __future__ import annotations

import pytest
import torch

from herald.models.registry import build_model, get_preset
from herald.train.objective import (
    DenseDiffusionAttention,
    FlexDiffusionAttention,
    check_flex_matches_dense,
    dense_block_diffusion_mask,
    diffusion_forward,
    flex_block_mask,
    sample_noise,
)

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_training_forward_matches_dense() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    dev = torch.device("cuda")
    cfg = get_preset("tiny-sdar")
    net = build_model(cfg, dev, torch.float32, seed=1)
    n, b = 512, cfg.block_size
    gen = torch.Generator(device=dev).manual_seed(0)
    clean = torch.randint(0, 256, (2, n), generator=gen, device=dev)
    noisy, _, _ = sample_noise(clean, b, cfg.mask_token_id, generator=gen)
    flex = FlexDiffusionAttention(flex_block_mask(n, b, dev), kernel=torch.compile(flex_attention))
    dense = DenseDiffusionAttention(dense_block_diffusion_mask(n, b, dev))
    with torch.no_grad():
        a = diffusion_forward(net, noisy, clean, flex)
        ref = diffusion_forward(net, noisy, clean, dense)
    torch.testing.assert_close(a, ref, rtol=5e-3, atol=5e-3)  # TF32 may be on
    assert check_flex_matches_dense(dev, seq_len=512) < 0.05
