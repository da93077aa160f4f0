"""Test helpers shared across the test tree.

:class:`ExactAttention` is a tiny, obviously-correct :class:`herald.models.base.AttentionBackend`:
no KV cache, plain SDPA over the given q/k/v with either full bidirectional attention or the
block-causal mask of docs/MODELS.md §7 (bidirectional inside a block, causal across blocks;
blocks aligned to index 0 of the given sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def block_causal_mask(
    seq_len: int, block_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[L, L] bool, True = may attend: ``(i // block) >= (j // block)``."""
    blk = torch.arange(seq_len, device=device) // block_size
    return blk[:, None] >= blk[None, :]


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [bs, L, H, D], k/v [bs, S, Hkv, D], mask [L, S] bool or None -> [bs, L, H, D].

    Computed in float32 with GQA by repeating KV heads; scale ``D ** -0.5``.
    """
    group = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    return out.transpose(1, 2).to(q.dtype)


class ExactAttention:
    """No-cache attention backend: full (``block_size=None``) or block-causal.

    Records each layer's q/k/v in ``calls`` when ``record=True``.
    """

    def __init__(self, block_size: int | None = None, *, record: bool = False) -> None:
        self.block_size = block_size
        self.record = record
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.record:
            self.calls.append((layer_id, q, k, v))
        mask = None
        if self.block_size is not None:
            mask = block_causal_mask(q.shape[1], self.block_size, q.device)
        return exact_attention(q, k, v, mask)


def make_engine(
    model,
    config,
    offload=None,
    *,
    hooks=None,
    cpu_pool=None,
    **engine_fields,
):
    """An engine the way callers build one: :class:`~herald.config.EngineConfig` from
    ``engine_fields`` (+ ``offload``), then :func:`herald.engines.build_engine`."""
    from herald.config import EngineConfig
    from herald.engines import build_engine

    cfg = EngineConfig(offload=offload, **engine_fields)
    engine = build_engine(model, config, cfg, hooks, cpu_pool=cpu_pool)
    OPEN_ENGINES.append(engine)  # closed after the test (tests/conftest.py), if it did not
    return engine


OPEN_ENGINES: list = []
"""Engines :func:`make_engine` built during the running test. One a failed test leaves open
keeps its thread and its page-locked pool registered with CUDA, and later tests' registrations
of reused memory then fail ("already registered")."""


def recorded_engine(model, config, offload, prompts, max_new_tokens=96):
    """An offloading engine (2 slots, 256 tokens) whose retrieval jobs are recorded, with
    ``prompts`` queued (greedy, EOS ignored): ``(engine, recorder)``."""
    from herald.config import SamplingParams
    from herald.engine.hooks import EngineHooks, SelectionRecorder

    recorder = SelectionRecorder()
    eng = make_engine(
        model, config, offload, hooks=EngineHooks(on_selection=recorder), max_batch_size=2,
        max_seq_len=256,
    )  # fmt: skip
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return eng, recorder


TINY_PRESETS = ("tiny-sdar", "tiny-llada2")
"""The tiny architectures every model test runs on."""


def user_error(err: str, alone: bool = True) -> str:
    """The message of the user error that ends a command's stderr ``err``, checked to be in its
    form: a message that begins with an option (its value out of range) as argparse reports a
    value it cannot parse, the command's usage then ``PROG: error: MESSAGE``; any other as one
    ``error: MESSAGE`` line. ``alone``: nothing else on stderr (else lines before it, such as a
    "loading" line, are allowed); never a traceback."""
    lines = err.strip().splitlines()
    assert lines and "Traceback" not in err, err
    last = lines[-1]
    if last.startswith("error: "):
        msg = last.removeprefix("error: ")
        assert not msg.startswith("--") and (len(lines) == 1 or not alone), err
        return msg
    prog, sep, msg = last.partition(": error: ")
    assert sep and msg.startswith("--"), err
    starts = [i for i, line in enumerate(lines) if line.startswith(f"usage: {prog} ")]
    assert starts, err
    start = starts[-1]
    assert all(line.startswith(" ") for line in lines[start + 1 : -1]), err
    assert start == 0 or not alone, err
    return msg
