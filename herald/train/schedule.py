"""The optimisation schedule of a training run (:mod:`herald.train.trainer`): the learning rate
of each run step (linear warm-up, then cosine to ``min_lr_ratio * lr``), the seeding of the
step noise by global step, and AdamW with weight decay on the matrices only.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from herald.models.common import DecoderLM
from herald.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig, total: int | None) -> float:
    """Learning rate of run step ``step`` (0-based): linear warm-up over ``warmup_steps``, then
    cosine from ``lr`` to ``min_lr_ratio * lr`` at ``total`` (held after; peak while ``total`` is
    unknown)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total is None:
        return cfg.lr
    span = max(1, total - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * cfg.lr
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * frac))


def noise_generator(device: torch.device, seed: int, step: int) -> torch.Generator:
    """The generator of global step ``step``'s noise (independent of run boundaries)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + step) % (2**63))
    return gen


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_optimizer(model: DecoderLM, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model``: weight decay on matrices (2-D and up) but not the embedding,
    norms or biases; fused on CUDA."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():  # tied lm_head appears once, as embed_tokens
        (decay if p.ndim >= 2 and "embed_tokens" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda"
    )
