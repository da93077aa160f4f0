"""The block-diffusion training objective: noising, the 2L-token attention mask, and the loss.

One training forward runs the model once over ``[x_t ; x_0]`` (2L tokens): ``x_t`` is the noisy
copy of the clean window ``x_0``. With ``blk(n)`` the diffusion block of a position within its
copy (``(n mod L) // B``), query ``q`` may attend to key ``k`` when (the BD3-LM mask used by
SDAR's training):

* both noisy and ``blk(q) == blk(k)``: a noisy block sees itself bidirectionally;
* ``q`` noisy, ``k`` clean and ``blk(k) < blk(q)``: ...and the clean blocks before it;
* both clean and ``blk(k) <= blk(q)``: the clean copy is block-causal, exactly the prefix KV an
  inference engine keeps.

Noisy block ``i`` uses the position ids of clean block ``i``. So the hidden states of noisy block
``i`` equal those of an inference forward over ``[x_0 blocks < i ; x_t block i]`` under the
block-causal mask (tests/train/test_objective.py checks this in float64). The model runs its own
layers unchanged; only the :class:`~herald.models.base.AttentionBackend` differs:
:class:`FlexDiffusionAttention` (``torch.nn.attention.flex_attention`` with a sparse BlockMask,
compiled; CUDA) or :class:`DenseDiffusionAttention` (SDPA with a dense boolean mask; CPU tests and
the reference).

Noise: each block draws its own mask ratio ``t ~ U(eps, 1)`` and each of its tokens is replaced
by the mask id with probability ``t``. Loss: cross-entropy on masked positions of ``x_t``
(logits at ``i`` predict the token at ``i``, no shift), either

* ``"mean"`` (default): the plain mean over masked tokens, or
* ``"elbo"``: ``sum(CE / t) / num_tokens``, the masked-diffusion ELBO weighting (unbiased, higher
  variance: a block with small ``t`` weighs ``1 / t``).
"""

from __future__ import annotations

import keyword
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from herald.models.common import DecoderLM

LossWeighting = Literal["mean", "elbo"]
MaskMod = Callable[[Any, Any, torch.Tensor, torch.Tensor], torch.Tensor]


def block_diffusion_mask_mod(seq_len: int, block_size: int) -> MaskMod:
    """``mask_mod(b, h, q_idx, kv_idx) -> bool`` over ``[x_t ; x_0]`` (module docstring); index
    tensors broadcast, so it serves flex_attention and :func:`dense_block_diffusion_mask`."""

    def mask_mod(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_noisy = q_idx < seq_len
        kv_noisy = kv_idx < seq_len
        q_blk = torch.where(q_noisy, q_idx, q_idx - seq_len) // block_size
        kv_blk = torch.where(kv_noisy, kv_idx, kv_idx - seq_len) // block_size
        noisy_self = q_noisy & kv_noisy & (q_blk == kv_blk)
        noisy_to_clean = q_noisy & ~kv_noisy & (kv_blk < q_blk)
        clean_causal = ~q_noisy & ~kv_noisy & (kv_blk <= q_blk)
        return noisy_self | noisy_to_clean | clean_causal

    return mask_mod


def dense_block_diffusion_mask(
    seq_len: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[2L, 2L] bool (True = may attend) for ``[x_t ; x_0]``; ``L = seq_len``."""
    idx = torch.arange(2 * seq_len, device=device)
    mask: torch.Tensor = block_diffusion_mask_mod(seq_len, block_size)(
        None, None, idx[:, None], idx[None, :]
    )
    return mask


def flex_block_mask(seq_len: int, block_size: int, device: torch.device | str) -> Any:
    """The flex_attention BlockMask of the 2L-token mask (built once per ``seq_len``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = 2 * seq_len
    mask_mod = block_diffusion_mask_mod(seq_len, block_size)
    return create_block_mask(mask_mod, None, None, n, n, device=str(device))


def _cast(
    dtype: torch.dtype | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dtype is None:
        return q, k, v
    return q.to(dtype), k.to(dtype), v.to(dtype)


class DenseDiffusionAttention:
    """AttentionBackend: SDPA over ``[x_t ; x_0]`` with a dense boolean mask.

    Args:
        mask: [2L, 2L] bool from :func:`dense_block_diffusion_mask`, on the model's device.
        compute_dtype: cast q/k/v to this dtype first (bf16 under autocast), or None.
    """

    def __init__(self, mask: torch.Tensor, compute_dtype: torch.dtype | None = None) -> None:
        self.mask = mask
        self.compute_dtype = compute_dtype

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = _cast(self.compute_dtype, q, k, v)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return o.transpose(1, 2)


class FlexDiffusionAttention:
    """AttentionBackend: flex_attention over ``[x_t ; x_0]`` with a sparse BlockMask.

    Args:
        block_mask: from :func:`flex_block_mask` (same ``seq_len`` as the inputs).
        compute_dtype: cast q/k/v to this dtype first (flex_attention is not autocast-aware and
            needs one dtype for q, k, v), or None.
        kernel: the flex_attention callable; on CUDA pass ``torch.compile(flex_attention)`` (the
            eager one materialises the full score matrix).
    """

    def __init__(
        self,
        block_mask: Any,
        compute_dtype: torch.dtype | None = None,
        kernel: Callable[..., Any] | None = None,
    ) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.block_mask = block_mask
        self.compute_dtype = compute_dtype
        self.kernel = kernel or flex_attention

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = _cast(self.compute_dtype, q, k, v)
        o = self.kernel(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            block_mask=self.block_mask,
            enable_gqa=True,
        )
        return o.transpose(1, 2)


def sample_noise(
    clean: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    *,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask each block of ``clean`` at its own ratio ``t ~ U(eps, 1)``.

    Args:
        clean: [bs, L] int64 token ids, ``L`` a multiple of ``block_size``.
        generator: on ``clean``'s device (seeded per step for reproducibility), or None.

    Returns:
        ``(noisy [bs, L] int64, masked [bs, L] bool, t [bs, L] float32)``, ``t`` per token (its
        block's ratio).

    Raises:
        ValueError: ``L`` is not a multiple of ``block_size``.
    """
    bs, n = clean.shape
    if n % block_size:
        raise ValueError(f"sequence length {n} is not a multiple of block_size {block_size}")
    dev = clean.device
    t = eps + (1.0 - eps) * torch.rand(bs, n // block_size, generator=generator, device=dev)
    t = t.repeat_interleave(block_size, dim=1)
    masked = torch.rand(bs, n, generator=generator, device=dev) < t
    noisy = torch.where(masked, torch.full_like(clean, mask_token_id), clean)
    return noisy, masked, t


def long_range_tokens(
    clean: torch.Tensor, vocab_size: int, *, ngram: int = 3, min_distance: int = 1024
) -> torch.Tensor:
    """Positions a model can fill in by copying from far context but not from near context.

    Position ``i`` is flagged when the n-gram ending there, ``clean[i - ngram + 1 : i + 1]``,
    occurred earlier in the window and its most recent earlier occurrence ends at least
    ``min_distance`` tokens before ``i``: an identifier of an imported module, a name defined
    thousands of tokens back. Exact (the n-gram ids are packed into one int64 key, no hashing).
    The per-window occurrences are found with one sort, O(L log L).

    Args:
        clean: [bs, L] int64 token ids (any device), ids in ``[0, vocab_size)``.
        vocab_size: the tokenizer's vocabulary size.
        ngram: n-gram length (>= 1).
        min_distance: tokens between the two occurrences' ends (>= 1).

    Returns:
        [bs, L] bool on ``clean``'s device; the first ``ngram - 1`` positions are never flagged.

    Raises:
        ValueError: ``ngram`` or ``min_distance`` below 1, or ``vocab_size ** ngram * L`` does
            not fit an int64 key.
    """
    if ngram < 1 or min_distance < 1:
        raise ValueError(f"need ngram >= 1 and min_distance >= 1, got {ngram}, {min_distance}")
    bs, n = clean.shape
    out = torch.zeros(bs, n, dtype=torch.bool, device=clean.device)
    m = n - ngram + 1
    if m <= 1:
        return out
    if vocab_size**ngram * m >= 2**62:
        raise ValueError(f"vocab_size {vocab_size} ** ngram {ngram} x {m} positions overflows")
    key = clean[:, ngram - 1 :].long()
    for k in range(1, ngram):  # key[:, j] packs the n-gram ending at position j + ngram - 1
        key = key * vocab_size + clean[:, ngram - 1 - k : n - k].long()
    pos = torch.arange(m, device=clean.device)
    sorted_key, order = (key * m + pos).sort(dim=1)  # by n-gram, then by position
    gram, at = sorted_key // m, sorted_key % m
    near = (gram[:, 1:] == gram[:, :-1]) & (at[:, 1:] - at[:, :-1] >= min_distance)
    flags = torch.zeros(bs, m, dtype=torch.bool, device=clean.device)
    flags.scatter_(1, order[:, 1:], near)
    out[:, ngram - 1 :] = flags
    return out


def name_token_mask(decode: Callable[[list[int]], str], vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool (CPU): the tokens that can be part of a name, i.e. whose text holds a
    letter and is not, stripped of spaces and ``._(``, a Python keyword (``True``, ``None`` and
    ``False`` among them), ``self`` or ``cls``. The long-range emphasis counts these only: a
    repeated ``if`` or ``:\n`` is syntax, not something to look up far back.

    Args:
        decode: ids -> text (e.g. :meth:`herald.models.tokenizer.Tokenizer.decode`).
        vocab_size: entries to classify (ids ``0 .. vocab_size - 1``).
    """
    skip = set(keyword.kwlist) | {"self", "cls"}
    out = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(vocab_size):
        text = decode([i]).strip()
        core = text.strip("._( ")
        out[i] = any(c.isalpha() for c in text) and core not in skip
    return out


def loss_weights(
    masked: torch.Tensor,
    t: torch.Tensor,
    weighting: LossWeighting,
    emphasis: torch.Tensor | None = None,
    emphasis_weight: float = 1.0,
    answer: torch.Tensor | None = None,
    answer_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CE weights [bs, L] float32 and the normaliser (0-dim float32) for ``weighting``:
    ``"mean"``: ``masked`` / ``masked.sum()``; ``"elbo"``: ``masked / t`` / ``numel``.

    ``emphasis`` ([bs, L] bool, e.g. :func:`long_range_tokens`) multiplies those tokens' weight
    by ``emphasis_weight``; ``answer`` ([bs, L] bool: the task mix's answer tokens) by
    ``answer_weight`` (a token in both gets the larger); the normaliser counts them that many
    times, so the loss stays a (weighted) mean per token and its scale does not change.

    Raises:
        ValueError: unknown weighting, or a weight <= 0.
    """
    if emphasis_weight <= 0:
        raise ValueError(f"emphasis_weight must be > 0, got {emphasis_weight}")
    if answer_weight <= 0:
        raise ValueError(f"answer_weight must be > 0, got {answer_weight}")
    mult = None
    if emphasis is not None and emphasis_weight != 1.0:
        mult = 1.0 + (emphasis_weight - 1.0) * emphasis.float()
    if answer is not None and answer_weight != 1.0:
        extra = 1.0 + (answer_weight - 1.0) * answer.float()
        mult = extra if mult is None else torch.maximum(mult, extra)
    m = masked.float() if mult is None else masked.float() * mult
    if weighting == "mean":
        return m, m.sum().clamp_min(1.0)
    if weighting == "elbo":
        norm = float(masked.numel()) if mult is None else mult.sum()
        return m / t, torch.as_tensor(norm, dtype=torch.float32, device=m.device)
    raise ValueError(f"unknown loss weighting {weighting!r}: use 'mean' or 'elbo'")


def diffusion_forward(
    model: DecoderLM, noisy: torch.Tensor, clean: torch.Tensor, attn: Any
) -> torch.Tensor:
    """One forward over ``[noisy ; clean]``; returns the final-normed hidden states of the noisy
    copy, [bs, L, hidden_size] (model dtype, or the autocast dtype's promotion)."""
    bs, n = clean.shape
    ids = torch.cat([noisy, clean], dim=1)
    pos = torch.arange(n, device=clean.device).repeat(2)[None].expand(bs, -1)
    hidden: torch.Tensor = model(ids, pos, attn)
    return hidden[:, :n]


class BlockDiffusionLoss(nn.Module):
    """``forward(noisy, clean, weights) -> sum(weights * CE)`` (0-dim float32).

    Wraps ``model`` with an attention backend so that one ``torch.compile`` covers the model,
    flex_attention and the loss. Divide by the normaliser of :func:`loss_weights`.

    Args (forward):
        noisy, clean: [bs, L] int64 on the model's device.
        weights: [bs, L] float32 (zero on unmasked positions).
    """

    def __init__(self, model: DecoderLM, attn: Any) -> None:
        super().__init__()
        self.model = model
        self.attn = attn

    def forward(
        self, noisy: torch.Tensor, clean: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        hidden = diffusion_forward(self.model, noisy, clean, self.attn)
        logits = self.model.compute_logits(hidden)  # [bs, L, V] float32
        ce = F.cross_entropy(logits.flatten(0, 1), clean.flatten(), reduction="none")
        return (ce * weights.flatten()).sum()


@torch.no_grad()
def check_flex_matches_dense(
    device: torch.device | str,
    *,
    seq_len: int = 1024,
    block_size: int = 32,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> float:
    """Compiled flex_attention with :func:`flex_block_mask` vs SDPA with the dense mask, on fresh
    random q/k/v of shape [1, 2 * seq_len, heads, head_dim]; returns the max abs difference
    (bf16: expect < ~0.02). Run once before training on CUDA."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    n = 2 * seq_len

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(1, n, h, head_dim, generator=gen, device=device).to(dtype)

    q, k, v = rnd(num_heads), rnd(num_kv_heads), rnd(num_kv_heads)
    kernel = torch.compile(flex_attention) if torch.device(device).type == "cuda" else None
    flex = FlexDiffusionAttention(flex_block_mask(seq_len, block_size, device), kernel=kernel)
    dense = DenseDiffusionAttention(dense_block_diffusion_mask(seq_len, block_size, device))
    a = flex.forward(0, q, k, v).float()
    b = dense.forward(0, q, k, v).float()
    return float((a - b).abs().max())
