"""Dense engine: the full KV cache on one device, exact attention (DESIGN §4 "dense").

The strong baseline every other mode is compared against, and the reference for the budget-1.0
invariant. One :meth:`step` is one batched B-token forward over every running request (denoising
steps and commit forwards share it) followed by the block-diffusion bookkeeping of
:class:`~herald.diffusion.batch.DecodeBatch`. New requests are prefilled (whole prompt blocks, in
chunks) between steps; with ``max_prefill_tokens`` at most that many prompt tokens per step, so a
long prompt is prefilled over several steps while the running requests keep decoding.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from herald.config import SamplingParams
from herald.diffusion.batch import DecodeBatch
from herald.engine.cuda_graph import PiecewiseGraphForward
from herald.engine.request import Request, RequestStatus, abort_request, new_request
from herald.kv.dense_cache import (
    DEFAULT_KV_PAD,
    DenseAttention,
    DenseKVCache,
    check_kv_pad,
    padded_kv_len,
)
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig


@dataclass
class EngineStats:
    """Counters of one engine's life, all in tokens / seconds."""

    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_forwards: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_batch_sizes: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    num_nonfinite_steps: int = 0


class DenseEngine:
    """Block-diffusion decoding over a dense KV cache.

    Args:
        model: a :class:`BlockDiffusionLM` already on ``device``.
        config: the model's config (block size, mask id, eos ids come from here).
        max_batch_size: running requests at most (KV slots).
        max_seq_len: tokens per request at most (prompt + max_new_tokens, rounded up to blocks).
        prefill_chunk_tokens: prompt tokens per prefill forward (rounded down to whole blocks).
        max_prefill_tokens: prompt tokens prefilled per step at most (rounded down to whole
            blocks, at least one block); one request is prefilled at a time and joins the batch
            after its last chunk. None: every admitted prompt is prefilled whole before the step.
        check_finite: count forwards whose hidden states hold NaN/inf (costs a reduction).
        random_prefill: fill the prompt's KV with random values instead of running the prompt
            forward (decode-throughput benchmarks only: decode speed does not depend on values).
        kv_pad: key lengths rounded up to a multiple of this, masked per row (0 = off; default
            :data:`~herald.kv.dense_cache.DEFAULT_KV_PAD`: outputs independent of the batch's
            other requests, one cuDNN plan per ``kv_pad`` tokens; see
            :class:`~herald.kv.dense_cache.SlotAttention`).
        use_cuda_graph: on CUDA, replay everything but attention from piecewise CUDA graphs
            captured once per batch size (:mod:`herald.engine.cuda_graph`).

    Raises:
        ValueError from :meth:`add_request` when a request cannot fit (``max_seq_len``).
    """

    def __init__(
        self,
        model: BlockDiffusionLM,
        config: ModelConfig,
        *,
        max_batch_size: int,
        max_seq_len: int,
        prefill_chunk_tokens: int = 4096,
        max_prefill_tokens: int | None = None,
        check_finite: bool = False,
        random_prefill: bool = False,
        kv_pad: int = DEFAULT_KV_PAD,
        use_cuda_graph: bool = True,
    ) -> None:
        self.model = model
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 or None, got {max_prefill_tokens}")
        self.config = config
        check_kv_pad(kv_pad)
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}"
            )
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        b = config.block_size
        self.max_seq_len = -(-max_seq_len // b) * b
        # With kv_pad the capacity is a whole multiple of it, so a padded key length is never
        # clipped to the capacity (which would make it depend on the engine's size).
        cap = padded_kv_len(self.max_seq_len, kv_pad)
        self.cache = DenseKVCache(config, max_batch_size, cap, self.device, self.dtype)
        self.attn = DenseAttention(self.cache, kv_pad=kv_pad)
        self.batch = DecodeBatch(b, config.mask_token_id, config.eos_token_ids, self.device)
        self.waiting: deque[Request] = deque()
        self.max_batch_size = max_batch_size
        self.prefill_chunk = max(b, (prefill_chunk_tokens // b) * b)
        self.max_prefill_tokens = (
            None if max_prefill_tokens is None else max(b, (max_prefill_tokens // b) * b)
        )
        # The request being prefilled over several steps: its KV slot (always >= the batch size:
        # running rows only leave while it prefills) and the prompt tokens done so far.
        self._prefilling: Request | None = None
        self._prefill_slot = 0
        self._prefill_pos = 0
        self.stats = EngineStats()
        self.check_finite = check_finite
        self.random_prefill = random_prefill
        # The MoE reference path (non-bf16 MoE models) synchronises with the host and cannot be
        # captured; only the grouped_mm path (bf16 on CUDA) is graph-safe.
        graph_safe = not config.is_moe or self.dtype == torch.bfloat16
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda" and graph_safe
        self._graphs: dict[int, PiecewiseGraphForward] = {}
        self._eager_batch_sizes: set[int] = set()

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a prompt. Raises ValueError if it can never fit or holds out-of-vocab ids."""
        req = new_request(
            list(prompt_ids),
            params,
            self.config.block_size,
            self.max_seq_len,
            self.config.vocab_size,
        )
        self.waiting.append(req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or len(self.batch) > 0 or self._prefilling is not None

    def abort(self, request: Request) -> None:
        """Cancel ``request``: a waiting one leaves the queue now; a running one is marked
        ``FINISHED_ABORTED`` and its row and KV slot are freed at the next step boundary
        (compacted exactly as finished rows are). A finished request is left as it is."""
        abort_request(request, self.waiting)

    def _drop_aborted(self) -> None:
        rows = [
            i
            for i, r in enumerate(self.batch.requests)
            if r.status == RequestStatus.FINISHED_ABORTED
        ]
        self._remove_rows(rows)

    def _remove_rows(self, rows: list[int]) -> None:
        """Drop batch rows and compact the KV slots to match.

        NOTE: a request can move twice (4 -> 3, then 3 -> 1 when rows 1 and 3 both leave), so
        each move's length comes from the request that sat in ``src`` at that point, not from
        the final ``requests[dst]`` (which may no longer exist)."""
        slots: list[Request | None] = list(self.batch.requests)
        for src, dst in self.batch.remove(rows):
            moved = slots[src]
            assert moved is not None
            # Same stream as the forward that wrote the source slot, so the copy is ordered
            # after it; the moved request's committed length is its block_start.
            self.cache.move_slot(src, dst, moved.block_start)
            slots[dst], slots[src] = moved, None

    # -- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, req: Request, slot: int, start: int, end: int) -> None:
        """Forward prompt tokens ``[start, end)`` (whole blocks) of ``req`` into KV slot
        ``slot``, in chunks of ``prefill_chunk_tokens``; tokens before ``start`` are there."""
        if self.random_prefill:
            for t in self.cache.k + self.cache.v:
                t[slot, :, start:end].normal_()
            self.stats.num_prefill_tokens += end - start
            return
        ids = torch.tensor(req.prompt_ids[start:end], dtype=torch.long, device=self.device)
        for s in range(start, end, self.prefill_chunk):
            e = min(end, s + self.prefill_chunk)
            self.attn.prepare([s], e - s, block_size=self.config.block_size, slot_offset=slot)
            pos = torch.arange(s, e, device=self.device)[None]
            # Prefill needs no logits: the final norm is wasted work but negligible.
            self.model(ids[None, s - start : e - start], pos, self.attn)
            self.stats.num_forwards += 1
        self.stats.num_prefill_tokens += end - start

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, within ``max_prefill_tokens`` this step."""
        budget = self.max_prefill_tokens
        while True:
            req = self._prefilling
            if req is not None and req.status.finished:  # aborted while prefilling
                self._prefilling = req = None
            if req is None:
                if not self.waiting or len(self.batch) >= self.max_batch_size:
                    return
                req = self._prefilling = self.waiting.popleft()
                self._prefill_slot, self._prefill_pos = len(self.batch), 0
            n = req.layout.num_prefill_tokens
            end = n if budget is None else min(n, self._prefill_pos + budget)
            if end > self._prefill_pos:
                t0 = time.perf_counter()
                try:
                    self._prefill(req, self._prefill_slot, self._prefill_pos, end)
                    self._sync()
                except BaseException:
                    self._prefilling = None  # the request is dropped; the caller fails it
                    raise
                self.stats.prefill_seconds += time.perf_counter() - t0
                if budget is not None:
                    budget -= end - self._prefill_pos
                self._prefill_pos = end
            if self._prefill_pos < n:
                return  # budget spent; the rest at the next step
            row = len(self.batch)
            if self._prefill_slot != row:
                # Rows left while it prefilled: its KV moves down to the row it joins as.
                self.cache.move_slot(self._prefill_slot, row, n)
            self.batch.add(req)
            self._prefilling = None
            if budget is not None and budget <= 0:
                return

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- decode ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Drop aborted rows, admit waiting requests, run one batched forward, return the
        requests that finished (aborted ones are not returned)."""
        self._drop_aborted()
        self._admit()
        if not len(self.batch):
            return []
        t0 = time.perf_counter()
        input_ids, positions = self.batch.inputs()
        hidden = self._forward(input_ids, positions, self.batch.starts())
        if self.check_finite and not bool(hidden.isfinite().all()):
            self.stats.num_nonfinite_steps += 1
        finished_rows, _, _ = self.batch.apply(self.model, hidden)
        finished = [self.batch.requests[i] for i in finished_rows]
        self._remove_rows(finished_rows)
        self.stats.num_forwards += 1
        self.stats.step_batch_sizes.append(len(input_ids))
        self.stats.num_generated_tokens += sum(len(r.output_ids) for r in finished)
        dt = time.perf_counter() - t0
        self.stats.step_seconds.append(dt)
        self.stats.decode_seconds += dt
        return finished

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """One B-token forward of every running request; final-normed hidden [bs, B, H]."""
        self.attn.prepare(starts, self.config.block_size)
        if not self.use_cuda_graph:
            return self.model(input_ids, positions, self.attn)
        bs = len(starts)
        runner = self._graphs.get(bs)
        if runner is None:
            if bs not in self._eager_batch_sizes:
                # NOTE: one eager forward at each new batch size before capturing it: cuBLAS /
                # cuDNN handles and workspaces, and torch.compile's kernels for this shape
                # (herald.layers.fusion), must exist before capture. It is this step's forward.
                self._eager_batch_sizes.add(bs)
                return self.model(input_ids, positions, self.attn)
            runner = self._graphs[bs] = PiecewiseGraphForward(self.model, bs, len(input_ids[0]))
        return runner.forward(input_ids, positions, self.attn)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        on_step: Callable[[DenseEngine], None] | None = None,
    ) -> list[Request]:
        """Decode every prompt to completion; returns the requests in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
            if on_step is not None:
                on_step(self)
        self._sync()
        return reqs
