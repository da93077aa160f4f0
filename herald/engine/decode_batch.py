"""DecodeBatch: the block-diffusion state of the running requests, shared by every engine.

Owns, per running request (row ``i`` = GPU KV slot ``i``), the current block's tokens, mask bits
and per-position log-probabilities on the model's device, and implements one denoising
iteration's bookkeeping (docs/ARCHITECTURE.md, "Block diffusion decoding"):

1. :meth:`inputs` gives the forward's ``input_ids`` / ``positions`` / per-row start positions.
   A row whose block has no masks left is in its *commit forward*: the same B-token forward on the
   clean block, whose KV the engine keeps as the committed prefix.
2. :meth:`apply` takes the final hidden states, computes logits only at masked positions, samples,
   applies the unmask policy and returns the rows that finished (EOS / stop token /
   max_new_tokens) or committed, so the engine can free or advance them.

Host synchronisation: at most one per step. The host mirrors each row's count of masks left
(:attr:`DecodeBatch.num_masked`: from the previous step's transfer, or from a fresh block's
prompt tail), so which rows commit, how many positions are masked and how the sampled positions
split by row need no device read; per-row values go host -> device from pinned memory, which
does not wait for the device; and a step that denoised ends with ONE packed device -> host
transfer (:func:`_fetch`) of the new counts, the blocks' tokens and log-probabilities (and the
alternatives rows asked for). A step of commit forwards only makes none.

Engines differ only in how the forward attends (dense cache, sparse pools, ...).
"""

from __future__ import annotations

import itertools
import random

import torch

from herald.diffusion.sampler import sample, top_logprobs
from herald.diffusion.unmask import min_accept_count, select_unmask
from herald.engine.request import Request, RequestStatus
from herald.kv.manager import compact_moves
from herald.models.base import BlockDiffusionLM

TopAlternatives = list[list[tuple[int, float]]]
"""Per output position, the most likely (token id, logprob) pairs, most likely first."""


_FRESH = random.SystemRandom()
"""Seeds of unseeded sampled requests."""


class DecodeBatch:
    """Rows of running requests. ``requests[i]`` owns row i of every tensor (and KV slot i)."""

    def __init__(
        self,
        block_size: int,
        mask_token_id: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.device = torch.device(device)
        self.requests: list[Request] = []
        self.tokens = torch.empty(0, block_size, dtype=torch.long, device=self.device)
        self.masked = torch.empty(0, block_size, dtype=torch.bool, device=self.device)
        # log of the sampler's probability of each accepted token, at the step it was accepted
        self.logprobs = torch.empty(0, block_size, dtype=torch.float32, device=self.device)
        self.num_masked: list[int] = []
        """Masks left in each row's block, on the host (equal to ``masked.sum(-1)``)."""
        # (logprobs [B, n], ids [B, n]) per request asking for n alternatives, by id(request)
        self._top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._arange = torch.arange(block_size, device=self.device)

    def __len__(self) -> int:
        return len(self.requests)

    def any_masked(self) -> bool:
        """Some row still has a mask (from the host mirror: no device read)."""
        return any(self.num_masked)

    # -- membership -----------------------------------------------------------------------------
    def _fresh_host(self, req: Request) -> tuple[torch.Tensor, int]:
        """The tokens of the block at req.block_start, on the host (prompt tokens where the
        prompt reaches, masks elsewhere), and the prompt tail's length in it."""
        b = self.block_size
        toks = torch.full((b,), self.mask_token_id, dtype=torch.long)
        tail = req.prompt_ids[req.block_start : req.block_start + b]
        if tail:
            toks[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        return toks, len(tail)

    def fresh_block(self, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """Block at req.block_start: prompt tokens where the prompt reaches, masks elsewhere
        (tokens [B] int64 and mask bits [B] bool on the device)."""
        toks, tail = self._fresh_host(req)
        return to_device(toks, self.device), self._arange >= tail

    def add(self, req: Request) -> int:
        """Append ``req`` as the last row; returns its row (= KV slot)."""
        toks, tail = self._fresh_host(req)
        self.tokens = torch.cat([self.tokens, to_device(toks, self.device)[None]])
        self.masked = torch.cat([self.masked, (self._arange >= tail)[None]])
        lp = torch.zeros(1, self.block_size, dtype=torch.float32, device=self.device)
        self.logprobs = torch.cat([self.logprobs, lp])
        self.num_masked.append(self.block_size - tail)
        self.requests.append(req)
        req.status = RequestStatus.RUNNING
        req.steps_in_block = 0
        if not req.params.greedy and req.generator is None:
            req.generator = torch.Generator(device=self.device)
            seed = req.params.seed
            # NOTE: an unseeded request gets a fresh seed from the OS: equal unseeded requests
            # must not all draw the same sample (OpenAI and vLLM behave so).
            req.generator.manual_seed(seed if seed is not None else _FRESH.getrandbits(63))
        return len(self.requests) - 1

    def remove(self, rows: list[int]) -> list[tuple[int, int]]:
        """Drop ``rows``; the last rows move into the holes so rows stay ``0..n-1``.

        Returns the (src, dst) row moves (:func:`~herald.kv.manager.compact_moves`, the moves
        the KV manager makes in the KV slots), in order.
        """
        for i in set(rows):
            self._top.pop(id(self.requests[i]), None)
        moves = compact_moves(len(self.requests), rows)
        for src, dst in moves:
            for t in (self.tokens, self.masked, self.logprobs):
                t[dst] = t[src]
            self.requests[dst] = self.requests[src]
            self.num_masked[dst] = self.num_masked[src]
        n = len(self.requests) - len(set(rows))
        del self.requests[n:], self.num_masked[n:]
        self.tokens = self.tokens[:n]
        self.masked = self.masked[:n]
        self.logprobs = self.logprobs[:n]
        return moves

    # -- one iteration --------------------------------------------------------------------------
    def starts(self) -> list[int]:
        return [r.block_start for r in self.requests]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [bs, B] int64 and ``positions`` [bs, B] int64 on the device."""
        st = to_device(torch.tensor(self.starts(), dtype=torch.long), self.device)
        return self.tokens, st[:, None] + self._arange[None, :]

    def apply(
        self,
        model: BlockDiffusionLM,
        hidden: torch.Tensor,
        *,
        advance_clean: bool = True,
        want_draft: bool = False,
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """Sample at the masked positions and accept tokens; advance committed rows.

        Waits for the device once, at the end, and only when some row had a mask.

        Args:
            model: for ``compute_logits``.
            hidden: [bs, B, hidden_size], final-normed hidden states of this forward (extra
                positions past B, e.g. a fused draft group, are ignored).
            advance_clean: rows that had no mask before this forward ran their commit forward:
                move them to their next block. False for engines that commit a whole batch in
                lockstep (they call :meth:`advance`).
            want_draft: also return the draft of every row's block (HERALD §IV-A1): the argmax
                at every still-masked position, the accepted token elsewhere.

        Returns:
            (finished_rows, committed_rows, draft [bs, B] int64 or None). Finished requests have
            their status and output set.
        """
        b = self.block_size
        hidden = hidden[:, :b]
        counts = list(self.num_masked)
        committing = [i for i, n in enumerate(counts) if n == 0] if advance_clean else []
        argmax_all = None
        if want_draft:
            argmax_all = model.compute_logits(hidden).argmax(dim=-1)  # [bs, B]
        denoised = None
        if any(counts):
            denoised = self._denoise(model, hidden, counts)
        draft = None
        if argmax_all is not None:
            draft = torch.where(self.masked, argmax_all, self.tokens)
        finished = [] if denoised is None else self._collect(counts, *denoised)
        self.advance(committing)
        return finished, committing, draft

    def advance(self, rows: list[int]) -> None:
        """Move ``rows`` to their next block (after their commit forward)."""
        if not rows:
            return
        b, packed = self.block_size, []
        for i in rows:
            req = self.requests[i]
            req.block_start += b
            req.steps_in_block = 0
            toks, tail = self._fresh_host(req)
            self.num_masked[i] = b - tail
            packed.append(torch.cat([torch.tensor([i, tail]), toks]))
        # One host -> device copy: [row, prompt-tail length, B tokens] per row.
        dev = to_device(torch.stack(packed), self.device)
        idx = dev[:, 0]
        self.tokens[idx] = dev[:, 2:]
        self.masked[idx] = self._arange[None, :] >= dev[:, 1:2]

    def _denoise(
        self, model: BlockDiffusionLM, hidden: torch.Tensor, counts: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """Sample at every masked position and accept, on the device without waiting for it.

        Returns the rows' mask counts before the step ([bs], device) and the rows whose
        alternatives were recorded.
        """
        masked = self.masked
        # The positions in row-major order, as nonzero() gives them; their number is known on
        # the host, so the shape needs no device read.
        idx = torch.nonzero_static(masked, size=sum(counts))
        rows, cols = idx[:, 0], idx[:, 1]
        logits = model.compute_logits(hidden[rows, cols])  # [N, V] float32, N = masked positions
        cand = torch.zeros_like(self.tokens)
        conf = torch.zeros(masked.shape, dtype=torch.float32, device=self.device)
        starts = [0, *itertools.accumulate(counts)]  # row i's positions: starts[i]..starts[i+1]
        asks: list[tuple[int, slice, tuple[torch.Tensor, torch.Tensor]]] = []
        if all(r.params.greedy for r in self.requests):
            s = sample(logits, self.requests[0].params, self.mask_token_id)
            cand[rows, cols] = s.tokens
            conf[rows, cols] = s.conf
            for i, req in enumerate(self.requests):
                n, k = counts[i], req.params.top_logprobs
                if n and k:
                    sl = slice(starts[i], starts[i + 1])
                    asks.append((i, sl, top_logprobs(s.probs[sl], k)))
        else:
            # Sampling draws from each request's own generator, in row order of its positions.
            for i, req in enumerate(self.requests):
                n, k = counts[i], req.params.top_logprobs
                if n == 0:
                    continue
                sl = slice(starts[i], starts[i + 1])
                s = sample(logits[sl], req.params, self.mask_token_id, req.generator)
                cand[rows[sl], cols[sl]] = s.tokens
                conf[rows[sl], cols[sl]] = s.conf
                if k:
                    asks.append((i, sl, top_logprobs(s.probs, k)))
        num_masked = masked.sum(-1)
        accept = self._accept(conf, masked, num_masked)
        self.tokens = torch.where(accept, cand, self.tokens)
        self.logprobs = torch.where(accept, conf.log(), self.logprobs)
        self.masked = masked & ~accept
        for i, sl, (lp, ids) in asks:
            self._record_top(i, cols[sl], accept[i, cols[sl]], lp, ids)
        return num_masked, [i for i, _, _ in asks]

    def _accept(
        self, conf: torch.Tensor, masked: torch.Tensor, num_masked: torch.Tensor
    ) -> torch.Tensor:
        """The unmask policy's accepted positions [bs, B] bool."""
        reqs, dev = self.requests, self.device
        steps_done = to_device(torch.tensor([r.steps_in_block for r in reqs]), dev)
        fixed = to_device(torch.tensor([r.params.num_denoise_steps or 0 for r in reqs]), dev)
        thr = to_device(torch.tensor([r.params.threshold for r in reqs], dtype=torch.float32), dev)
        k_min = min_accept_count(num_masked, steps_done, fixed)
        return select_unmask(conf, masked, thr, k_min, fixed == 0)

    def _record_top(
        self,
        row: int,
        cols: torch.Tensor,
        accepted: torch.Tensor,
        lp: torch.Tensor,
        ids: torch.Tensor,
    ) -> None:
        """Keep the alternatives of the positions ``cols`` of ``row`` that were accepted."""
        key = id(self.requests[row])
        if key not in self._top:
            shape = (self.block_size, lp.shape[1])
            self._top[key] = (
                torch.full(shape, float("-inf"), dtype=torch.float32, device=self.device),
                torch.zeros(shape, dtype=torch.long, device=self.device),
            )
        buf_lp, buf_ids = self._top[key]
        acc = accepted[:, None]
        buf_lp[cols] = torch.where(acc, lp, buf_lp[cols])
        buf_ids[cols] = torch.where(acc, ids, buf_ids[cols])

    def _collect(self, counts: list[int], before: torch.Tensor, top_rows: list[int]) -> list[int]:
        """The step's one device -> host transfer, then the host's bookkeeping: new mask counts,
        completed blocks, finished rows (returned)."""
        bs, b = len(counts), self.block_size
        tops = [self._top[id(self.requests[i])] for i in top_rows]
        parts = [before, self.masked.sum(-1), self.tokens, self.logprobs]
        host = _fetch(parts + [t for pair in tops for t in pair])
        if host[0].tolist() != counts:
            raise RuntimeError("DecodeBatch: the host's mask counts disagree with the device's")
        self.num_masked = new = host[1].tolist()
        tokens, lps = host[2].view(bs, b), host[3].view(bs, b)
        top_host = {i: (host[4 + 2 * k], host[5 + 2 * k]) for k, i in enumerate(top_rows)}
        finished: list[int] = []
        for i, req in enumerate(self.requests):
            # A row already finished (aborted in a lockstep engine that keeps it until the block
            # boundary) decodes along but records nothing and is not reported again.
            if counts[i] == 0 or req.status.finished:
                continue
            req.steps_in_block += 1
            if new[i] == 0:
                top = _alternatives(*top_host[i], b) if i in top_host else None
                if self._complete_block(req, tokens[i].tolist(), lps[i].tolist(), top):
                    finished.append(i)
        return finished

    def _complete_block(
        self, req: Request, block: list[int], lps: list[float], top: TopAlternatives | None
    ) -> bool:
        """Record a completed block (its tokens, their logprobs and alternatives, on the host);
        returns True when the request is finished."""
        req.steps_per_block.append(req.steps_in_block)
        skip = max(0, req.prompt_len - req.block_start)  # prompt tail inside the first block
        prev = len(req.output_ids)
        req.output_ids.extend(block[skip:])
        req.output_logprobs.extend(lps[skip:])
        if top is not None:
            req.output_top_logprobs.extend(top[skip:])
        p = req.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        limit = p.max_new_tokens
        for j in range(max(prev, p.min_tokens), min(len(req.output_ids), limit)):
            if req.output_ids[j] in stops:
                req.stop_token_id = req.output_ids[j]
                req.truncate_output(j)
                req.status = RequestStatus.FINISHED_STOPPED
                return True
        if req.reaches_length():
            req.truncate_output(limit)
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


def _alternatives(lp: torch.Tensor, ids: torch.Tensor, block_size: int) -> TopAlternatives:
    """Host copies of a row's [B, n] alternative buffers -> per position (id, logprob) pairs,
    without the ones of probability 0."""
    n = lp.numel() // block_size
    lps, toks = lp.tolist(), ids.tolist()
    return [
        [(toks[p * n + k], lps[p * n + k]) for k in range(n) if lps[p * n + k] != float("-inf")]
        for p in range(block_size)
    ]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, without waiting for the device.

    NOTE: a plain ``.to("cuda")`` of pageable memory synchronises the stream (the copy is followed
    by a stream synchronize, holding the GIL); from pinned memory with ``non_blocking`` it is
    queued on the stream, and the caching host allocator keeps the pinned block until the copy
    has run.
    """
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _fetch(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors (integer, bool or float32) -> flat host tensors (int32, or float32), in ONE
    device -> host copy: the step's one host synchronisation.

    The parts are packed into one int32 tensor on the device (float32 by its bits; token ids and
    counts fit), copied into pinned host memory and waited for with :func:`_wait_for`.
    """
    flat = [
        p.reshape(-1).view(torch.int32) if p.dtype == torch.float32 else p.reshape(-1).int()
        for p in parts
    ]
    packed = torch.cat(flat)
    host = packed
    if packed.is_cuda:
        host = torch.empty(packed.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        _wait_for(packed)
    out, off = [], 0
    for p, f in zip(parts, flat, strict=True):
        seg = host[off : off + f.numel()]
        out.append(seg.view(torch.float32) if p.dtype == torch.float32 else seg)
        off += f.numel()
    return out


def _wait_for(t: torch.Tensor) -> None:
    """Wait on the host until ``t``'s stream reached this point, with the GIL released.

    NOTE: a blocking ``.tolist()`` on a CUDA tensor holds the GIL while the device finishes the
    forward queued before it (~20 ms at size); a retrieval thread then cannot run its Python
    between CPU-kernel calls, and its latency grows by about a step per wait. An event
    synchronize releases the GIL; reading the pinned copy after it costs nothing more.
    """
    if t.is_cuda:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        ev.synchronize()
