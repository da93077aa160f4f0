"""Dense engine: the full KV cache on one device, exact attention (docs/ARCHITECTURE.md, "Modes").

The strong baseline every other mode is compared against, and the reference of the budget-1.0
invariant. Every step is a block boundary: aborted rows leave, the scheduler's prefill chunks run
(whole prompt blocks, straight into the request's slot of the dense cache), then one batched
B-token forward of every running request (denoising steps and commit forwards share it) and the
block-diffusion bookkeeping of :class:`~herald.engine.decode_batch.DecodeBatch`. Rows are not in
lockstep: each request is at its own block.
"""

from __future__ import annotations

import time

import torch

from herald.attention.sdpa import padded_kv_len
from herald.attention.slots import SlotAttention
from herald.config import EngineConfig
from herald.engine.base import Engine
from herald.engine.hooks import EngineHooks
from herald.engine.request import Request, RequestStatus
from herald.engine.scheduler import PrefillChunk
from herald.kv.dense import DenseKVCache
from herald.kv.manager import KVManager
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig


class DenseEngine(Engine):
    """Block-diffusion decoding over a dense KV cache (see :class:`~herald.engine.base.Engine`).

    ``engine_config.offload`` must be None. The cache holds ``max_batch_size`` slots of
    ``max_seq_len`` tokens (rounded up to a multiple of ``kv_pad``, so that a padded key length
    is never clipped to the capacity, which would make it depend on the engine's size).

    Raises ValueError for an offloading config; torch.OutOfMemoryError when the cache does not
    fit.
    """

    def __init__(
        self,
        model: BlockDiffusionLM,
        config: ModelConfig,
        engine_config: EngineConfig,
        hooks: EngineHooks | None = None,
    ) -> None:
        if engine_config.offload is not None:
            raise ValueError("DenseEngine runs no offloading mode; use OffloadEngine")
        super().__init__(model, config, engine_config, hooks)
        cap = padded_kv_len(self.max_seq_len, self.kv_pad)
        self.cache = DenseKVCache(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            self.max_batch_size,
            cap,
            self.device,
            self.dtype,
        )
        self.attn = SlotAttention(list(self.cache.k), list(self.cache.v), kv_pad=self.kv_pad)
        kv = KVManager(self.max_batch_size, self.block_size, prefill_in_slot=True)
        kv.add_store(self.cache, self.cache.num_bytes)
        self._init_scheduler(kv)

    # -- boundary -------------------------------------------------------------------------------
    def _prefill(self, chunk: PrefillChunk) -> None:
        req = chunk.request
        # NOTE: the slot now, not the chunk's: a request admitted at this boundary can move to
        # another slot when an earlier one joins (KVManager.join).
        slot = self.kv.slot(req.request_id)
        synthetic = self.hooks.synthetic_prefill
        if synthetic is not None:
            synthetic.fill_rows(self.cache.tensors(), slot, chunk.start, chunk.end)
            return
        ids = torch.tensor(req.prompt_ids[chunk.start : chunk.end], device=self.device)
        for s in range(chunk.start, chunk.end, self.prefill_chunk):
            e = min(chunk.end, s + self.prefill_chunk)
            self.attn.prepare([s], e - s, block_size=self.block_size, slot_offset=slot)
            pos = torch.arange(s, e, device=self.device)[None]
            # Prefill needs no logits: the final norm is wasted work but negligible.
            self.model(ids[None, s - chunk.start : e - chunk.start], pos, self.attn)

    def _join(self, chunk: PrefillChunk) -> None:
        req = chunk.request
        # Rows may have left while it prefilled: its KV moves down to the row it joins as.
        self.kv.join(req.request_id, len(self.batch), req.layout.num_prefill_tokens)
        self.batch.add(req)

    def _reset_after_failure(self) -> None:
        self._sync()

    # -- one step -------------------------------------------------------------------------------
    def _step(self) -> list[Request]:
        aborted = [
            i
            for i, r in enumerate(self.batch.requests)
            if r.status == RequestStatus.FINISHED_ABORTED
        ]
        self._release_rows(aborted)
        self._admit()
        if not len(self.batch):
            return []
        t0 = time.perf_counter()
        input_ids, positions = self.batch.inputs()
        self.attn.prepare(self.batch.starts(), self.block_size)
        hidden = self.runner.forward(input_ids, positions, self.attn)
        if self.engine_config.check_finite and not bool(hidden.isfinite().all()):
            self.stats.num_nonfinite_steps += 1
        finished_rows, _, _ = self.batch.apply(self.model, hidden)
        finished = [self.batch.requests[i] for i in finished_rows]
        self._release_rows(finished_rows)
        self.stats.num_forwards += 1
        self.stats.num_batch_rows += len(input_ids)
        self.stats.step_batch_sizes.append(len(input_ids))
        dt = time.perf_counter() - t0
        self.stats.step_seconds.append(dt)
        self.stats.decode_seconds += dt
        return finished
