"""Offloading engine (HERALD / MAGE-Offload): budget 1.0 equals dense, fences, selection."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from herald.config import OffloadConfig, SamplingParams
from herald.engine.hooks import EngineHooks, FaultInjection, SelectionRecorder, SyntheticPrefill
from herald.layers.linear import Linear, linear
from herald.models.registry import build_model, get_preset
from herald.offload.selection.ref import select_topk_torch

PRESETS = ["tiny-sdar", "tiny-llada2"]
MODES = {
    "herald": OffloadConfig.for_mode("herald", kv_budget=1.0, selection_threads=2),  # selected
    "herald-full": OffloadConfig.for_mode(
        "herald", kv_budget=1.0, output_mode="full", selection_threads=2
    ),
    "rep-no-lookahead": OffloadConfig(lookahead="off", kv_budget=1.0, selection_threads=2),
    "rep-no-lookahead-selected": OffloadConfig.for_mode(
        "herald", lookahead="off", kv_budget=1.0, selection_threads=2
    ),
    "mage-gpu": OffloadConfig.for_mode("mage", kv_budget=1.0),
    # "selected": step 0's output is attention over the selected rows in the model's arithmetic
    # (exact at budget 1.0); "full" uses the kernel's float32 output, equal only up to rounding.
    "mage-cpu": OffloadConfig.for_mode(
        "mage", kv_budget=1.0, selection_device="cpu", output_mode="selected", selection_threads=2
    ),
    "infinigen": OffloadConfig.for_mode("infinigen", kv_budget=1.0),
    # the compact first pass (int8 copy of K): every representative-query mode
    "herald-int8": OffloadConfig.for_mode(
        "herald", kv_budget=1.0, selection_threads=2, first_pass="int8"
    ),
    "herald-full-int8": OffloadConfig.for_mode(
        "herald", kv_budget=1.0, output_mode="full", selection_threads=2, first_pass="int8"
    ),
    "rep-no-lookahead-selected-int8": OffloadConfig.for_mode(
        "herald", lookahead="off", kv_budget=1.0, selection_threads=2, first_pass="int8"
    ),
    # the int8 copy of K on the model's device, scored there (approximate below budget 1.0)
    "herald-int8-gpu": OffloadConfig.for_mode("herald", kv_budget=1.0, first_pass="int8-gpu"),
    "rep-no-lookahead-int8-gpu": OffloadConfig.for_mode(
        "herald", lookahead="off", kv_budget=1.0, first_pass="int8-gpu"
    ),
}


def _model(preset, device="cpu"):
    config = get_preset(preset)
    # bf16: the CPU pool and the selection kernel hold bf16, so the offloaded KV is bit-exact.
    return build_model(config, device=device, dtype=torch.bfloat16, seed=1), config


def _prompts(config, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=PRESETS)
def setup(request):
    model, config = _model(request.param)
    prompts = _prompts(config, [70, 20, 130])
    # Fixed steps per block, a different count per request: the rows of a lockstep block finish
    # their masks at different steps (as threshold decoding's would), and a random model's
    # threshold decoding, one token per step, would take ~B steps per block.
    params = [
        SamplingParams(max_new_tokens=72, ignore_eos=True, num_denoise_steps=s) for s in (3, 8, 5)
    ]
    dense = make_engine(model, config, None, max_batch_size=3, max_seq_len=256)
    ref = [r.output_ids for r in dense.generate(prompts, params)]
    return model, config, prompts, params, ref


@pytest.mark.parametrize("mode", list(MODES))
def test_budget_one_equals_dense(setup, mode):
    model, config, prompts, params, ref = setup
    eng = make_engine(model, config, MODES[mode], max_batch_size=3, max_seq_len=256)
    try:
        got = [r.output_ids for r in eng.generate(prompts, params)]
    finally:
        eng.close()
    assert got == ref
    assert eng.cpu_pool.num_used_pages == 0  # every page came back


@pytest.mark.parametrize("first_pass", ["none", "int8-gpu"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_random_retrieval_delays_do_not_change_output(device, first_pass):
    """On CUDA this also races the retrieval stream, its copy stream and the main stream (with
    int8-gpu: the device scoring, the fetch from device positions, the tail read from the
    draft)."""
    model, config = _model("tiny-sdar", device)
    prompts = _prompts(config, [90, 33, 64, 5], seed=4)
    params = SamplingParams(max_new_tokens=160, num_denoise_steps=6, ignore_eos=True)
    cfg = OffloadConfig.for_mode(
        "herald", kv_budget=0.3, selection_threads=2, first_pass=first_pass
    )
    outs = []
    for faults in (None, FaultInjection(max_delay=0.004, seed=3)):
        hooks = EngineHooks(faults=faults)
        eng = make_engine(model, config, cfg, hooks=hooks, max_batch_size=4, max_seq_len=320)
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
        eng.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("groups", [1, 2])
def test_engine_selection_equals_reference(groups):
    """Each retrieval job's top-k equals the PyTorch reference on the same query and KV, checked
    as soon as the job is done (before the next block's draft overwrites the scratch page); with
    2 request groups, each group's top-k merged in row order (indices padded with -1 to the
    widest group's k, the rows' lengths differing)."""
    model, config = _model("tiny-llada2")
    prompts = _prompts(config, [100, 40, 70], seed=2)
    cfg = OffloadConfig.for_mode(
        "herald", kv_budget=0.25, selection_threads=2, retrieval_groups=groups
    )
    recorder = SelectionRecorder()
    hooks = EngineHooks(on_selection=recorder)
    eng = make_engine(model, config, cfg, hooks=hooks, max_batch_size=3, max_seq_len=256)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=96, ignore_eos=True, num_denoise_steps=4))
    b = config.block_size
    checked, seen = 0, set()
    while eng.has_unfinished():
        eng.step()
        for job in recorder.jobs:
            if id(job) in seen or not job.done.is_set():
                continue
            seen.add(id(job))
            n = len(job.request_ids)
            seq = torch.tensor([p + b for p in job.prefix_lens], dtype=torch.int32)
            tails = torch.full((n,), b, dtype=torch.int32)
            budgets = torch.tensor([max(x, 1) for x in job.budgets], dtype=torch.int32)
            for layer, (q, idx) in job.recorded.items():
                assert q.shape[0] == n
                pl = layer - eng.num_dense
                ref = select_topk_torch(
                    q,
                    eng.cpu_pool.k_pages(pl),
                    eng.cpu_pool.v_pages(pl),
                    job.page_table,
                    seq,
                    budgets,
                    tail_lens=tails,
                )
                assert torch.equal(ref.indices, idx), (layer, job.prefix_lens)
                checked += 1
    assert checked >= 4
    eng.close()


def test_request_larger_than_cpu_pool_is_refused_before_work():
    from herald.kv.cpu_pool import CpuKVPool

    model, config = _model("tiny-sdar")
    pool = CpuKVPool(
        config.num_layers - 2, config.num_kv_heads, config.head_dim, config.block_size, num_pages=4
    )
    eng = make_engine(
        model, config, OffloadConfig(), max_batch_size=2, max_seq_len=512, cpu_pool=pool
    )
    with pytest.raises(ValueError, match="CPU pool"):
        eng.add_request(list(range(200)), SamplingParams(max_new_tokens=64))
    assert not eng.has_unfinished() and pool.num_used_pages == 0
    eng.close()


def test_herald_preset_selects_with_the_selected_kernel_output():
    assert OffloadConfig.for_mode("herald").output_mode == "selected"
    assert OffloadConfig.for_mode("herald", output_mode="full").output_mode == "full"
    assert OffloadConfig.for_mode("mage", selection_device="cpu").output_mode == "full"


def test_offload_config_validation():
    with pytest.raises(ValueError, match="lookahead"):
        OffloadConfig(selection_queries="block", lookahead="draft").validate()
    with pytest.raises(ValueError, match="kv_budget"):
        OffloadConfig(kv_budget=0.0).validate()
    with pytest.raises(ValueError, match="unknown offload mode"):
        OffloadConfig.for_mode("nope")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_budget_one_equals_dense_on_gpu(preset):
    config = get_preset(preset)
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    prompts = _prompts(config, [70, 20, 130, 64])
    params = SamplingParams(max_new_tokens=72, ignore_eos=True)
    # Both engines at the default kv_pad (512). Without it this failed in 2 of 4 runs for
    # tiny-llada2 (herald: the 130-token request from token 66): the dense engine is not
    # lockstep, so its batch's longest key length differs from the offload engine's.
    dense = make_engine(model, config, None, max_batch_size=4, max_seq_len=256)
    ref = [r.output_ids for r in dense.generate(prompts, params)]
    for mode in ("herald", "herald-full", "mage-gpu", "mage-cpu", "infinigen", "herald-int8-gpu"):
        eng = make_engine(model, config, MODES[mode], max_batch_size=4, max_seq_len=256)
        got = [r.output_ids for r in eng.generate(prompts, params)]
        eng.close()
        assert got == ref, mode
        assert eng.cpu_pool.num_used_pages == 0


def test_proxy_channels_and_topk():
    from herald.offload.selection.proxy import proxy_channels, proxy_topk

    model, config = _model("tiny-llada2")  # partial RoPE: rotated pairs + pass-through dims
    chans = proxy_channels(model.layers[2], 0.25)
    assert chans.shape == (config.num_kv_heads, 8)
    assert all(torch.equal(c, c.sort().values) for c in chans)
    assert int(chans.max()) < config.head_dim and int(chans.min()) >= 0
    # With all channels, the proxy ranks exactly like exact attention importance.
    full = torch.arange(config.head_dim).expand(config.num_kv_heads, -1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(32, config.num_heads, config.head_dim, generator=g)
    keys = torch.randn(config.num_kv_heads, 200, config.head_dim, generator=g)
    from herald.offload.selection.gpu_topk import select_topk_rows

    assert torch.equal(proxy_topk(q, keys, full, 20), select_topk_rows(q, keys, 200, 0, 20))


def test_infinigen_selects_from_proxy_and_reuses():
    """At a small budget InfiniGen still decodes (selection from the partial-key cache)."""
    model, config = _model("tiny-sdar")
    prompts = _prompts(config, [100, 64], seed=5)
    eng = make_engine(
        model,
        config,
        OffloadConfig.for_mode("infinigen", kv_budget=0.2),
        max_batch_size=2,
        max_seq_len=256,
    )
    out = eng.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    eng.close()
    assert all(len(r.output_ids) == 64 for r in out)
    assert eng.cpu_pool.num_used_pages == 0


@pytest.mark.parametrize("mode", ["herald", "herald-int8-gpu"])
def test_poisoned_staging_never_reaches_the_pool(setup, mode):
    """Rows of the pinned staging past a request's k must never be copied into the sparse pool:
    masked pool rows still meet a zero probability and 0 * NaN = NaN. Regression test for a
    flaky non-finite score with mixed prompt lengths (uninitialised staging memory)."""
    model, config, prompts, params, ref = setup
    hooks = EngineHooks(faults=FaultInjection(poison_staging=True))
    eng = make_engine(model, config, MODES[mode], hooks=hooks, max_batch_size=3, max_seq_len=256)
    try:
        got = [r.output_ids for r in eng.generate(prompts, params)]
    finally:
        eng.close()
    assert got == ref


def test_eos_and_continuous_admission_equal_dense():
    """Requests stop at EOS mid-batch, leave at the block boundary and free slots that waiting
    requests take (2 slots, 5 requests): output still equals dense at budget 1.0."""
    model, config = _model("tiny-llada2")
    prompts = _prompts(config, [70, 20, 130, 40, 90], seed=7)
    steps = 4  # fixed denoising steps per block: a random model's threshold mode takes ~B
    free = make_engine(model, config, None, max_batch_size=5, max_seq_len=320).generate(
        prompts, SamplingParams(max_new_tokens=96, ignore_eos=True, num_denoise_steps=steps)
    )
    cfg = config.replace(eos_token_ids=(free[0].output_ids[40],))
    params = [
        SamplingParams(max_new_tokens=n, num_denoise_steps=steps) for n in (96, 64, 96, 33, 80)
    ]
    dense = make_engine(model, cfg, None, max_batch_size=2, max_seq_len=320)
    ref = [r.output_ids for r in dense.generate(prompts, params)]
    assert any(len(r) < p.max_new_tokens for r, p in zip(ref, params, strict=True))  # EOS hit
    for mode in ("herald", "mage-cpu", "infinigen"):
        eng = make_engine(model, cfg, MODES[mode], max_batch_size=2, max_seq_len=320)
        got = [r.output_ids for r in eng.generate(prompts, params)]
        eng.close()
        assert got == ref, mode
        assert eng.cpu_pool.num_used_pages == 0


def test_abort_mid_block_frees_pages_and_leaves_others_unchanged(setup):
    """A request aborted mid-block decodes along until the boundary, is never returned, and its
    pages are freed there; the others still equal dense; the pool ends empty."""
    model, config, prompts, params, ref = setup
    eng = make_engine(model, config, MODES["herald"], max_batch_size=3, max_seq_len=256)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    returned = []
    for _ in range(3):  # into the first block: step 0, the fused draft step, step 2
        returned += eng.step()
    eng.abort(reqs[1])
    used = eng.cpu_pool.num_used_pages
    returned += eng.step()
    assert eng.cpu_pool.num_used_pages == used  # still held mid-block
    while eng.has_unfinished():
        returned += eng.step()
    eng.close()
    assert reqs[1] not in returned
    assert reqs[1].status.value == "finished_aborted"
    assert [reqs[0].output_ids, reqs[2].output_ids] == [ref[0], ref[2]]
    assert eng.cpu_pool.num_used_pages == 0


def test_abort_waiting_request_never_runs():
    model, config = _model("tiny-sdar")
    eng = make_engine(model, config, MODES["herald"], max_batch_size=1, max_seq_len=256)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    a, b = (eng.add_request(p, params) for p in _prompts(config, [40, 50]))
    eng.abort(b)
    while eng.has_unfinished():
        eng.step()
    eng.close()
    assert len(a.output_ids) == 32 and b.output_ids == [] and b.status.value == "finished_aborted"
    assert eng.cpu_pool.num_used_pages == 0


@pytest.mark.parametrize("mode", ["herald", "mage-cpu", "infinigen"])
def test_random_prefill_decodes_and_times_blocks(mode):
    """Benchmark prefill (random KV, no prompt forward) runs every mode to completion, with
    per-block timings: the retrieval job of herald runs inside its block, and none runs in the
    last block (nothing follows it)."""
    model, config = _model("tiny-llada2")
    cfg = OffloadConfig(**{**vars(MODES[mode]), "kv_budget": 0.2})
    eng = make_engine(
        model,
        config,
        cfg,
        max_batch_size=2,
        max_seq_len=320,
        hooks=EngineHooks(synthetic_prefill=SyntheticPrefill()),
    )
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=4, ignore_eos=True)
    reqs = eng.generate(_prompts(config, [192, 256]), params)  # whole blocks
    eng.close()
    assert [len(r.output_ids) for r in reqs] == [64, 64]
    assert eng.stats.num_prefill_tokens > 0 and eng.cpu_pool.num_used_pages == 0
    blocks = eng.stats.blocks
    assert len(blocks) == 2 and all(b.steps == 5 for b in blocks)  # 4 steps + commit
    if mode == "herald":
        for b in blocks[:-1]:
            assert b.retrieval_start is not None and b.retrieval_end is not None
            assert 0 <= b.retrieval_start <= b.retrieval_end <= b.main + b.stall + 1e-3
        # every request ends with the last block (by length): no selection for a block after it
        assert blocks[-1].retrieval_start is None and blocks[-1].retrieval == 0


def test_chunked_prefill_across_boundaries_equals_dense():
    """Prompts prefilled 64 tokens per forward (192 per block boundary: two denoising steps and
    the commit; one request at a time, next to decoding rows; one aborted mid-prefill) give
    dense's tokens; every page comes back."""
    model, config = _model("tiny-llada2")
    prompts = _prompts(config, [20, 300, 45, 400, 7], seed=5)
    params = [
        SamplingParams(max_new_tokens=n, num_denoise_steps=2, ignore_eos=True)
        for n in (33, 64, 40, 50, 96)
    ]
    dense = make_engine(model, config, None, max_batch_size=2, max_seq_len=512)
    ref = [r.output_ids for r in dense.generate(prompts, params)]
    eng = make_engine(model, config, MODES["herald"], max_batch_size=2, max_seq_len=512,
        prefill_chunk_tokens=32, max_prefill_tokens=64,
    )  # fmt: skip
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    extra = eng.add_request(_prompts(config, [460], seed=9)[0], params[0])
    overlapped = 0
    while eng.has_unfinished():
        eng.step()
        prefilling = eng.scheduler.prefilling
        if prefilling is not None and len(eng.batch):
            overlapped += 1
            if prefilling.request is extra and prefilling.pos >= 64:
                eng.abort(extra)
    eng.close()
    assert [r.output_ids for r in reqs] == ref
    assert overlapped >= 3
    assert extra.output_ids == [] and extra.status.value == "finished_aborted"
    assert eng.cpu_pool.num_used_pages == 0


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_with_retrieval_thread():
    """Piecewise graphs in the offload engine (captured while the retrieval thread runs) give
    the eager engine's tokens."""
    config = get_preset("tiny-llada2")
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    prompts = _prompts(config, [70, 20, 130, 64])
    params = SamplingParams(max_new_tokens=96, num_denoise_steps=8, ignore_eos=True)
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.3)
    outs = []
    for graphs in (False, True):
        eng = make_engine(
            model, config, cfg, max_batch_size=4, max_seq_len=256, use_cuda_graph=graphs
        )
        outs.append([r.output_ids for r in eng.generate(prompts, params)])
        eng.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kv_pad_makes_outputs_independent_of_batch_mates(device):
    """Without padding a batched attention's key length is the longest row's, which changes a
    row's bf16 rounding (measured: budget 0.05, tiny-sdar, a 300-token batch mate flips a greedy
    token). With kv_pad=512 a request's tokens are the same alone, with any mates, and with any
    engine capacity; dense and offload engines alike."""
    model, config = _model("tiny-sdar", device)
    g = torch.Generator().manual_seed(11)
    a = torch.randint(0, 256, (50,), generator=g).tolist()
    mates = [[120] * 300, [121] * 500]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, num_denoise_steps=2)

    def offload(prompts, mode, seq=1024):
        cfg = OffloadConfig.for_mode(mode, kv_budget=0.05, selection_threads=2)
        eng = make_engine(model, config, cfg, max_batch_size=2, max_seq_len=seq, kv_pad=512)
        out = [r.output_ids for r in eng.generate(prompts, params)]
        eng.close()
        return out

    for mode in ("herald", "infinigen"):
        alone = offload([a], mode)[0]
        assert offload([a], mode, seq=192)[0] == alone, mode
        for m in mates:
            assert offload([a, m], mode)[0] == alone, mode
            assert offload([m, a], mode)[1] == alone, mode
    dense = make_engine(model, config, None, max_batch_size=2, max_seq_len=1024, kv_pad=512)
    alone = dense.generate([a], params)[0].output_ids
    for m in mates:
        eng = make_engine(model, config, None, max_batch_size=2, max_seq_len=1024, kv_pad=512)
        assert eng.generate([m, a], params)[1].output_ids == alone


def test_kv_pad_budget_one_equals_dense_with_kv_pad(setup):
    model, config, prompts, params, _ = setup
    dense = make_engine(model, config, None, max_batch_size=3, max_seq_len=256, kv_pad=512)
    ref = [r.output_ids for r in dense.generate(prompts, params)]
    eng = make_engine(model, config, MODES["herald"], max_batch_size=3, max_seq_len=256, kv_pad=512)
    got = [r.output_ids for r in eng.generate(prompts, params)]
    eng.close()
    assert got == ref


def _row_variant_matmul(model, rows: int) -> tuple[int, int] | None:
    """The first weight shape [out, in] for which the model's bf16 projection on this CPU
    (herald's :func:`~herald.layers.linear.linear`) gives a row other bits in a ``rows``-row
    product than in a ``2 * rows``-row one (the fused draft step runs 2B rows through every
    projection), else None. Seen on an AVX512-BF16 Xeon for [384, 832]."""
    gen = torch.Generator().manual_seed(0)
    for shape in sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2}):
        w = torch.randn(shape, generator=gen).to(torch.bfloat16)
        x = torch.randn(2 * rows, shape[1], generator=gen).to(torch.bfloat16)
        if not torch.equal(linear(x[:rows], w), linear(x, w)[:rows]):
            return shape
    return None


def _trained_model_setup():
    import json.decoder

    from herald.models.loader import load_model

    model, config, tok = load_model("code-sdar", "cpu", torch.bfloat16)
    with open(json.decoder.__file__, encoding="utf-8") as f:
        ids = tok.encode(f.read())[-400:]
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=4)
    dense = make_engine(model, config, None, max_batch_size=1, max_seq_len=512)
    return model, config, ids, params, dense.generate([ids], params)[0].output_ids


def _offload_output(model, config, mode, ids, params):
    eng = make_engine(model, config, MODES[mode], max_batch_size=1, max_seq_len=512)
    try:
        return eng.generate([ids], params)[0].output_ids
    finally:
        eng.close()


def test_budget_one_equals_dense_at_fixed_steps_with_the_trained_model():
    """Fixed steps expose near-ties (found by a user trial on json/decoder.py, 4 steps): MAGE's
    exact step-0 attention must be padded like dense's, or budget 1.0 differs from dense within
    the first blocks. HERALD's selection without the draft step runs here too; with it, below."""
    model, config, ids, params, ref = _trained_model_setup()
    for mode in ("rep-no-lookahead", "mage-gpu", "infinigen"):
        assert _offload_output(model, config, mode, ids, params) == ref, mode


def _rowwise_linear(self, x):
    """The model's ``Linear.forward`` one row at a time: every row gets the bits of a 1-row
    product."""
    flat = x.reshape(-1, x.shape[-1])
    rows = [linear(flat[i : i + 1], self.weight, self.bias)
            for i in range(flat.shape[0])]  # fmt: skip
    return torch.cat(rows).reshape(*x.shape[:-1], -1)


def test_budget_one_equals_dense_with_the_draft_step_on_the_trained_model(monkeypatch):
    """The fused block+draft step (2B rows through every projection) must give its block half
    the bits of a plain B-row step: with kv_pad, its attention must cover a plain step's key
    length (padded(p + B), not padded(p + 2B) - B; found by the user trial above, on the device
    where the matmuls are row-invariant). Where this CPU's bf16 matmul gives a row other bits
    in a B-row and a 2B-row product (an AVX512-BF16 Xeon, weight [384, 832]), the fused step
    cannot equal a plain one, so both engines run their projections one row at a time here.
    (That kv_pad regression itself showed on the device; the GPU tests guard it.)"""
    model, config, ids, params, _ = _trained_model_setup()
    if _row_variant_matmul(model, config.block_size) is not None:
        monkeypatch.setattr(Linear, "forward", _rowwise_linear)
    dense = make_engine(model, config, None, max_batch_size=1, max_seq_len=512)
    ref = dense.generate([ids], params)[0].output_ids
    assert _offload_output(model, config, "herald", ids, params) == ref


def test_budget_one_equals_dense_on_a_long_prompt_of_the_trained_model(monkeypatch):
    """HERALD at budget 1.0 prints dense's text on an 820-token prompt (textwrap.py's characters
    6,000-9,000; a user trial found it differing when the first block rode on the prompt's last
    prefill forward: the prompt rows' bf16 attention then ran over other key lengths than
    dense's). The prompt is prefilled exactly as the dense engine prefills it."""
    import textwrap

    from herald.models.loader import load_model

    model, config, tok = load_model("code-sdar", "cpu", torch.bfloat16)
    if _row_variant_matmul(model, config.block_size) is not None:
        monkeypatch.setattr(Linear, "forward", _rowwise_linear)
    with open(textwrap.__file__, encoding="utf-8") as f:
        ids = tok.encode(f.read()[6000:9000])
    params = SamplingParams(max_new_tokens=40)
    dense = make_engine(model, config, None, max_batch_size=1, max_seq_len=1024)
    ref = dense.generate([ids], params)[0].output_ids
    eng = make_engine(model, config, MODES["herald"], max_batch_size=1, max_seq_len=1024)
    try:
        assert eng.generate([ids], params)[0].output_ids == ref
    finally:
        eng.close()


def test_lookahead_off_counts_the_synchronous_selection_as_stall():
    """Without lookahead the next block's selection runs after the commit, on the engine's
    thread: the block waits for all of it, so the stall is at least the retrieval time."""
    model, config = _model("tiny-llada2")
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.2, lookahead="off")
    eng = make_engine(
        model,
        config,
        cfg,
        max_batch_size=2,
        max_seq_len=320,
        hooks=EngineHooks(synthetic_prefill=SyntheticPrefill()),
    )
    params = SamplingParams(max_new_tokens=96, num_denoise_steps=2, ignore_eos=True)
    eng.generate(_prompts(config, [192, 192]), params)
    eng.close()
    first, *_, last = eng.stats.blocks
    assert first.retrieval > 0 and first.stall >= first.retrieval
    assert last.retrieval == 0 and last.retrieval_start is None


@pytest.mark.parametrize("max_new_tokens", [65, 2])
def test_next_selection_comes_from_the_draft_whatever_the_batch_mates(max_new_tokens):
    """A request whose block has no mask left after step 0 (here: its first block holds 31 prompt
    tokens and one mask) still takes the draft step, so its next block is selected from its
    draft alone and next to a slower batch mate alike: the same inputs, the same tokens. With
    max_new_tokens=2 the next block is its last: the block's token, already in output_ids after
    step 0, must not make this block look like the last one when it runs alone."""
    model, config = _model("tiny-llada2")
    b = config.block_size
    a = _prompts(config, [2 * b - 1], seed=21)[0]  # first block: 31 prompt tokens + 1 mask
    mate = _prompts(config, [b], seed=22)[0]  # first block: 32 masks
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    cfg = OffloadConfig.for_mode("herald", kv_budget=0.3, selection_threads=2)

    def run(prompts):
        recorder = SelectionRecorder()
        eng = make_engine(
            model, config, cfg, hooks=EngineHooks(on_selection=recorder), max_batch_size=2,
            max_seq_len=256,
        )  # fmt: skip
        reqs = eng.generate(prompts, params)
        eng.close()
        first = recorder.jobs[0]
        row = [r.request_id for r in reqs].index(reqs[0].request_id)
        return reqs[0], first.dense_tail_start[row] - first.prefix_lens[row]

    alone, tail_alone = run([a])
    batched, tail_batched = run([a, mate])
    assert alone.steps_per_block[0] == 1  # the one mask was accepted at step 0
    assert tail_alone == tail_batched == b  # the tail is the draft, after the block's rows
    assert alone.output_ids == batched.output_ids


@pytest.mark.parametrize("engine_mode", ["dense", "herald"])
def test_prefill_time_is_not_also_counted_as_decode_time(monkeypatch, engine_mode):
    """A fake clock that moves only inside prefill chunks (100 s each): every second of it is
    prefill, none decode, also when the offloading engine's commit runs the next boundary's
    admissions (prompts queued behind a running batch, a small prefill budget)."""
    import time

    from herald.engine.base import Engine

    model, config = _model("tiny-sdar")
    offload = None if engine_mode == "dense" else MODES["herald"]
    eng = make_engine(
        model, config, offload, max_batch_size=2, max_seq_len=256, max_prefill_tokens=64
    )
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    chunks = []
    real = type(eng)._prefill

    def prefill(self: Engine, chunk) -> None:
        clock[0] += 100.0
        chunks.append(chunk)
        real(self, chunk)

    monkeypatch.setattr(type(eng), "_prefill", prefill)
    try:
        eng.generate(_prompts(config, [70, 20, 130]), SamplingParams(max_new_tokens=64))
    finally:
        eng.close()
    # two slots: the third prompt is admitted at a boundary of the running batch (the
    # offloading engine's commit)
    assert len(chunks) >= 3
    assert eng.stats.prefill_seconds == 100.0 * len(chunks)
    assert eng.stats.decode_seconds == 0.0


def test_the_lockstep_engine_prefills_its_budget_times_the_blocks_forwards():
    """The offloading engine admits once per block: its per-forward prefill budget is scaled
    by the forwards of its last block (block_size before the first), so a queue behind a
    running batch joins as fast as next to the dense engine, which admits before each forward."""
    model, config = _model("tiny-sdar")
    b = config.block_size
    eng = make_engine(
        model, config, MODES["herald"], max_batch_size=4, max_seq_len=512, max_prefill_tokens=b
    )
    calls = []
    real = eng.scheduler.schedule

    def schedule(num_running, forwards=1):
        chunks = real(num_running, forwards)
        calls.append((num_running, forwards, sum(c.end - c.start for c in chunks)))
        return chunks

    eng.scheduler.schedule = schedule
    params = SamplingParams(max_new_tokens=4 * b, num_denoise_steps=3, ignore_eos=True)
    try:
        eng.generate(_prompts(config, [10 * b] * 4), params)
    finally:
        eng.close()
    # nothing runs yet: block_size forwards' worth (32 blocks): three prompts and two blocks
    assert calls[0] == (0, b, 32 * b)
    running = [c for c in calls if c[0] > 0 and c[2]]
    # then three denoising steps and the commit per block: 4 blocks' worth per boundary (not
    # the unscaled one block) until the fourth prompt's remaining 8 blocks are prefilled
    assert [c[1:] for c in running] == [(4, 4 * b), (4, 4 * b)]


@pytest.mark.parametrize(
    "output_mode,faults",
    [("selected", None), ("full", None), ("selected", FaultInjection(max_delay=0.003, seed=5))],
)
def test_retrieval_groups_leave_tokens_unchanged(output_mode, faults):
    """The retrieval job pipelined over 2 or 3 request groups (each group's staging region, pool
    rows, query copy and page-table slice) decodes the tokens of the one-group job, with rows of
    different lengths (so the groups' k differ) and, in one case, random delays in the job."""
    model, config = _model("tiny-llada2")
    prompts = _prompts(config, [90, 33, 64, 5, 120], seed=6)
    params = SamplingParams(max_new_tokens=96, num_denoise_steps=4, ignore_eos=True)
    outs = {}
    for groups in (1, 2, 3):
        cfg = OffloadConfig.for_mode(
            "herald", kv_budget=0.3, selection_threads=2, output_mode=output_mode,
            retrieval_groups=groups,
        )  # fmt: skip
        eng = make_engine(
            model, config, cfg, hooks=EngineHooks(faults=faults), max_batch_size=5, max_seq_len=256
        )
        try:
            assert (
                eng.policy.worker._group_ranges(5)
                == {1: [(0, 5)], 2: [(0, 2), (2, 5)], 3: [(0, 1), (1, 3), (3, 5)]}[groups]
            )
            outs[groups] = [r.output_ids for r in eng.generate(prompts, params)]
        finally:
            eng.close()
        assert eng.cpu_pool.num_used_pages == 0
    assert outs[2] == outs[1]
    assert outs[3] == outs[1]


def test_retrieval_groups_setting():
    from herald.env import parse

    assert parse({}).retrieval_groups is None
    assert parse({"HERALD_RETRIEVAL_GROUPS": "auto"}).retrieval_groups is None
    assert parse({"HERALD_RETRIEVAL_GROUPS": "3"}).retrieval_groups == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="HERALD_RETRIEVAL_GROUPS"):
            parse({"HERALD_RETRIEVAL_GROUPS": bad})
    with pytest.raises(ValueError, match="retrieval_groups"):
        OffloadConfig.for_mode("herald", retrieval_groups=0)
