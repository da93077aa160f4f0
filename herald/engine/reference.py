"""No-cache reference decoder: the specification the cached engines are tested against.

Mirrors the structure of LLaDA2.0's reference ``generate`` (docs/MODELS.md): at every denoising
step the whole canvas up to the end of the current block is re-forwarded with the block-causal
mask (bidirectional inside a block, causal across blocks) and the current block's logits are read.
No KV is kept, so there is no commit forward. One request at a time; slow by design.
"""

from __future__ import annotations

import torch

from herald.attention.block_causal import BlockCausalAttention
from herald.config import SamplingParams
from herald.diffusion.block import BlockLayout
from herald.diffusion.sampler import sample_tokens
from herald.diffusion.unmask import min_accept_count, select_unmask
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig


@torch.inference_mode()
def reference_generate(
    model: BlockDiffusionLM,
    config: ModelConfig,
    prompt_ids: list[int],
    params: SamplingParams,
) -> tuple[list[int], list[int]]:
    """Decode one prompt with full recomputation.

    Returns:
        (output_ids, steps_per_block): generated tokens (EOS and everything after it removed,
        at most ``max_new_tokens``) and the denoising steps each block took.
    """
    params.validate()
    device = next(model.parameters()).device
    b, mask_id = config.block_size, config.mask_token_id
    layout = BlockLayout(len(prompt_ids), b, params.max_new_tokens)
    x = torch.full((1, layout.total_len), mask_id, dtype=torch.long, device=device)
    x[0, : len(prompt_ids)] = torch.tensor(prompt_ids, device=device)
    pos = torch.arange(layout.total_len, device=device)[None]
    attn = BlockCausalAttention(b)
    gen = None
    if not params.greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed if params.seed is not None else 0)
    fixed = torch.tensor([params.num_denoise_steps or 0], device=device)
    thr = torch.tensor([params.threshold], dtype=torch.float32, device=device)
    steps_per_block: list[int] = []
    out: list[int] = []
    eos = set(config.eos_token_ids)
    for start in range(layout.first_block_start, layout.total_len, b):
        end = start + b
        masked = x[:, start:end] == mask_id
        masked[0, : max(0, len(prompt_ids) - start)] = False
        steps = 0
        while bool(masked.any()):
            hidden = model(x[:, :end], pos[:, :end], attn)[:, start:end]
            cols = masked[0].nonzero().squeeze(-1)
            tok, cf = sample_tokens(model.compute_logits(hidden[0, cols]), params, mask_id, gen)
            cand = torch.zeros(1, b, dtype=torch.long, device=device)
            conf = torch.zeros(1, b, dtype=torch.float32, device=device)
            cand[0, cols], conf[0, cols] = tok, cf
            k_min = min_accept_count(masked.sum(-1), torch.tensor([steps], device=device), fixed)
            accept = select_unmask(conf, masked, thr, k_min, fixed == 0)
            x[:, start:end] = torch.where(accept, cand, x[:, start:end])
            masked &= ~accept
            steps += 1
        steps_per_block.append(steps)
        out.extend(x[0, max(start, len(prompt_ids)) : end].tolist())
        if not params.ignore_eos and any(t in eos for t in out[: params.max_new_tokens]):
            break
        if len(out) >= params.max_new_tokens:
            break
    out = out[: params.max_new_tokens]
    if not params.ignore_eos:
        for j, t in enumerate(out):
            if t in eos:
                out = out[:j]
                break
    return out, steps_per_block
