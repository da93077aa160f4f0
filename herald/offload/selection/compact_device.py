"""HERALD's selection scored on the GPU from an int8 copy of K (``first_pass="int8-gpu"``).

The compact first pass's second placement: instead of the CPU streaming every prefix key in bf16
(0.634 GB per request and block at LLaDA2.0-mini 32K; the CPU's DRAM bandwidth caps HERALD there),
the model's device keeps an int8 copy of the offloaded layers' keys, one float32 scale per
(token, KV head) (:func:`herald.kv.compact_keys.quantize_keys`, D + 4 bytes per (token, KV head):
51.6% of bf16 K at head_dim 128), and scores it at HBM speed. The CPU pool still holds the full
bf16 KV; the selected rows come from it (the GPU fetch reads them from the page-locked pool), so
the CPU only stores.

**Not exact.** The importance (HERALD §IV-B4: softmax over every key, summed over the KV head's
query rows) is computed with each prefix key replaced by its int8 reconstruction ``s * q8`` (the
always-included tail keys exact). With several query heads per KV head the exact top-k cannot be
certified from int8 bounds (results/compact/README.md); this placement takes the approximate top-k
as it is. On the embedded checkpoint's real KV at 16K (budget 5%) it keeps 99.3-99.7% of the exact
top-k and >= 0.99995 of its importance mass; the int8 importance's top 1.5 x k holds the whole exact
top-k. Budget 1.0 still selects every position (then nothing is approximate). Not batch-
invariant: a request's softmax sums run over the batch's longest prefix (masked), so their
rounding, and at a near-tie the top-k, can change with its batch mates.

Device memory: ``max_batch x max_len x Hkv x (D + 4)`` bytes per offloaded layer, allocated when
the engine starts (:class:`DeviceCompactKeys`). The scores (:func:`int8_scores`) come from one
Triton kernel on CUDA that reads each int8 key once (the per-token scale applied after the dot
product); elsewhere from PyTorch, which converts the keys to float32 a chunk of requests at a
time (at most :data:`CHUNK_BYTES`). The softmax, the importance and the top-k are PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from herald.kv.compact_keys import quantize_keys
from herald.layers.moe_triton import interpreting, triton_available, triton_enabled

CHUNK_BYTES = 256 << 20
"""PyTorch path: the largest float32 copy of int8 keys held at once (requests in chunks)."""
BLOCK_S = 64
"""Triton path: positions per program."""


def store_bytes(layers: int, slots: int, num_kv_heads: int, max_len: int, head_dim: int) -> int:
    """Device bytes of :class:`DeviceCompactKeys`: ``D + 4`` per (layer, slot, KV head, token)."""
    return layers * slots * num_kv_heads * max_len * (head_dim + 4)


class DeviceCompactKeys:
    """int8 keys and float32 scales of every running request, per offloaded layer, in slot order
    on the model's device (zeros until written).

    Args:
        layers: the offloaded layers' ids; slots: the engine's max batch; num_kv_heads,
            max_len (tokens per slot), head_dim; device.
    """

    def __init__(
        self,
        layers: Sequence[int],
        slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        device: torch.device,
    ) -> None:
        self.layers = list(layers)
        shape = (len(self.layers), slots, num_kv_heads, max_len)
        self.q8_all = torch.zeros((*shape, head_dim), dtype=torch.int8, device=device)
        self.scales_all = torch.zeros(shape, dtype=torch.float32, device=device)
        # per layer id: views of the one tensor (a commit writes every layer in one kernel)
        self.q8 = {layer: self.q8_all[li] for li, layer in enumerate(self.layers)}
        self.scales = {layer: self.scales_all[li] for li, layer in enumerate(self.layers)}
        self.nbytes = store_bytes(len(self.layers), slots, num_kv_heads, max_len, head_dim)

    def write(self, layer: int, slot: int, start: int, keys: torch.Tensor) -> None:
        """Keys ``[Hkv, n, D]`` (any float dtype, same device) of positions ``[start, start +
        n)`` of ``slot``, quantized."""
        q8, s = quantize_keys(keys)
        n = keys.shape[1]
        self.q8[layer][slot, :, start : start + n] = q8
        self.scales[layer][slot, :, start : start + n] = s

    def write_blocks(self, blocks_k: torch.Tensor, starts: Sequence[int]) -> None:
        """One committed block per slot ``0..n-1``: ``blocks_k`` ``[L', n, Hkv, B, D]`` (the
        offloaded layers in order), slot ``i``'s block at positions ``[starts[i], + B)``: one
        scatter per tensor for every layer and slot."""
        q8, s = quantize_keys(blocks_k)
        n, b = blocks_k.shape[1], blocks_k.shape[3]
        dev = blocks_k.device
        rows = torch.arange(n, device=dev).repeat_interleave(b)  # slot of each written token
        cols = small_tensor([st + j for st in starts for j in range(b)], dev)  # its position
        # (indices on two dims apart: the indexed result is [n * B, L', Hkv, ...], tokens first)
        self.q8_all[:, rows, :, cols] = q8.permute(1, 3, 0, 2, 4).reshape(n * b, *q8.shape[::2])
        self.scales_all[:, rows, :, cols] = s.permute(1, 3, 0, 2).reshape(n * b, *s.shape[::2])

    def fill_random(self, slot: int, num_tokens: int) -> None:
        """Random keys for a synthetic prefill (benchmarks: the scoring's cost, not its choices),
        from a generator seeded by the slot (the global one is left alone)."""
        for layer in self.layers:
            q8 = self.q8[layer][slot, :, :num_tokens]
            gen = torch.Generator(device=q8.device).manual_seed(1 + 1000 * slot + layer)
            vals = torch.randint(-127, 128, q8.shape, generator=gen, device=q8.device)
            q8.copy_(vals)
            self.scales[layer][slot, :, :num_tokens].fill_(1.0 / 127)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Slot compaction: slot ``src``'s first ``length`` positions -> slot ``dst``."""
        self.q8_all[:, dst, :, :length] = self.q8_all[:, src, :, :length]
        self.scales_all[:, dst, :, :length] = self.scales_all[:, src, :, :length]


def small_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A few ints on ``device`` without stalling the host: on CUDA through pinned memory, copied
    asynchronously (the pinned allocator keeps the host buffer until the copy has run)."""
    host = torch.tensor(list(values), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def select_int8(
    q: torch.Tensor,
    keys: DeviceCompactKeys,
    layer: int,
    slot0: int,
    prefix_lens: Sequence[int],
    num_selected: Sequence[int],
    tail_k: torch.Tensor,
) -> torch.Tensor:
    """The approximate top-k of rows ``slot0 ..`` (one per request) at ``layer``.

    Args:
        q: ``[n, Hq, D]`` the representative queries (device).
        keys: the int8 store; the ranked prefix of request ``i`` is its slot's positions
            ``[0, prefix_lens[i])``.
        num_selected: ``k_i <= prefix_lens[i]`` per request (0 selects nothing).
        tail_k: ``[n, Hkv, T >= 0, D]`` the always-included tail's exact keys (attended, in
            every softmax, never ranked).

    Returns:
        ``[n, Hkv, max(1, max k_i)]`` int32 positions, ascending per (request, head), -1 past
        ``k_i``. Ties in the int8 importance go either way (the rule is approximate anyway).
    """
    n, _, d = q.shape
    hkv = tail_k.shape[1]
    out = torch.full((n, hkv, max([1, *num_selected])), -1, dtype=torch.int32, device=q.device)
    s_max, k = max(prefix_lens), max(num_selected)
    if k == 0 or s_max == 0:
        return out
    x = q.float().reshape(n, hkv, -1, d)  # [n, Hkv, G, D]: KV head h's rows h*G .. h*G+G-1
    scale = d**-0.5
    lens = small_tensor(prefix_lens, q.device)
    q8 = keys.q8[layer][slot0 : slot0 + n]
    sc = keys.scales[layer][slot0 : slot0 + n]
    score = int8_scores(x, q8, sc, lens, s_max, scale)  # [n, Hkv, G, S], -inf past a length
    valid = (torch.arange(s_max, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    m = score.amax(-1, keepdim=True)
    tail = None
    if tail_k.shape[2]:
        tail = torch.matmul(x, tail_k.float().transpose(-1, -2)) * scale  # [n, Hkv, G, T]
        m = torch.maximum(m, tail.amax(-1, keepdim=True))
    e = torch.exp(score - m)
    z = e.sum(-1, keepdim=True)
    if tail is not None:
        z = z + torch.exp(tail - m).sum(-1, keepdim=True)
    imp = (e / z).sum(2).masked_fill(~valid[:, :, 0], -1.0)  # [n, Hkv, S]
    top = torch.topk(imp, k, dim=-1, sorted=True).indices  # descending importance
    ks = small_tensor(num_selected, q.device)
    keep = torch.arange(k, device=q.device)[None, None, :] < ks[:, None, None]
    top = torch.where(keep, top, s_max).sort(dim=-1).values  # kept ascending, then the pad
    out[:, :, :k] = torch.where(top < s_max, top, -1).to(torch.int32)
    return out


def int8_scores(
    x: torch.Tensor,
    q8: torch.Tensor,
    scales: torch.Tensor,
    lens: torch.Tensor,
    s_max: int,
    scale: float,
) -> torch.Tensor:
    """``score[r, h, g, s] = (x[r, h, g] . q8[r, h, s]) * scales[r, h, s] * scale`` for ``s <
    lens[r]``, -inf for ``lens[r] <= s < s_max``: ``[n, Hkv, G, s_max]`` float32.

    ``x`` ``[n, Hkv, G, D]`` float32; ``q8`` ``[n, Hkv, >= s_max, D]`` int8 and ``scales`` ``[n,
    Hkv, >= s_max]`` float32 (the store's rows), ``lens`` ``[n]`` on their device. On CUDA with
    Triton (and in the Triton interpreter), for a power-of-two head_dim, one kernel reads the int8
    keys once (:mod:`herald.offload.selection._int8_score_kernel`); elsewhere PyTorch converts
    them to float32 a chunk of requests at a time (:data:`CHUNK_BYTES`)."""
    n, hkv, g, d = x.shape
    fits = d & (d - 1) == 0 and q8.stride(3) == 1 and q8.stride(2) == d and scales.stride(2) == 1
    out = torch.empty(n, hkv, g, s_max, device=x.device)
    if fits and ((x.is_cuda and triton_enabled()) or (interpreting() and triton_available())):
        from herald.offload.selection import _int8_score_kernel as kern

        kern.int8_scores[(n * hkv, -(-s_max // BLOCK_S))](
            x.contiguous(), q8, scales, lens.to(torch.int32), out, s_max,
            q8.stride(0), q8.stride(1), scales.stride(0), scales.stride(1), scale,
            HKV=hkv, G=g, D=d, BLOCK_S=BLOCK_S, num_warps=4,
        )  # fmt: skip
        return out
    per = hkv * s_max * d * 4
    step = max(1, CHUNK_BYTES // max(per, 1))
    for i in range(0, n, step):
        j = min(n, i + step)
        k = q8[i:j, :, :s_max].float()
        out[i:j] = torch.matmul(x[i:j], k.transpose(-1, -2)) * (
            scales[i:j, :, None, :s_max] * scale
        )
    pos = torch.arange(s_max, device=x.device)
    return out.masked_fill_((pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))


def attend_selected_and_tail(
    q: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    pad: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention of ``q`` ``[n, Hq, D]`` over the rows of ``k_sel``/``v_sel`` ``[n, Hkv,
    m, D]`` not excluded by ``pad`` ``[n, m]`` (true: excluded) plus every tail row ``[n, Hkv,
    T >= 1, D]``, in float32: the selection's ``selected`` output (what the sparse pool then
    attends to). Returns ``[n, Hq, D]`` float32."""
    n, hq, d = q.shape
    hkv = tail_k.shape[1]
    x = q.float().reshape(n, hkv, hq // hkv, d)
    scale = d**-0.5
    s1 = torch.matmul(x, k_sel.float().transpose(-1, -2)) * scale  # [n, Hkv, G, m]
    s1 = s1.masked_fill(pad[:, None, None, :], float("-inf"))
    s2 = torch.matmul(x, tail_k.float().transpose(-1, -2)) * scale  # [n, Hkv, G, T]
    m = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))
    p1, p2 = torch.exp(s1 - m), torch.exp(s2 - m)
    v1 = v_sel.float().masked_fill_(pad[:, None, :, None], 0.0)  # (0 x NaN would be NaN)
    o = torch.matmul(p1, v1) + torch.matmul(p2, tail_v.float())
    o = o / (p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True))
    return o.reshape(n, hq, d)
