"""Block attention over per-slot KV stores in one Triton kernel: per-row key lengths, no padding,
no mask tensors, GQA folded, and the draft group's visibility built in.

Queries ``q`` [bs, L, Hq, D] of batch row i attend to store slot ``slot_offset + i`` (K/V
[slots, Hkv, capacity, D], the store the slot backend writes the current tokens into first). Row
i's keys are its own ``prefix[i] + L`` rows (a denoising step or commit: the prefix plus the
block, bidirectionally); with ``draft_block`` = B (L = 2B, HERALD §IV-A1's fused draft step) the
block's queries see ``[0, prefix + B)`` exactly as a plain step does and the draft's queries see
``[0, prefix)`` and the draft rows ``[prefix + B, prefix + 2B)``. With ``causal_block`` = B (a
prefill chunk of L tokens, L a multiple of B), query t sees ``[0, prefix + (t // B + 1) * B)``:
every earlier block and its own block (block-causal).

One program per (row, KV head, tile of query positions): the tile's ``G`` query heads that share
the KV head are folded into its rows, and the keys stream in chunks of ``BLOCK_N`` with an online
softmax in float32. Every row's reduction runs over its own keys in chunks that start at key 0,
whatever the batch holds, so a row's result does not depend on its batch mates (no key-length
padding needed) and the block group of a draft step is bit-identical to a plain step.

``prefix`` is a device tensor: the launch shape depends on the batch size and L only, not on the
key lengths, so the call can be captured in a CUDA graph and replayed for every block.

With ``split_keys`` (denoising steps, commits and draft groups, not prefill chunks) the keys
are split in fixed chunks of that many rows: one program per (row, KV head, tile, chunk) keeps
its online softmax's state in a float32 workspace, and a second kernel merges a row's chunks in
chunk order. The chunks start at fixed key positions, so a row's result still depends on nothing
but its own keys. The grid covers the store's capacity; chunks past a row's keys return at once.
It is off unless asked for: meant for a large store that one program per (row, KV head, tile)
streams with too little parallelism, it measured slower over a 32K dense cache at batch 32 on an
H100 (1.45-1.58 ms per call for chunks of 2,048-8,192 keys, against 0.78 ms unsplit and 0.74 ms
for cuDNN SDPA; ``scripts/diagnostics/attention_split_bench.py``). The choice may never depend
on the batch (a row's bits would then depend on its mates), so it cannot be turned on for small
batches only.
"""

from __future__ import annotations

import math

import torch

from herald.env import settings
from herald.layers.moe_triton import triton_enabled

FOLDED_ROWS = 64  # query rows (positions x heads in a group) per program
BLOCK_N = 64  # keys per chunk
NUM_WARPS = 4
NUM_STAGES = 3


def query_tile(
    num_q_heads: int, num_kv_heads: int, length: int, block: int = 0, rows: int = FOLDED_ROWS
) -> int:
    """Query positions per program: ``rows // G``, dividing L (and B for a draft group or a
    block-causal chunk, so a tile never straddles two visibility rules)."""
    g = num_q_heads // num_kv_heads
    qt = max(1, rows // g)
    limit = block or length
    while qt > 1 and limit % qt:
        qt //= 2
    return min(qt, limit)


STEP_TILE = {
    "rows": FOLDED_ROWS,
    "block_n": BLOCK_N,
    "num_warps": NUM_WARPS,
    "num_stages": NUM_STAGES,
}
"""Launch parameters of denoising steps, commits and draft groups (the module's constants)."""

PREFILL_TILE = {"rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
"""Launch parameters of block-causal prefill chunks (:func:`block_attention` with
``causal_block``): folded query rows per program, keys per chunk, warps, pipeline stages. The
best of a sweep on an H100 (``scripts/diagnostics/prefill_attention_bench.py``, one layer over
4K/16K/32K prompts in 4,096-token chunks, LLaDA2.0-mini and SDAR-8B-Chat heads): fastest in
four of the six cases and within 7% in the other two, 1.7-2.5x PyTorch's SDPA path. A prefill
chunk is one request's, so they may differ from the steps' without touching batch
invariance."""

SMALL_STORE_KEYS = 8192
"""Stores up to this many rows per slot (the sparse pools) use the kernel by default; on the
H200 it measured slower than cuDNN over a 32K dense cache (one program per row and KV head
streams too few keys in parallel), so larger stores use it only with ``HERALD_TRITON=all``. The
choice depends on the store, never on the batch, so results stay batch-invariant."""


def block_attention_available(
    q: torch.Tensor, k_store: torch.Tensor, *, prefill: bool = False, block: int = 0
) -> bool:
    """True when the kernel suits the call: CUDA bf16/fp16, Triton enabled for this store (see
    :data:`SMALL_STORE_KEYS`; prefill chunks as ``HERALD_PREFILL_ATTENTION`` says), power-of-two
    head dim of at least 16, and at least 16 folded query rows per program (``block``: the
    diffusion block a draft group's or prefill chunk's tiles must divide)."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if prefill:
        if settings().prefill_attention == "sdpa" or not triton_enabled():
            return False
    elif not triton_enabled(k_store.shape[2] > SMALL_STORE_KEYS):
        return False
    d = q.shape[-1]
    g = q.shape[2] // k_store.shape[1]
    rows = (PREFILL_TILE if prefill else STEP_TILE)["rows"]
    qt = query_tile(q.shape[2], k_store.shape[1], q.shape[1], block, rows)
    return d >= 16 and d & (d - 1) == 0 and qt * g >= 16 and k_store.stride(-1) == 1


def block_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    prefix: torch.Tensor,
    *,
    slot_offset: int = 0,
    draft_block: int = 0,
    causal_block: int = 0,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    rows: int | None = None,
    split_keys: int = 0,
) -> torch.Tensor:
    """See the module docstring. ``prefix`` [bs] int32 on the device; returns [bs, L, Hq, D].

    The caller has written the current tokens' K/V at rows ``[prefix, prefix + L)`` of each
    row's slot. ``split_keys``: keys per program (0, the default: one program streams all of a
    row's keys). ``block_n``, ``num_warps``, ``num_stages`` and ``rows`` (folded query rows per
    program) default to :data:`PREFILL_TILE`'s for a block-causal chunk, else to
    :data:`STEP_TILE`'s. A
    block-causal chunk runs its own kernel (``block_causal_prefill``): no per-key visibility
    tests, and one compilation for every chunk length.

    Raises:
        ValueError: a draft group whose L is not 2B, a block-causal chunk that is not whole
            blocks or is also a draft group, or ``split_keys`` not a multiple of ``block_n`` or
            given with ``causal_block``.
    """
    from herald.attention import _block_kernel as kern

    bs, length, hq, d = q.shape
    hkv = k_store.shape[1]
    if draft_block and length != 2 * draft_block:
        raise ValueError(f"a draft group has 2B queries: got L={length}, B={draft_block}")
    if causal_block and (length % causal_block or draft_block):
        raise ValueError(f"a block-causal chunk is whole blocks: L={length}, B={causal_block}")
    tile = PREFILL_TILE if causal_block else STEP_TILE
    rows = tile["rows"] if rows is None else rows
    block_n = tile["block_n"] if block_n is None else block_n
    num_warps = tile["num_warps"] if num_warps is None else num_warps
    num_stages = tile["num_stages"] if num_stages is None else num_stages
    qt = query_tile(hq, hkv, length, draft_block or causal_block, rows)
    q = q.contiguous()
    out = torch.empty_like(q)
    if prefix.dtype != torch.int32:
        prefix = prefix.to(torch.int32)
    # the tensors, the scale in log2 units and the strides of each [., ., ., D] tensor
    args = (
        q, k_store, v_store, out, prefix, slot_offset, d**-0.5 * math.log2(math.e),
        *q.stride()[:3], *k_store.stride()[:3], *v_store.stride()[:3], *out.stride()[:3],
    )  # fmt: skip
    launch = {"num_warps": num_warps, "num_stages": num_stages}
    if causal_block and not split_keys:
        kern.block_causal_prefill[(bs, hkv, length // qt)](
            *args, CAUSAL_B=causal_block, G=hq // hkv, QT=qt, D=d, BLOCK_N=block_n, **launch
        )
        return out
    if split_keys:
        if causal_block or split_keys % block_n:
            raise ValueError(
                f"split_keys={split_keys}: a multiple of block_n={block_n}, not for prefill chunks"
            )
        return _split_attention(
            q, k_store, v_store, out, prefix, slot_offset, draft_block, qt, split_keys,
            block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    kern.block_attention[(bs, hkv, length // qt)](
        *args, L=length, DRAFT_B=draft_block, CAUSAL_B=causal_block, G=hq // hkv, QT=qt, D=d,
        BLOCK_N=block_n, **launch,
    )  # fmt: skip
    return out


def _split_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    out: torch.Tensor,
    prefix: torch.Tensor,
    slot_offset: int,
    draft_block: int,
    qt: int,
    split_keys: int,
    *,
    block_n: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """:func:`block_attention` with the keys split in chunks of ``split_keys`` rows (the module
    docstring): the chunks' partial softmax states, then their merge into ``out``."""
    from herald.attention import _block_kernel as kern

    bs, length, hq, d = q.shape
    hkv, g = k_store.shape[1], hq // k_store.shape[1]
    tiles, splits = length // qt, -(-k_store.shape[2] // split_keys)
    rows = bs * hkv * tiles * splits * qt * g
    part = torch.empty(rows * d, device=q.device, dtype=torch.float32)
    ml = torch.empty(rows * 2, device=q.device, dtype=torch.float32)
    kern.block_attention_split[(bs, hkv, tiles * splits)](
        q, k_store, v_store, part, ml, prefix, slot_offset, d**-0.5 * math.log2(math.e), splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_store.stride(0), k_store.stride(1), k_store.stride(2),
        v_store.stride(0), v_store.stride(1), v_store.stride(2),
        L=length, DRAFT_B=draft_block, G=g, QT=qt, D=d, BLOCK_N=block_n, SPLIT_N=split_keys,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    kern.block_attention_combine[(bs, hkv, tiles)](
        part, ml, out, prefix, splits, out.stride(0), out.stride(1), out.stride(2),
        L=length, DRAFT_B=draft_block, G=g, QT=qt, D=d, SPLIT_N=split_keys,
    )  # fmt: skip
    return out
