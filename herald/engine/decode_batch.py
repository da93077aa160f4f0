"""DecodeBatch: the block-diffusion state of the running requests, shared by every engine.

Owns, per running request (row ``i`` = GPU KV slot ``i``), the current block's tokens and mask bits
on the model's device, and implements one denoising iteration's bookkeeping (docs/ARCHITECTURE.md,
"Block diffusion decoding"):

1. :meth:`inputs` gives the forward's ``input_ids`` / ``positions`` / per-row start positions.
   A row whose block has no masks left is in its *commit forward*: the same B-token forward on the
   clean block, whose KV the engine keeps as the committed prefix.
2. :meth:`apply` takes the final hidden states, computes logits only at masked positions, samples,
   applies the unmask policy and returns the rows that finished (EOS / max_new_tokens) or
   committed, so the engine can free or advance them.

Engines differ only in how the forward attends (dense cache, sparse pools, ...).
"""

from __future__ import annotations

import torch

from herald.diffusion.sampler import sample_tokens
from herald.diffusion.unmask import min_accept_count, select_unmask
from herald.engine.request import Request, RequestStatus
from herald.kv.manager import compact_moves
from herald.models.base import BlockDiffusionLM


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
        self._arange = torch.arange(block_size, device=self.device)

    def __len__(self) -> int:
        return len(self.requests)

    # -- membership -----------------------------------------------------------------------------
    def fresh_block(self, req: Request) -> tuple[torch.Tensor, torch.Tensor]:
        """Block at req.block_start: prompt tokens where the prompt reaches, masks elsewhere."""
        b = self.block_size
        toks = torch.full((b,), self.mask_token_id, dtype=torch.long)
        tail = req.prompt_ids[req.block_start : req.block_start + b]
        if tail:
            toks[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        masked = torch.zeros(b, dtype=torch.bool)
        masked[len(tail) :] = True
        return toks.to(self.device), masked.to(self.device)

    def add(self, req: Request) -> int:
        """Append ``req`` as the last row; returns its row (= KV slot)."""
        toks, masked = self.fresh_block(req)
        self.tokens = torch.cat([self.tokens, toks[None]])
        self.masked = torch.cat([self.masked, masked[None]])
        self.requests.append(req)
        req.status = RequestStatus.RUNNING
        req.steps_in_block = 0
        if not req.params.greedy and req.generator is None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(req.params.seed if req.params.seed is not None else 0)
        return len(self.requests) - 1

    def remove(self, rows: list[int]) -> list[tuple[int, int]]:
        """Drop ``rows``; the last rows move into the holes so rows stay ``0..n-1``.

        Returns the (src, dst) row moves (:func:`~herald.kv.manager.compact_moves`, the moves
        the KV manager makes in the KV slots), in order.
        """
        moves = compact_moves(len(self.requests), rows)
        for src, dst in moves:
            self.tokens[dst] = self.tokens[src]
            self.masked[dst] = self.masked[src]
            self.requests[dst] = self.requests[src]
        n = len(self.requests) - len(set(rows))
        del self.requests[n:]
        self.tokens = self.tokens[:n]
        self.masked = self.masked[:n]
        return moves

    # -- one iteration --------------------------------------------------------------------------
    def starts(self) -> list[int]:
        return [r.block_start for r in self.requests]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids`` [bs, B] int64 and ``positions`` [bs, B] int64 on the device."""
        st = torch.tensor(self.starts(), dtype=torch.long, device=self.device)
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
        bs, b = self.tokens.shape
        hidden = hidden[:, :b]
        masked = self.masked
        num_masked = masked.sum(-1)
        _wait_for(num_masked)
        num_masked_host = num_masked.tolist()  # NOTE: the one real host wait per step.
        committing = [i for i, n in enumerate(num_masked_host) if n == 0] if advance_clean else []
        argmax_all = None
        if want_draft:
            argmax_all = model.compute_logits(hidden).argmax(dim=-1)  # [bs, B]
        if any(n > 0 for n in num_masked_host):
            self._denoise(model, hidden, masked, num_masked)
        draft = None
        if argmax_all is not None:
            draft = torch.where(self.masked, argmax_all, self.tokens)
        finished: list[int] = []
        now_clean = (~self.masked.any(-1)).tolist()
        for i, req in enumerate(self.requests):
            # A row already finished (aborted in a lockstep engine that keeps it until the block
            # boundary) decodes along but records nothing and is not reported again.
            if num_masked_host[i] > 0 and not req.status.finished:
                req.steps_in_block += 1
                if now_clean[i] and self._complete_block(req, i):
                    finished.append(i)
        self.advance(committing)
        return finished, committing, draft

    def advance(self, rows: list[int]) -> None:
        """Move ``rows`` to their next block (after their commit forward)."""
        for i in rows:
            req = self.requests[i]
            req.block_start += self.block_size
            req.steps_in_block = 0
            toks, m = self.fresh_block(req)
            self.tokens[i] = toks
            self.masked[i] = m

    def _denoise(
        self,
        model: BlockDiffusionLM,
        hidden: torch.Tensor,
        masked: torch.Tensor,
        num_masked: torch.Tensor,
    ) -> None:
        bs, b = masked.shape
        rows, cols = masked.nonzero(as_tuple=True)
        logits = model.compute_logits(hidden[rows, cols])  # [N, V] float32, N = masked positions
        cand = torch.zeros(bs, b, dtype=torch.long, device=self.device)
        conf = torch.zeros(bs, b, dtype=torch.float32, device=self.device)
        greedy_rows = [i for i, r in enumerate(self.requests) if r.params.greedy]
        if len(greedy_rows) == bs:
            tok, cf = sample_tokens(logits, self.requests[0].params, self.mask_token_id)
            cand[rows, cols] = tok
            conf[rows, cols] = cf
        else:
            # Sampling draws from each request's own generator, in row order of its positions.
            rows_host = rows.tolist()
            start = 0
            for i, req in enumerate(self.requests):
                n = rows_host.count(i)
                if n == 0:
                    continue
                sl = slice(start, start + n)
                tok, cf = sample_tokens(logits[sl], req.params, self.mask_token_id, req.generator)
                cand[rows[sl], cols[sl]] = tok
                conf[rows[sl], cols[sl]] = cf
                start += n
        steps_done = torch.tensor([r.steps_in_block for r in self.requests], device=self.device)
        fixed = torch.tensor(
            [r.params.num_denoise_steps or 0 for r in self.requests], device=self.device
        )
        thr = torch.tensor(
            [r.params.threshold for r in self.requests], dtype=torch.float32, device=self.device
        )
        k_min = min_accept_count(num_masked, steps_done, fixed)
        accept = select_unmask(conf, masked, thr, k_min, fixed == 0)
        self.tokens = torch.where(accept, cand, self.tokens)
        self.masked = masked & ~accept

    def _complete_block(self, req: Request, row: int) -> bool:
        """Record a completed block; returns True when the request is finished."""
        req.steps_per_block.append(req.steps_in_block)
        block = self.tokens[row].tolist()
        skip = max(0, req.prompt_len - req.block_start)  # prompt tail inside the first block
        prev = len(req.output_ids)
        req.output_ids.extend(block[skip:])
        limit = req.params.max_new_tokens
        if not req.params.ignore_eos:
            for j in range(prev, min(len(req.output_ids), limit)):
                if req.output_ids[j] in self.eos_token_ids:
                    del req.output_ids[j:]
                    req.status = RequestStatus.FINISHED_STOPPED
                    return True
        if req.reaches_length():
            del req.output_ids[limit:]
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


def _wait_for(t: torch.Tensor) -> None:
    """Wait on the host until ``t``'s stream reached this point, with the GIL released.

    NOTE: a blocking ``.tolist()`` on a CUDA tensor holds the GIL while the device finishes the
    forward queued before it (~20 ms at size); a retrieval thread then cannot run its Python
    between CPU-kernel calls, and its latency grows by about a step per wait. An event
    synchronize releases the GIL; the ``.tolist()`` after it returns at once.
    """
    if t.is_cuda:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        ev.synchronize()
