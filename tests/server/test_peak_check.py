"""The start-up memory check (herald.server.peak): it runs a full batch near max_seq_len beside
real prefills of a whole budget, leaves the engine as it found it, and turns running out of GPU
memory into a refusal that names the flags (the run itself is the same on the CPU; only the
memory is not measured there)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from herald.config import OffloadConfig, SamplingParams
from herald.engine.scheduler import PrefillChunk
from herald.engines import build_engine
from herald.models.registry import build_model, get_preset
from herald.models.tokenizer import byte_level_tokenizer
from herald.server.defaults import SERVE_DEFAULTS
from herald.server.peak import (
    LOW_HEADROOM,
    PeakCheck,
    PeakCheckFailed,
    PeakPlan,
    PeakRun,
    _failure,
    cap_gpu_memory,
    check_memory_fraction,
    check_peak,
    is_out_of_memory,
    plan_peak,
)


def test_the_plan_fills_the_batch_and_outlasts_the_real_prefill() -> None:
    # 16K context, budget 4,096: one real prompt over four boundaries, so five steps per block
    # (the prefill fits in one block's boundaries); 63 fillers four blocks short of the context
    assert plan_peak(64, 32, 16384, 4096) == PeakPlan(63, 16384 - 128, 128, 1, 16352, 5)
    # a budget of four prompts: five real ones (the fifth's first piece), the rest fillers
    plan = plan_peak(64, 32, 16384, 65536)
    assert (plan.fillers, plan.real, plan.steps) == (59, 5, 3)
    # unbounded: every admitted prompt whole at one boundary
    assert plan_peak(8, 32, 1024, None) == PeakPlan(7, 1024 - 128, 128, 1, 992, 3)
    # more budget than slots: every slot a real request
    assert plan_peak(2, 32, 512, 100_000).fillers == 0
    # a budget far below the context: at most B steps a block, the fillers shorter to outlast
    # the prefill's 127 boundaries
    plan = plan_peak(4, 32, 4096, 32)
    assert plan.steps == 32 and plan.filler_prompt == 4096 - 7 * 32
    # a short context: the fillers still fit (at least a one-token prompt)
    plan = plan_peak(4, 32, 64, 32)
    assert plan.filler_prompt >= 1 and plan.filler_prompt + plan.filler_new <= 64
    assert plan.real_prompt == 32


def test_describe() -> None:
    run = PeakRun(64, 16384, 16352, 63)
    assert run.describe() == (
        "64 request(s) of up to 16,384 tokens at once, 16,352 prompt tokens prefilled beside 63 "
        "running"
    )
    gpu = PeakCheck(run, 9.84, int(70.5 * 2**30), int(79.2 * 2**30))
    assert gpu.describe().endswith(": 9.8 s, peak 70.5 of 79.2 GiB of GPU memory")
    assert 0.10 < gpu.headroom < 0.11
    cpu = PeakCheck(run, 0.2, 0, 0)
    assert cpu.describe().endswith(": 0.2 s") and cpu.headroom == 1.0
    assert PeakRun(0, 0, 0, 0).describe().startswith("no request could run")


def test_describe_and_headroom_under_a_cap() -> None:
    """Under --gpu-memory-utilization the peak is PyTorch's reserved memory against the cap:
    the line says whose limit it is, the headroom is the cap's."""
    run = PeakRun(64, 16384, 16352, 63)
    capped = PeakCheck(run, 9.84, int(60.1 * 2**30), int(74.5 * 2**30), capped=True)
    assert capped.describe().endswith(
        ": 9.8 s, peak 60.1 of 74.5 GiB allowed by --gpu-memory-utilization"
    )
    assert capped.headroom == pytest.approx(1 - 60.1 / 74.5)
    near = PeakCheck(run, 1.0, int(73.0 * 2**30), int(74.5 * 2**30), capped=True)
    assert near.headroom < LOW_HEADROOM  # the warning's test: near the cap, not the card
    assert "GPU memory" not in capped.describe()


def _cuda_memory(monkeypatch: pytest.MonkeyPatch, free: float, total: float, reserved: float):
    """torch.cuda's memory readings stood in for (GiB); the calls that reset statistics
    recorded."""
    calls: list[str] = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "synchronize", lambda dev=None: calls.append("synchronize"))
    monkeypatch.setattr(cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda dev=None: calls.append("reset"))
    monkeypatch.setattr(cuda, "mem_get_info", lambda dev=None: (int(free * 2**30),
                                                                int(total * 2**30)))  # fmt: skip
    monkeypatch.setattr(cuda, "memory_reserved", lambda dev=None: int(reserved * 2**30))
    return calls


def test_the_limit_is_the_cap_where_it_is_below_what_the_card_leaves(monkeypatch) -> None:
    """80 GiB card, 70 free, 8 reserved by PyTorch: 2 GiB are the context's and others'. A cap
    below the 78 GiB those leave PyTorch is the limit, on reserved memory alone; a cap above it
    (or none) leaves the card the limit, on reserved memory plus the rest."""
    from herald.server.peak import _memory_limit

    calls = _cuda_memory(monkeypatch, free=70, total=80, reserved=8)
    dev = torch.device("cuda:0")
    assert _memory_limit(dev, 40 * 2**30) == (0, 40 * 2**30, True)
    assert "reset" in calls  # the peak is measured from here
    card = (2 * 2**30, 80 * 2**30, False)
    assert _memory_limit(dev, None) == card
    assert _memory_limit(dev, 79 * 2**30) == card
    assert _memory_limit(dev, 80 * 2**30) == card


def test_a_refusal_under_a_cap_names_the_flag_that_raises_it() -> None:
    eng = SimpleNamespace(max_batch_size=4, max_seq_len=512, max_prefill_tokens=256)
    plan = plan_peak(4, 32, 512, 256)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. More")
    peak, cap = int(39.5 * 2**30), 40 * 2**30
    for prefilling in (False, True):
        msg = _failure(eng, plan, 3, prefilling, peak, cap, oom, capped=True)
        assert "(peak 39.5 of 40.0 GiB allowed by --gpu-memory-utilization)" in msg, msg
        assert ", or raise --gpu-memory-utilization (CUDA out of memory." in msg, msg
    card = _failure(eng, plan, 3, True, peak, 80 * 2**30, oom)
    assert "--gpu-memory-utilization" not in card
    assert "(peak 39.5 of 80.0 GiB of GPU memory)" in card, card


@pytest.mark.parametrize("value", [0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_a_fraction_outside_zero_to_one_is_refused(value: float) -> None:
    want = f"--gpu-memory-utilization must be in (0, 1], got {value:g}"
    with pytest.raises(ValueError) as e:
        check_memory_fraction(value, "cuda")
    assert str(e.value) == want


def test_the_cap_is_set_on_the_device_and_returned_in_bytes(monkeypatch) -> None:
    """On CUDA, the allocator's fraction on the device's index (the current device for a bare
    ``cuda``), the cap in bytes of the card's total; on the CPU a refusal; None: untouched."""
    set_to: list[tuple[float, int]] = []
    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, dev=None: set_to.append((f, dev)))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert cap_gpu_memory(0.5, "cuda:0") == total // 2
    assert cap_gpu_memory(1, torch.device("cuda")) == total
    assert set_to == [(0.5, 0), (1.0, 1)] and isinstance(set_to[1][0], float)
    assert cap_gpu_memory(None, "cuda") is None
    with pytest.raises(ValueError, match="--gpu-memory-utilization limits GPU memory only"):
        cap_gpu_memory(0.5, "cpu")
    with pytest.raises(ValueError, match="must be in"):
        cap_gpu_memory(2.0, "cuda")
    assert len(set_to) == 2


def test_the_server_caps_before_the_model_loads_and_checks_against_the_cap(monkeypatch) -> None:
    from herald.server import launch

    order: list[str] = []
    limits: list[int | None] = []
    real_load = launch.load_model

    def cap(fraction, device):
        order.append(f"cap {fraction} on {device}")
        return 12345

    def load(*args, **kwargs):
        order.append("load")
        return real_load(*args, **kwargs)

    def check(eng, tokenizer, limit_bytes=None):
        limits.append(limit_bytes)
        return PeakCheck(PeakRun(0, 0, 0, 0), 0.0, 0, 0)

    monkeypatch.setattr(launch, "cap_gpu_memory", cap)
    monkeypatch.setattr(launch, "load_model", load)
    monkeypatch.setattr(launch, "check_peak", check)
    cfg = SERVE_DEFAULTS.replace(max_batch_size=2, max_seq_len=256)
    launch.build_app("tiny-sdar", cfg, warm_up=False, check_memory=True, gpu_memory_utilization=0.5)
    assert order == ["cap 0.5 on cpu", "load"] and limits == [12345]
    monkeypatch.undo()
    monkeypatch.setattr(launch, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match="--gpu-memory-utilization limits GPU memory only"):
        launch.build_app("tiny-sdar", cfg, gpu_memory_utilization=0.5)


def _engine(mode: str, *, cpu_kv_tokens: int | None = None, max_seq_len: int = 512):
    config = get_preset("tiny-sdar")
    dtype = torch.float32 if mode == "dense" else torch.bfloat16
    model = build_model(config, device="cpu", dtype=dtype, seed=1)
    offload = None
    if mode != "dense":
        offload = OffloadConfig.for_mode(mode, kv_budget=0.3, cpu_kv_tokens=cpu_kv_tokens)
    cfg = SERVE_DEFAULTS.replace(
        max_batch_size=4, max_seq_len=max_seq_len, max_prefill_tokens=256, offload=offload
    )
    return build_engine(model, config, cfg), config


@pytest.fixture(params=["dense", "herald"])
def recorded(request: pytest.FixtureRequest) -> Iterator[tuple]:
    """An engine whose prefill chunks are recorded, (tokens, synthetic?, running rows), and its
    forwards' lengths."""
    eng, config = _engine(request.param)
    chunks: list[tuple[int, bool, int]] = []
    real_prefill = eng._prefill

    def prefill(chunk: PrefillChunk) -> None:
        synthetic = eng.hooks.synthetic_prefill is not None
        chunks.append((chunk.end - chunk.start, synthetic, eng.num_running))
        real_prefill(chunk)

    eng._prefill = prefill
    lengths: list[int] = []
    hook = eng.model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    try:
        yield eng, config, chunks, lengths
    finally:
        hook.remove()
        eng.close()


def _empty(eng) -> None:
    assert not eng.has_unfinished()
    usage = eng.usage()
    assert usage.gpu_slots_used == 0 and usage.cpu_pages_used == 0, usage
    assert eng.stats.num_forwards == 0 and eng.stats.num_prefill_tokens == 0


def test_a_full_batch_beside_real_prefill_then_the_engine_as_before(recorded) -> None:
    eng, config, chunks, lengths = recorded
    b = config.block_size
    plan = plan_peak(4, b, 512, 256)
    fillers, filler_len, real_len = plan.fillers, plan.filler_prompt, plan.real_prompt
    check = check_peak(eng, byte_level_tokenizer(config))
    assert check.run.batch == 4 and check.run.context == 512
    assert check.run.prefill_tokens == real_len == 480 and check.run.beside == fillers == 3
    assert check.peak_bytes == 0 and check.total_bytes == 0  # not measured on the CPU
    synthetic = [n for n, s, _ in chunks if s]
    real = [(n, rows) for n, s, rows in chunks if not s]
    # the fillers' prompts skipped the forward; the real one went through it, in forwards of the
    # budget, while the fillers ran
    assert sum(synthetic) == fillers * filler_len
    assert sum(n for n, _ in real) == real_len and all(rows == fillers for _, rows in real)
    assert max(lengths) == 256
    # restored: no synthetic prefill, the budget, nothing held, counters from zero
    assert eng.hooks.synthetic_prefill is None and eng.scheduler.max_prefill_tokens == 256
    _empty(eng)
    want = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=2 * b, num_denoise_steps=4, ignore_eos=True)
    assert len(eng.generate([want], params)[0].output_ids) == 2 * b


def test_fillers_the_cpu_pool_cannot_hold_are_left_out() -> None:
    """A pool of about two requests' pages: one filler, beside the real request (whose pages
    the fillers leave free); the check leaves the pool empty."""
    eng, config = _engine("herald", cpu_kv_tokens=2 * 512 + 64)
    try:
        check = check_peak(eng, byte_level_tokenizer(config))
        # the fillers left the real request's pages free: it was prefilled beside one
        assert check.run.batch == 2 and check.run.prefill_tokens == 480
        assert check.run.beside == 1
        _empty(eng)
    finally:
        eng.close()


def test_a_context_of_one_block_runs_nothing_and_says_so() -> None:
    eng, config = _engine("dense", max_seq_len=32)
    try:
        check = check_peak(eng, byte_level_tokenizer(config))
        assert check.run.batch == 0 and "no request could run" in check.describe()
        _empty(eng)
    finally:
        eng.close()


def test_what_counts_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert is_out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))
    try:  # the retrieval stream's failure, raised from what failed on its thread
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("retrieval stream failed") from inner
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)


def test_another_failure_is_not_taken_for_a_memory_refusal() -> None:
    eng, config = _engine("dense")

    def step():
        raise RuntimeError("an engine bug")

    eng._step = step
    try:
        with pytest.raises(RuntimeError, match="an engine bug"):
            check_peak(eng, byte_level_tokenizer(config))
        assert eng.hooks.synthetic_prefill is None and eng.scheduler.max_prefill_tokens == 256
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["dense", "herald"])
@pytest.mark.parametrize("fail_at", [1, 3])
def test_out_of_memory_is_a_refusal_naming_the_flags(mode: str, fail_at: int) -> None:
    """A step that runs out of GPU memory (the fillers' first step, or one beside the real
    prefill) ends the check with PeakCheckFailed; the engine is left empty and serves."""
    eng, config = _engine(mode)
    real_step, calls = eng._step, [0]

    def step():
        calls[0] += 1
        if calls[0] == fail_at:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 558.00 MiB. GPU 0 has a total capacity of "
                "79.18 GiB\nmore lines"
            )
        return real_step()

    eng._step = step
    try:
        with pytest.raises(PeakCheckFailed) as e:
            check_peak(eng, byte_level_tokenizer(config))
        msg = str(e.value)
        assert "--max-batch-size 4, --max-seq-len 512" in msg, msg
        # the fillers' first step ran no prefill: the budget is not what to lower there
        assert ("--max-prefill-tokens" in msg) == (fail_at > 1), msg
        assert msg.endswith("(CUDA out of memory. Tried to allocate 558.00 MiB)"), msg
        assert isinstance(e.value, ValueError)  # the CLI's error path
        assert eng.hooks.synthetic_prefill is None and eng.scheduler.max_prefill_tokens == 256
        _empty(eng)
        params = SamplingParams(max_new_tokens=32, num_denoise_steps=4, ignore_eos=True)
        assert len(eng.generate([[1, 2, 3]], params)[0].output_ids) == 32
    finally:
        eng.close()


def test_the_server_runs_it_when_asked_and_refuses_to_start_when_it_fails(monkeypatch) -> None:
    from herald.server import launch

    cfg = SERVE_DEFAULTS.replace(max_batch_size=2, max_seq_len=256)
    app = launch.build_app("tiny-sdar", cfg, warm_up=False, check_memory=True)
    peak = app.state.herald_peak
    assert peak is not None and peak.run.batch == 2
    assert "memory check 2 request(s)" in launch.banner(app, "http://x")
    assert launch.build_app("tiny-sdar", cfg, warm_up=False).state.herald_peak is None  # CPU

    def fail(eng, tokenizer, limit_bytes=None):
        raise PeakCheckFailed("out of GPU memory at the start-up memory check: ...")

    monkeypatch.setattr(launch, "check_peak", fail)
    with pytest.raises(ValueError, match="start-up memory check"):
        launch.build_app("tiny-sdar", cfg, warm_up=False, check_memory=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "herald"])
def test_on_cuda_the_peak_is_measured_and_changes_no_reply(mode: str) -> None:
    """On CUDA the check reports a peak within the card, and the engine's replies after it are
    those of an engine that never ran it."""
    config = get_preset("tiny-llada2")
    offload = None if mode == "dense" else OffloadConfig.for_mode(mode, kv_budget=0.3)
    cfg = SERVE_DEFAULTS.replace(
        max_batch_size=4, max_seq_len=256, max_prefill_tokens=128, offload=offload
    )
    prompts = [[5 + i for i in range(n)] for n in (40, 90, 7)]
    params = SamplingParams(max_new_tokens=64, num_denoise_steps=8, ignore_eos=True)
    replies = []
    for run_check in (False, True):
        model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
        eng = build_engine(model, config, cfg)
        try:
            if run_check:
                check = check_peak(eng, byte_level_tokenizer(config))
                assert 0 < check.peak_bytes < check.total_bytes
                assert check.run.batch == 4
                _empty(eng)
            replies.append([r.output_ids for r in eng.generate(prompts, params)])
        finally:
            eng.close()
    assert replies[0] == replies[1]


@pytest.mark.gpu
def test_on_cuda_the_check_runs_under_the_cap() -> None:
    """Under a cap the peak is PyTorch's reserved memory against it. (A cap at what the engine
    already holds need not fail the check: a small model's activations can fit in free blocks of
    the allocator's segments. The refusal's wording under a cap is tested with stand-ins.) The
    cap holds for the whole process: lifted at the end."""
    config = get_preset("tiny-llada2")
    cfg = SERVE_DEFAULTS.replace(max_batch_size=4, max_seq_len=256, max_prefill_tokens=128)
    eng = build_engine(
        build_model(config, device="cuda", dtype=torch.bfloat16, seed=1), config, cfg
    )
    tokenizer = byte_level_tokenizer(config)
    try:
        cap = cap_gpu_memory(0.5, "cuda")
        assert cap is not None
        check = check_peak(eng, tokenizer, limit_bytes=cap)
        assert check.capped and check.total_bytes == cap and 0 < check.peak_bytes < cap
        assert "allowed by --gpu-memory-utilization" in check.describe()
        assert check.run.batch == 4
        _empty(eng)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        eng.close()
