"""Engine: the one interface every engine offers, and what they share.

An engine owns a model, a :class:`~herald.kv.manager.KVManager` (GPU slots, CPU pages), a
:class:`~herald.engine.scheduler.Scheduler` (admission), a
:class:`~herald.engine.decode_batch.DecodeBatch` (the running requests' blocks) and a
:class:`~herald.engine.runner.ModelRunner` (forwards, CUDA graphs). Each :meth:`Engine.step` is
vLLM's ``schedule() -> execute() -> update()``: at a block boundary the scheduler picks the prompt
chunks to prefill, the engine runs them and one batched forward, and the decode batch applies the
result (accepts tokens, finishes requests, frees their KV).

The two engines differ in where a forward's KV lives and when their boundaries are:
:class:`~herald.engine.dense.DenseEngine` (full KV on the model device; every step is a
boundary) and :class:`~herald.offload.engine.OffloadEngine` (full KV in CPU memory; the batch
denoises each block in lockstep). Callers (the CLI, the server, benchmarks) use only this
interface: :meth:`add_request`, :meth:`abort`, :meth:`step`, :meth:`has_unfinished`,
:meth:`usage`, :attr:`stats`, :meth:`close`.

Threads: :meth:`add_request`, :meth:`abort` and the read-only properties
are safe from any thread; :meth:`step`, :meth:`generate` and :meth:`close` belong to the one
thread that steps the engine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from herald.config import EngineConfig, SamplingParams
from herald.engine.decode_batch import DecodeBatch
from herald.engine.hooks import EngineHooks
from herald.engine.request import Request, RequestStatus, new_request
from herald.engine.runner import ModelRunner
from herald.engine.scheduler import PrefillChunk, Scheduler
from herald.engine.stats import EngineStats
from herald.kv.manager import KVManager, KVUsage
from herald.models.base import BlockDiffusionLM
from herald.models.config import ModelConfig


class Engine(ABC):
    """Block-diffusion decoding of many requests; see the module docstring.

    Args:
        model: a :class:`BlockDiffusionLM` already on its device.
        config: the model's config (block size, mask id, EOS ids, vocabulary).
        engine_config: sizes and switches (:class:`~herald.config.EngineConfig`).
        hooks: test and benchmark instrumentation (:mod:`herald.engine.hooks`); None for serving.

    Raises ValueError for a bad ``engine_config``.
    """

    def __init__(
        self,
        model: BlockDiffusionLM,
        config: ModelConfig,
        engine_config: EngineConfig,
        hooks: EngineHooks | None = None,
    ) -> None:
        engine_config.validate()
        self.model, self.config, self.engine_config = model, config, engine_config
        self.hooks = hooks or EngineHooks()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda = self.device.type == "cuda"
        b = self.block_size = config.block_size
        self.max_seq_len = -(-engine_config.max_seq_len // b) * b
        self.max_batch_size = engine_config.max_batch_size
        self.kv_pad = engine_config.kv_pad
        # One prefill forward's tokens: prefill_chunk_tokens, or the per-boundary budget when it
        # is smaller, in whole blocks; prompts are prefilled in these pieces at fixed positions.
        piece = engine_config.prefill_chunk_tokens
        if engine_config.max_prefill_tokens is not None:
            piece = min(piece, engine_config.max_prefill_tokens)
        self.prefill_chunk = max(b, (piece // b) * b)
        self.batch = DecodeBatch(b, config.mask_token_id, config.eos_token_ids, self.device)
        self.stats = EngineStats()
        self.runner = ModelRunner(
            model, use_cuda_graph=engine_config.use_cuda_graph, is_moe=config.is_moe
        )

    def _init_scheduler(self, kv: KVManager) -> None:
        """Called by a subclass once its KV manager exists."""
        self.kv = kv
        self.scheduler = Scheduler(
            kv,
            block_size=self.block_size,
            max_batch_size=self.max_batch_size,
            max_prefill_tokens=self.engine_config.max_prefill_tokens,
            max_waiting=self.engine_config.max_waiting,
            piece_tokens=self.prefill_chunk,
        )

    # -- what it is -----------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """``dense`` or the offloading mode (``herald``, ``mage``, ``infinigen``)."""
        return self.engine_config.mode

    @property
    def kv_budget(self) -> float:
        """Fraction of the prefix each block attends to (1.0 for dense)."""
        off = self.engine_config.offload
        return 1.0 if off is None else off.kv_budget

    @property
    def max_prefill_tokens(self) -> int | None:
        return self.scheduler.max_prefill_tokens

    # -- requests (any thread) ------------------------------------------------------------------
    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        """Queue a prompt; it joins the batch at a block boundary.

        Raises ValueError for bad params or an empty prompt,
        :class:`~herald.kv.manager.RequestTooLarge` when it can never run here (context,
        vocabulary, CPU pool), :class:`~herald.engine.scheduler.QueueFullError` when
        ``max_waiting`` requests wait already. Nothing is queued when it raises.
        """
        cfg = self.config
        req = new_request(
            list(prompt_ids), params, cfg.block_size, self.max_seq_len, cfg.vocab_size,
            cfg.mask_token_id,
        )  # fmt: skip
        self.scheduler.add(req)  # checks the CPU pages and the queue bound
        return req

    def abort(self, request: Request) -> None:
        """Cancel ``request``: a waiting one leaves the queue now; one being prefilled or running
        is marked ``FINISHED_ABORTED`` at the next step, and its KV is freed at the next block
        boundary (it is never returned by :meth:`step`). A finished request is left as it is."""
        self.scheduler.abort(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_waiting() or len(self.batch) > 0

    @property
    def num_running(self) -> int:
        return len(self.batch)

    @property
    def num_waiting(self) -> int:
        """Requests queued or being prefilled."""
        return self.scheduler.num_waiting

    @property
    def waiting(self) -> list[Request]:
        """The queue, head first (a snapshot; the request being prefilled not included)."""
        return self.scheduler.waiting

    def usage(self) -> KVUsage:
        return self.kv.usage()

    def describe(self) -> str:
        """One line for a start-up log: the mode and where the KV lives."""
        u = self.usage()
        return (
            f"{self.mode} engine: {u.gpu_slots_total} KV slots on {self.device} of "
            f"{self.max_seq_len} tokens, "
            f"{u.gpu_kv_bytes / 2**30:.2f} GiB"
        )

    # -- stepping (engine thread) ---------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one forward of the running batch (admitting waiting requests at a boundary) and
        return the requests that finished (aborted ones are not returned).

        If it raises, every request it was running or prefilling is finished with
        ``FINISHED_ERROR`` (``request.error`` holds the exception) and its KV freed, so the
        engine is consistent and empty of them; waiting requests stay queued.
        """
        try:
            self.scheduler.take_aborts()
            finished = self._step()
        except BaseException as exc:
            self._fail_running(exc)
            raise
        finally:
            self.scheduler.set_num_running(len(self.batch))
        self.stats.num_generated_tokens += sum(len(r.output_ids) for r in finished)
        self.stats.trim()
        return finished

    @abstractmethod
    def _step(self) -> list[Request]: ...

    @abstractmethod
    def _reset_after_failure(self) -> None:
        """Bring the engine's own state back to an empty batch (after :meth:`_fail_running`
        freed the requests' KV)."""

    def _fail_running(self, exc: BaseException) -> None:
        self._reset_after_failure()
        for req in self._drop_all():
            self._fail_request(req, exc)

    def _fail_request(self, req: Request, exc: BaseException) -> None:
        """``req`` ends with ``FINISHED_ERROR`` (unless it had finished) and its KV is freed."""
        self.kv.free(req.request_id)
        if not req.status.finished:
            req.status, req.error = RequestStatus.FINISHED_ERROR, exc

    def _drop_all(self) -> list[Request]:
        """Every running and prefilling request leaves the engine now, its KV freed; returns
        them."""
        dropped = self.scheduler.drop_prefilling()
        reqs = [*self.batch.requests, *([dropped] if dropped is not None else [])]
        for req in reqs:
            self.kv.free(req.request_id)
        self.batch.remove(list(range(len(self.batch))))
        return reqs

    def _release_rows(self, rows: list[int]) -> list[tuple[int, int]]:
        """Batch rows leave: their slots and pages come back and the remaining rows compact
        (the copies run on the current stream, after the forwards that wrote the slots).
        Returns the row moves, for per-row state an engine keeps besides the batch."""
        if not rows:
            return []
        running = [(r.request_id, r.block_start) for r in self.batch.requests]
        moves = self.kv.release(running, rows)
        self.batch.remove(rows)
        return moves

    def _admit(self) -> None:
        """At a block boundary: schedule and run this boundary's prefill chunks; a request
        whose last chunk ran joins the batch (:meth:`_join`)."""
        chunks = self.scheduler.schedule(len(self.batch), self._forwards_per_boundary())
        for i, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            try:
                self._prefill(chunk)
                self._sync()
                if chunk.last:
                    # Prefill time too: an offloading engine's join moves the prompt's KV to
                    # the CPU pool and selects the first block.
                    self._join(chunk)
                    self._sync()
            except BaseException as exc:
                # This chunk's request and those of the chunks not yet run (admitted too) fail;
                # a join that failed may have taken the request's slot (freed here too).
                st = self.scheduler.prefilling
                if st is not None and any(st.request is c.request for c in chunks[i:]):
                    self.scheduler.drop_prefilling()
                for c in chunks[i:]:
                    self._fail_request(c.request, exc)
                raise
            self.stats.num_prefill_tokens += chunk.end - chunk.start
            if chunk.last:
                self.stats.num_prompt_tokens += chunk.request.prompt_len
            self.stats.prefill_seconds += time.perf_counter() - t0

    def _forwards_per_boundary(self) -> int:
        """Decode forwards of the running batch per block boundary, the scale of the prefill
        budget (:meth:`Scheduler.schedule`): 1 where every forward is a boundary."""
        return 1

    @abstractmethod
    def _prefill(self, chunk: PrefillChunk) -> None:
        """Prefill one chunk of a prompt (the scheduler allocated its KV)."""

    @abstractmethod
    def _join(self, chunk: PrefillChunk) -> None:
        """The prompt is prefilled: the request joins the batch as its last row."""

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[Request]:
        """Decode every prompt to completion; returns the requests in prompt order."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while self.has_unfinished():
            self.step()
        self._sync()
        return reqs

    def close(self) -> None:
        """Free every request's KV and the engine's threads and pinned memory (idempotent)."""
        self._drop_all()
        self._sync()
        self.runner.release()
