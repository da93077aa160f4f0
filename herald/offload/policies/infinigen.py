"""InfiniGen, adapted to once per block: a proxy on a few key channels predicts the critical KV.

**When**: during step 0 of every block, no lookahead. **Queries**: the block's B queries, on the
proxy channels only (:mod:`herald.offload.selection.proxy`: chosen offline from the weights).
**Where**: on the GPU, against a partial-key cache that keeps every prefix token's keys on those
channels (filled from the prompt, extended by every committed block). **Fetch**: the predicted
top-k rows of each offloaded layer from the CPU pool into the active pool, then sparse attention
over it like every other step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from herald.attention.base import AttentionBackend
from herald.kv.pinned import copy_to_host
from herald.offload.handoff import page_table
from herald.offload.policies.base import SelectionPolicy
from herald.offload.selection.proxy import proxy_channels, proxy_topk

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine


class InfiniGenPolicy(SelectionPolicy):
    """Proxy-channel selection at step 0 (see the module docstring)."""

    def __init__(self, core: OffloadEngine) -> None:
        super().__init__(core)
        off = core.offload
        assert off is not None
        self.chans: dict[int, torch.Tensor] = {}
        self.partial_k: dict[int, torch.Tensor] = {}
        cfg = core.config
        for layer_id in core.pool.layers:
            chans = proxy_channels(core.model.layers[layer_id], off.proxy_ratio)  # type: ignore[arg-type]
            self.chans[layer_id] = chans.to(core.device)
            self.partial_k[layer_id] = torch.zeros(
                core.max_batch_size, cfg.num_kv_heads, core.max_seq_len, chans.shape[1],
                device=core.device, dtype=core.dtype,
            )  # fmt: skip

    def device_bytes(self) -> int:
        return sum(t.nbytes for t in self.partial_k.values())

    def describe(self) -> str:
        gib = self.device_bytes() / 2**30
        return f"proxy keys on {self.core.device}: {gib:.2f} GiB"

    def step0_attention(self) -> AttentionBackend:
        return _Step0(self)

    def on_prompt_keys(self, slot: int, keys: dict[int, torch.Tensor]) -> None:
        for layer, chans in self.chans.items():
            k = keys[layer]  # [Hkv, s, D]
            idx = chans[:, None, :].expand(-1, k.shape[1], -1)
            self.partial_k[layer][slot, :, : k.shape[1]] = k.gather(2, idx)

    def on_synthetic_prefill(self, slot: int, num_tokens: int) -> None:
        for t in self.partial_k.values():
            t[slot, :, :num_tokens].normal_()

    def on_commit(self, blocks: torch.Tensor) -> None:
        core = self.core
        b, n = core.block_size, blocks.shape[2]
        for layer, chans in self.chans.items():
            blk = blocks[core.pool.layers.index(layer), 0]  # [n, Hkv, B, D]
            part = blk.gather(3, chans[None, :, None, :].expand(n, -1, b, -1))
            for i, st in enumerate(core.batch.starts()):
                self.partial_k[layer][i, :, st : st + b] = part[i]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        for t in self.partial_k.values():
            t[dst].copy_(t[src])

    def fetch(self, layer: int, q: torch.Tensor) -> None:
        """Step 0 of one layer: proxy top-k per row, the rows fetched into the active pool."""
        core = self.core
        b, buf = core.block_size, core.pool.active
        reqs, starts = core.batch.requests, core.batch.starts()
        chans = self.chans[layer]
        ranked = [st - last for st, last in zip(starts, core.last_len, strict=True)]
        picked = [max(0, min(kk, r)) for kk, r in zip(core.k_sel, ranked, strict=True)]
        hkv = core.cpu_pool.num_kv_heads
        # The picks of every request land in one device tensor and come to the host in one copy
        # per layer (NOTE: one copy per request was one host-device sync per request and layer).
        shape = (len(reqs), hkv, max([1, *picked]))
        idx = torch.full(shape, -1, dtype=torch.int32, device=q.device)
        tables = []
        for i, req in enumerate(reqs):
            part = self.partial_k[layer][i, :, : ranked[i]]
            idx[i, :, : picked[i]] = proxy_topk(q[i], part, chans, core.k_sel[i])
            tables.append(core.kv.pages(req.request_id)[: max(1, -(-ranked[i] // b))])
        # NOTE: copy-before-read: the commit's hand-off is synchronous, but any other
        # device-to-host copy into the pool still in flight must land before host reads; on
        # CUDA the picks' copy to the host waits for them too (same stream), asleep.
        idx_host = copy_to_host(idx) if core.cuda else idx
        num = torch.tensor(picked, dtype=torch.int32)
        core.gather_and_write(buf, layer, page_table(tables), idx_host, num)


class _Step0:
    """Step 0 of a block: each offloaded layer fetches its proxy top-k rows first."""

    def __init__(self, policy: InfiniGenPolicy) -> None:
        self.policy = policy

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        core = self.policy.core
        if layer_id >= core.num_dense:
            self.policy.fetch(layer_id, q)
        return core.attn.forward(layer_id, q, k, v)
