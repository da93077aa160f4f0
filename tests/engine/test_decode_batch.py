"""DecodeBatch: one host transfer per step; min_tokens, stop tokens, logprobs, top logprobs."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from helpers import make_engine

import herald.engine.decode_batch as db
from herald.attention.block_causal import BlockCausalAttention
from herald.config import MIN_TEMPERATURE, SamplingParams
from herald.diffusion.block import BlockLayout
from herald.diffusion.sampler import _filter_logits, sample_tokens
from herald.diffusion.unmask import min_accept_count, select_unmask
from herald.models.registry import build_model, get_preset


@pytest.fixture(scope="module")
def tiny():
    config = get_preset("tiny-sdar")
    return build_model(config, device="cpu", dtype=torch.float32, seed=1), config


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, config, bs=1):
    return make_engine(model, config, None, max_batch_size=bs, max_seq_len=512)


# -- host synchronisation ------------------------------------------------------------------------
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")


@contextlib.contextmanager
def _count_host_reads(monkeypatch):
    """Per ``apply`` call, the number of :func:`decode_batch._fetch` transfers; any other read
    of a tensor's values on the host inside ``apply`` (``tolist``, ``item``, ``bool``,
    ``nonzero``, ...) fails, unless it reads the fetched host copy."""
    per_apply: list[int] = []
    fetched: set[int] = set()
    inside = [False]
    real_fetch, real_apply = db._fetch, db.DecodeBatch.apply

    def fetch(parts):
        out = real_fetch(parts)
        fetched.update(t.untyped_storage().data_ptr() for t in out)
        per_apply[-1] += 1
        return out

    def apply(self, *args, **kwargs):
        per_apply.append(0)
        inside[0] = True
        try:
            return real_apply(self, *args, **kwargs)
        finally:
            inside[0] = False
            fetched.clear()

    def guard(name, real):
        def read(t, *args, **kwargs):
            if inside[0] and t.untyped_storage().data_ptr() not in fetched:
                raise AssertionError(f"{name} of a device tensor inside DecodeBatch.apply")
            return real(t, *args, **kwargs)

        return read

    monkeypatch.setattr(db, "_fetch", fetch)
    monkeypatch.setattr(db.DecodeBatch, "apply", apply)
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    real_nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda t, *a, **k: guard("nonzero", real_nonzero)(t))
    yield per_apply


def test_at_most_one_host_transfer_per_step(tiny, monkeypatch):
    """Greedy, fixed-steps and sampled rows with and without alternatives, joining and leaving:
    every apply() reads the device once (a step with a mask) or never (commit forwards only),
    and the tokens are those of an unpatched run."""
    model, config = tiny
    prompts = _prompts([45, 64, 7, 100], seed=2)
    params = [
        SamplingParams(max_new_tokens=40, ignore_eos=True, top_logprobs=3),
        SamplingParams(max_new_tokens=70, num_denoise_steps=4, ignore_eos=True),
        SamplingParams(max_new_tokens=33, temperature=0.9, top_p=0.9, seed=3, top_logprobs=2),
        SamplingParams(max_new_tokens=50, temperature=1.0, top_k=8, seed=4, ignore_eos=True),
    ]
    want = [r.output_ids for r in _engine(model, config, bs=3).generate(prompts, params)]
    with _count_host_reads(monkeypatch) as per_apply:
        got = [r.output_ids for r in _engine(model, config, bs=3).generate(prompts, params)]
        assert got == want
        assert per_apply and max(per_apply) == 1
        per_apply.clear()
        _engine(model, config).generate(prompts[:1], params[:1])
    # alone, a request's commit forward is a step without masks: no transfer at all
    assert sorted(set(per_apply)) == [0, 1]


def test_host_mask_counts_match_the_device(tiny):
    model, config = tiny
    eng = _engine(model, config, bs=2)
    for p, n in zip(_prompts([40, 70]), (64, 20), strict=True):
        eng.add_request(p, SamplingParams(max_new_tokens=n, num_denoise_steps=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        assert eng.batch.num_masked == eng.batch.masked.sum(-1).tolist()
        assert eng.batch.any_masked() == bool(eng.batch.masked.any())


def test_no_alternatives_computed_when_no_row_asks(tiny, monkeypatch):
    model, config = tiny

    def never(*args, **kwargs):
        raise AssertionError("top_logprobs computed for a batch that asks for none")

    monkeypatch.setattr(db, "top_logprobs", never)
    params = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, temperature=1)]
    reqs = _engine(model, config, bs=2).generate(_prompts([30, 50]), params)
    assert all(r.output_top_logprobs == [] for r in reqs)
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in reqs)


# -- stop rules ----------------------------------------------------------------------------------
def _free_run(model, config, prompt, n=96):
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return _engine(model, config).generate([prompt], params)[0]


def test_stop_token_ids_finish_like_eos(tiny):
    model, config = tiny
    prompt = _prompts([40])[0]
    free = _free_run(model, config, prompt)
    stop = free.output_ids[40]
    first = free.output_ids.index(stop)
    # an EOS the free run never produced, so that only the stop token can end it
    unused = next(t for t in range(config.vocab_size) if t not in free.output_ids)
    cfg = config.replace(eos_token_ids=(unused,))
    for ignore_eos in (False, True):
        params = SamplingParams(max_new_tokens=96, stop_token_ids=(stop,), ignore_eos=ignore_eos)
        req = _engine(model, cfg).generate([prompt], params)[0]
        assert req.output_ids == free.output_ids[:first]
        assert req.output_logprobs == free.output_logprobs[:first]
        assert req.finish_reason == "stop" and req.stop_token_id == stop


def test_min_tokens_defers_eos_and_stop_tokens(tiny):
    model, config = tiny
    prompt = _prompts([40])[0]
    out = _free_run(model, config, prompt).output_ids
    # a token occurring at least twice: min_tokens past its first occurrence stops at the next
    tok = next(t for t in out if out.count(t) >= 2)
    first = out.index(tok)
    second = out.index(tok, first + 1)
    eos_cfg = config.replace(eos_token_ids=(tok,))
    for mt in (0, first, first + 1, second + 1):
        later = [j for j in range(mt, len(out)) if out[j] == tok]
        for cfg, params in (
            (eos_cfg, SamplingParams(max_new_tokens=96, min_tokens=mt)),
            (config, SamplingParams(max_new_tokens=96, min_tokens=mt, stop_token_ids=(tok,),
                                    ignore_eos=True)),
        ):  # fmt: skip
            req = _engine(model, cfg).generate([prompt], params)[0]
            if later:
                assert req.output_ids == out[: later[0]] and req.finish_reason == "stop"
            else:
                assert req.output_ids == out and req.finish_reason == "length"
            assert len(req.output_ids) >= mt
            assert len(req.output_logprobs) == len(req.output_ids)


def test_new_sampling_fields_are_validated():
    for bad, match in (
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_new_tokens=4, min_tokens=5), "min_tokens"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(stop_token_ids=(1.5,)), "stop_token_ids"),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(top_logprobs=21), "top_logprobs"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad).validate()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
    SamplingParams(max_new_tokens=4, min_tokens=4, top_logprobs=20).validate()


# -- logprobs ------------------------------------------------------------------------------------
@torch.inference_mode()
def _recompute(model, config, prompt, params, n_top):
    """No-cache decoding (the block-causal re-forward of every step) that records, per output
    token, log_softmax of the sampler's distribution at the step that accepted it, and its
    ``n_top`` best (id, logprob) alternatives."""
    b, mask_id = config.block_size, config.mask_token_id
    layout = BlockLayout(len(prompt), b, params.max_new_tokens)
    x = torch.full((1, layout.total_len), mask_id, dtype=torch.long)
    x[0, : len(prompt)] = torch.tensor(prompt)
    pos = torch.arange(layout.total_len)[None]
    attn = BlockCausalAttention(b)
    gen = None if params.greedy else torch.Generator().manual_seed(params.seed or 0)
    fixed = torch.tensor([params.num_denoise_steps or 0])
    thr = torch.tensor([params.threshold])
    lp = torch.zeros(layout.total_len)
    top: dict[int, list[tuple[int, float]]] = {}
    for start in range(layout.first_block_start, layout.total_len, b):
        end = start + b
        masked = x[:, start:end] == mask_id
        masked[0, : max(0, len(prompt) - start)] = False
        steps = 0
        while bool(masked.any()):
            hidden = model(x[:, :end], pos[:, :end], attn)[:, start:end]
            cols = masked[0].nonzero().squeeze(-1)
            logits = model.compute_logits(hidden[0, cols]).float()
            tok, cf = sample_tokens(logits.clone(), params, mask_id, gen)
            z = logits.clone()
            z[:, mask_id] = float("-inf")
            if not params.greedy:
                t = max(params.temperature, MIN_TEMPERATURE)
                z = _filter_logits(z / t, params.top_k, params.top_p)
            logp = torch.log_softmax(z, dim=-1)
            conf = torch.zeros(1, b)
            conf[0, cols] = cf
            k = min_accept_count(masked.sum(-1), torch.tensor([steps]), fixed)
            accept = select_unmask(conf, masked, thr, k, fixed == 0)
            for n, c in enumerate(cols.tolist()):
                if accept[0, c]:
                    x[0, start + c] = tok[n]
                    lp[start + c] = logp[n, tok[n]]
                    vals, ids = logp[n].topk(n_top)
                    top[start + c] = list(zip(ids.tolist(), vals.tolist(), strict=True))
            masked &= ~accept
            steps += 1
    first = len(prompt)
    n = params.max_new_tokens
    ids = x[0, first : first + n].tolist()
    return ids, lp[first : first + n].tolist(), [top[first + j] for j in range(len(ids))]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=45, ignore_eos=True, top_logprobs=4),
        SamplingParams(max_new_tokens=40, num_denoise_steps=6, ignore_eos=True, top_logprobs=2),
        SamplingParams(
            max_new_tokens=40, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True,
            top_logprobs=5,
        ),
    ],
    ids=["threshold", "fixed-steps", "sampled"],
)  # fmt: skip
def test_logprobs_equal_a_direct_recomputation(tiny, params):
    model, config = tiny
    prompt = _prompts([45])[0]
    ids, lps, tops = _recompute(model, config, prompt, params, params.top_logprobs)
    other = SamplingParams(max_new_tokens=30, ignore_eos=True)
    req, mate = _engine(model, config, bs=2).generate([prompt, _prompts([20])[0]], [params, other])
    assert req.output_ids == ids
    assert len(req.output_logprobs) == len(req.output_top_logprobs) == len(ids)
    assert req.output_logprobs == pytest.approx(lps, abs=1e-4)
    for j, (got, want) in enumerate(zip(req.output_top_logprobs, tops, strict=True)):
        finite = [(t, v) for t, v in want if not math.isinf(v)]
        assert [t for t, _ in got] == [t for t, _ in finite], j
        assert [v for _, v in got] == pytest.approx([v for _, v in finite], abs=1e-4)
        assert all(v <= 0.0 for _, v in got)
        # the token itself, when among the alternatives, carries its own logprob
        own = dict(got).get(req.output_ids[j])
        assert own is None or own == req.output_logprobs[j]
    if params.greedy:  # the argmax is the first alternative
        assert [g[0][0] for g in req.output_top_logprobs] == req.output_ids
    assert mate.output_top_logprobs == [] and len(mate.output_logprobs) == 30


def test_logprobs_stay_aligned_after_eos_and_length_cuts(tiny):
    model, config = tiny
    prompt = _prompts([50])[0]
    free = _free_run(model, config, prompt, n=96)
    eos = free.output_ids[37]
    first = free.output_ids.index(eos)
    req = _engine(model, config.replace(eos_token_ids=(eos,))).generate(
        [prompt], SamplingParams(max_new_tokens=96, top_logprobs=1)
    )[0]
    assert req.finish_reason == "stop"
    assert len(req.output_ids) == len(req.output_logprobs) == len(req.output_top_logprobs) == first
    assert req.output_logprobs == free.output_logprobs[:first]
    req = _engine(model, config).generate(
        [prompt], SamplingParams(max_new_tokens=17, ignore_eos=True, top_logprobs=1)
    )[0]
    assert req.finish_reason == "length"
    assert len(req.output_ids) == len(req.output_logprobs) == len(req.output_top_logprobs) == 17
    assert req.output_logprobs == free.output_logprobs[:17]


# -- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_apply_makes_one_host_sync_on_cuda(monkeypatch):
    """On CUDA, apply() runs under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising
    call raises), and waits once, through the event of :func:`decode_batch._wait_for`."""
    config = get_preset("tiny-llada2")
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    prompts = _prompts([70, 20, 130, 64], seed=3)
    params = [
        SamplingParams(max_new_tokens=96, ignore_eos=True, top_logprobs=3),
        SamplingParams(max_new_tokens=64, num_denoise_steps=5, ignore_eos=True),
        SamplingParams(max_new_tokens=50, temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=80, temperature=1.0, top_k=8, seed=4, ignore_eos=True),
    ]
    eng = make_engine(model, config, None, max_batch_size=3, max_seq_len=256)
    want = [r.output_ids for r in eng.generate(prompts, params)]
    waits: list[int] = []
    real_apply, real_wait = db.DecodeBatch.apply, db._wait_for

    def apply(self, *args, **kwargs):
        waits.append(0)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_apply(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def wait(t):
        waits[-1] += 1
        real_wait(t)

    monkeypatch.setattr(db.DecodeBatch, "apply", apply)
    monkeypatch.setattr(db, "_wait_for", wait)
    eng = make_engine(model, config, None, max_batch_size=3, max_seq_len=256)
    got = [r.output_ids for r in eng.generate(prompts, params)]
    assert got == want
    assert max(waits) == 1 and 0 in waits


def test_an_unseeded_sampled_request_gets_a_fresh_seed(tiny, monkeypatch):
    """Equal unseeded requests must not all draw one sample: each takes a fresh seed from the OS
    source, and then decodes exactly as the request seeded with it would."""
    model, config = tiny
    prompt = _prompts([40])[0]
    params = SamplingParams(max_new_tokens=32, temperature=1.0)
    fresh = iter([11, 12])
    monkeypatch.setattr(db._FRESH, "getrandbits", lambda bits: next(fresh))
    unseeded = [_engine(model, config).generate([prompt], params)[0].output_ids for _ in range(2)]
    seeded = [
        _engine(model, config).generate([prompt], dataclasses.replace(params, seed=s))[0].output_ids
        for s in (11, 12)
    ]
    assert unseeded == seeded and seeded[0] != seeded[1]
