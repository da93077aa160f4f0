"""The start-up warm-up (herald.server.warmup): every batch size from the largest down to 1 runs
its forwards before the server serves (so each is captured as CUDA graphs), the engine is left
empty with its counters reset, and the replies after it are the replies without it."""

from __future__ import annotations

import pytest
import torch

from herald.config import OffloadConfig, SamplingParams
from herald.engines import build_engine
from herald.models.registry import build_model, get_preset
from herald.models.tokenizer import byte_level_tokenizer
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.warmup import WarmUp, graph_pool_bytes, warm_up_engine, warm_up_plan


def test_the_plan_staggers_one_wave_when_it_fits() -> None:
    assert warm_up_plan(4, 32, 1024, 10, all_sizes=True) == [[64, 96, 128, 160]]
    assert warm_up_plan(4, 32, 1024, 10, all_sizes=False) == [[64]]


def test_the_plan_falls_back_to_one_wave_per_size_in_a_short_context() -> None:
    # 4 + 1 blocks do not fit after the prompt: one wave per batch size, two blocks each
    assert warm_up_plan(4, 32, 160, 10, all_sizes=True) == [[64] * 4, [64] * 3, [64] * 2, [64]]
    # one block left: every request gets one
    assert warm_up_plan(2, 32, 64, 10, all_sizes=True) == [[32, 32], [32]]
    with pytest.raises(ValueError, match="no 32-token block"):
        warm_up_plan(2, 32, 40, 10, all_sizes=True)


def test_describe_names_the_sizes_and_the_graphs() -> None:
    w = WarmUp(12.34, (1, 2, 3, 4), 8, 3 * 2**30, 2**30)
    assert w.describe() == (
        "12.3 s, batch sizes 1-4, 8 CUDA-graph shapes (1.00 GiB in their private pools; "
        "PyTorch's reserved memory +3.00 GiB over the warm-up)"
    )
    assert WarmUp(0.5, (1,), 0, 0).describe() == "0.5 s, batch sizes 1"


def test_graph_pool_bytes_counts_the_private_pools_of_one_device() -> None:
    segments = [
        {"device": 0, "total_size": 100, "segment_pool_id": (0, 0)},  # the default pool
        {"device": 0, "total_size": 20, "segment_pool_id": (1, 1)},  # a graph's
        {"device": 0, "total_size": 3, "segment_pool_id": (1, 2)},
        {"device": 1, "total_size": 1000, "segment_pool_id": (1, 1)},  # another card
    ]
    assert graph_pool_bytes(segments, 0) == 23 and graph_pool_bytes(segments, 1) == 1000
    assert graph_pool_bytes([], 0) == 0


def _engine(mode: str, device: str, max_batch_size: int, max_seq_len: int = 512):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    preset = "tiny-llada2" if device == "cuda" else "tiny-sdar"
    config = get_preset(preset)
    if mode != "dense" and device == "cpu":
        dtype = torch.bfloat16
    model = build_model(config, device=device, dtype=dtype, seed=1)
    offload = None if mode == "dense" else OffloadConfig.for_mode(mode, kv_budget=0.3)
    cfg = SERVE_DEFAULTS.replace(
        max_batch_size=max_batch_size, max_seq_len=max_seq_len, offload=offload
    )
    return build_engine(model, config, cfg), config


@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_every_batch_size_runs_several_block_forwards(mode: str) -> None:
    """all_sizes on CPU (no graphs here; the walk is the same): each batch size 1..4 runs at
    least two B-token forwards (one eager, one to capture, on CUDA); then nothing is held and
    the counters start from zero."""
    eng, config = _engine(mode, "cpu", 4)
    try:
        w = warm_up_engine(eng, byte_level_tokenizer(config), all_sizes=True)
        assert w.batch_sizes == (1, 2, 3, 4)
        b = config.block_size
        for bs in range(1, 5):
            assert eng.runner.forwards.get((bs, b), 0) >= 2, eng.runner.forwards
        assert eng.stats.num_forwards == 0 and eng.stats.num_generated_tokens == 0
        usage = eng.usage()
        assert usage.gpu_slots_used == 0 and usage.cpu_pages_used == 0, usage
        assert not eng.has_unfinished()
    finally:
        eng.close()


def test_on_cpu_the_default_is_one_request() -> None:
    eng, config = _engine("dense", "cpu", 4)
    try:
        w = warm_up_engine(eng, byte_level_tokenizer(config))
        assert w.batch_sizes == (1,) and w.graph_shapes == 0 and w.gpu_bytes == 0
    finally:
        eng.close()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 90, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_warm_up_captures_every_size_and_changes_no_reply(mode: str) -> None:
    """On CUDA: after the warm-up every batch size 1..4 has graphs (its main B-token shape), and
    the same prompts give the same tokens as on an engine that was not warmed."""
    params = SamplingParams(max_new_tokens=96, num_denoise_steps=8, ignore_eos=True)
    cold, config = _engine(mode, "cuda", 4, 256)
    try:
        want = [r.output_ids for r in cold.generate(_prompts(), params)]
    finally:
        cold.close()
    warm, config = _engine(mode, "cuda", 4, 256)
    try:
        w = warm_up_engine(warm, byte_level_tokenizer(config))
        assert w.batch_sizes == (1, 2, 3, 4)
        assert w.graph_shapes >= 4
        # the pools may be carved from blocks reserved before the warm-up: no bound by its growth
        assert w.graph_pool_bytes > 0
        b = config.block_size
        assert all((bs, b) in warm.runner._graphs for bs in range(1, 5))
        got = [r.output_ids for r in warm.generate(_prompts(), params)]
    finally:
        warm.close()
    assert got == want


def test_max_seq_len_past_the_models_context_is_capped_unless_allowed(monkeypatch, caplog) -> None:
    """--max-seq-len above max_position_embeddings: capped with a warning by default; served
    with HERALD_ALLOW_LONG_CONTEXT=1 (the RoPE table grown to cover it)."""
    from herald import env
    from herald.server.launch import build_app

    context = get_preset("tiny-sdar").max_position_embeddings
    long = SERVE_DEFAULTS.replace(max_seq_len=context * 2, max_batch_size=1)
    capped = build_app("tiny-sdar", long, warm_up=False)
    assert capped.state.herald.engine_loop.engine.max_seq_len == context
    monkeypatch.setenv("HERALD_ALLOW_LONG_CONTEXT", "1")
    env.reload_settings()
    try:
        app = build_app("tiny-sdar", long, warm_up=False)
    finally:
        monkeypatch.delenv("HERALD_ALLOW_LONG_CONTEXT")
        env.reload_settings()
    eng = app.state.herald.engine_loop.engine
    assert eng.max_seq_len == context * 2
    assert eng.model.rotary.max_positions >= context * 2
    assert "HERALD_ALLOW_LONG_CONTEXT=1" in caplog.text


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("on", True),
        ("", False),
        ("0", False),
        ("false", False),
        ("off", False),
    ],  # fmt: skip
)
def test_the_long_context_switch_reads_the_usual_spellings(value: str, allowed: bool) -> None:
    from herald import env

    assert env.parse({"HERALD_ALLOW_LONG_CONTEXT": value}).allow_long_context is allowed
    assert env.parse({}).allow_long_context is False


def test_a_long_context_switch_it_does_not_understand_is_an_error() -> None:
    from herald import env

    with pytest.raises(ValueError, match="HERALD_ALLOW_LONG_CONTEXT='2'; expected 1/true"):
        env.parse({"HERALD_ALLOW_LONG_CONTEXT": "2"})
