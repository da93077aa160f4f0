"""``herald bench forward``: a CPU smoke run through the CLI, the floor's arithmetic against a
hand computation on the full-size presets' configs (no weights built), the kernel categories,
and the inputs refused before any work."""

from __future__ import annotations

import json
import math

import pytest
import torch

from herald.bench import forward, forward_floor, forward_point, forward_report
from herald.bench.forward_profile import categorize
from herald.cli import main as herald_main
from herald.models.registry import get_preset

SMOKE = ["bench", "forward", "--device", "cpu", "--models", "tiny-llada2", "--contexts", "64",
         "--batches", "1", "--modes", "dense,herald", "--reps", "1", "--warmup", "0",
         "--steps", "2", "--step-blocks", "1", "--selection-threads", "1", "--profile",
         "--profile-reps", "1", "--prefill-prompts", "none"]  # fmt: skip


def test_cpu_smoke_run_through_the_cli_records_every_field(tmp_path, capsys):
    assert herald_main([*SMOKE, "--out", str(tmp_path)]) == 0
    lines = [json.loads(x) for x in (tmp_path / "forward.jsonl").read_text().splitlines()]
    head, recs = lines[0], lines[1:]
    assert head["kind"] == "run" and isinstance(head["command"], str)  # the command as typed
    assert {"machine", "code"} <= set(head) and "source_sha256" in head["code"]
    assert [r["mode"] for r in recs] == ["dense", "herald"]
    for r in recs:
        assert r["kind"] == "forward" and r["status"] == "ok" and r["device"] == "cpu"
        assert (r["model"], r["context"], r["batch"], r["length"]) == ("tiny-llada2", 64, 1, 32)
        assert len(r["forward_ms_all"]) == 1 and r["forward_ms"] > 0 and r["step_ms"] > 0
        fl = r["floor"]
        assert fl["experts_basis"] == "measured" and 0 < fl["experts_hit"] <= fl["experts_total"]
        assert fl["floor_ms"] == max(fl["memory_ms"], fl["compute_ms"]) > 0
        assert r["forward_over_floor"] == pytest.approx(r["forward_ms"] / fl["floor_ms"])
        assert set(r["profile"]["categories_ms"]) == set(forward_report.CATEGORIES)
        assert r["profile"]["top"] and r["profile"]["kernel_ms"] > 0
    # the sparse pool holds what the floor assumes: k = ceil(5% of 64) selected + the last block
    assert recs[1]["budget"] == 0.05 and recs[1]["pool_rows"] == 4 + 32
    out = capsys.readouterr().out
    assert "dense kernels:" in out and "  herald: forward " in out
    # one table, at the end; on the CPU without the GPU floor's comparison, which it says
    assert out.count("forward ms") == 1 and "floor" not in out.replace(forward_report.CPU_NOTE, "")
    assert forward_report.CPU_NOTE in out
    md = (tmp_path / "forward.md").read_text()
    assert "| tiny-llada2 | herald | 64 | 1 | 32 |" in md and forward_report.CPU_NOTE in md
    assert "| floor ms |" not in md
    # a CPU run does not mix into a folder of GPU records
    with (tmp_path / "forward.jsonl").open("a") as f:
        f.write(json.dumps({**recs[0], "device": "cuda"}) + "\n")
    assert herald_main([*SMOKE, "--out", str(tmp_path)]) == 2
    assert "give another --out" in capsys.readouterr().err


def _forward_record(device: str, **fields) -> dict:
    rec = {"kind": "forward", "status": "ok", "model": "llada2-mini", "mode": "dense",
           "context": 32768, "batch": 32, "device": device, "forward_ms": 30.0, "step_ms": 40.0,
           "forward_over_floor": 1.5, "target": None,
           "floor": {"tokens": 1024, "floor_ms": 20.0, "bound": "memory",
                     "experts_basis": "measured"}}  # fmt: skip
    return {**rec, **fields}


def test_the_floor_is_compared_with_gpu_timings_only():
    gpu = forward_report.forward_table([_forward_record("cuda")])
    assert gpu[0] == forward_report.FORWARD_HEADER
    assert gpu[1][0][7:9] == ["20.00 (memory, experts measured)", "1.50x"]
    header, rows = forward_report.forward_table([_forward_record("cpu")])
    assert header == ["model", "mode", "context", "batch", "tokens", "forward ms", "step ms",
                      "target"]  # fmt: skip
    assert rows == [["llada2-mini", "dense", "32K", "32", "1024", "30.00", "40.00", ""]]
    # a failed point keeps its error in the last column
    failed = _forward_record("cpu", status="oom", error="out of memory")
    assert forward_report.forward_table([failed])[1][0][-2:] == ["", "out of memory"]
    assert forward_report.progress_line(_forward_record("cuda")) == (
        "  dense: forward 30.00 ms, step 40.00 ms, 1.50x floor"
    )
    assert forward_report.progress_line(_forward_record("cpu")) == (
        "  dense: forward 30.00 ms, step 40.00 ms"
    )


def test_prefill_only_records_the_engines_real_prefill(tmp_path):
    argv = ["--device", "cpu", "--models", "tiny-sdar", "--modes", "dense", "--prefill-only",
            "--prefill-prompts", "64", "--prefill-requests", "1",
            "--out", str(tmp_path)]  # fmt: skip
    assert forward.main(argv) == 0
    recs = [json.loads(x) for x in (tmp_path / "forward.jsonl").read_text().splitlines()][1:]
    assert [(r["kind"], r["mode"], r["prompt_tokens"], r["status"]) for r in recs] == [
        ("prefill", "dense", 64, "ok")
    ]
    assert recs[0]["prefill_tokens"] == 64 and recs[0]["prefill_tokens_per_s"] > 0
    assert recs[0]["target_tokens_per_s"] is None  # targets are the full-size models' only


def test_prefill_prompts_hold_no_special_token(tmp_path):
    """tiny-llada2's mask id (257) lies among its first ids: the engine refuses a prompt holding
    it, so the prompts are drawn without the special ids."""
    argv = ["--device", "cpu", "--models", "tiny-llada2", "--modes", "dense", "--prefill-only",
            "--prefill-prompts", "64", "--out", str(tmp_path)]  # fmt: skip
    assert forward.main(argv) == 0
    (rec,) = [json.loads(x) for x in (tmp_path / "forward.jsonl").read_text().splitlines()][1:]
    assert rec["status"] == "ok" and rec["prefill_tokens"] == 4 * 64, rec


def _hand_llada_dense_params() -> int:
    """LLaDA2.0-mini's matrices every token multiplies, by hand (docs/MODELS.md)."""
    attn = 2048 * (16 + 2 * 4) * 128 + 2048 * 2048  # fused qkv, o
    moe = 256 * 2048 + 3 * 2048 * 512  # router, one shared expert
    return 20 * attn + 3 * 2048 * 5120 + 19 * moe  # layer 0 is a dense FFN


def test_floor_arithmetic_matches_a_hand_computation_on_llada2_mini():
    cfg = get_preset("llada2-mini", block_size=32)
    g = forward_floor.weight_geometry(cfg)
    assert g.dense_matmul_params == _hand_llada_dense_params() == 310_902_784
    norms = 20 * (2 * 2048 + 2 * 128) + 2048  # input/post norms, q/k norms, final norm
    assert g.dense_bytes == 2 * (g.dense_matmul_params + norms) + 19 * 256 * 4  # + expert_bias
    assert (g.expert_params, g.moe_layers, g.all_experts) == (3 * 2048 * 512, 19, 19 * 256)

    shape = forward_floor.ForwardShape("dense", 32768, 32, 32)
    f = forward_floor.floor(cfg, shape, experts_hit=19 * 256)
    tokens = 32 * 32
    kv = 20 * (32768 + 32) * 32 * (2 * 4 * 128 * 2)
    weights = g.dense_bytes + tokens * 2048 * 2 + 19 * 256 * 3 * 2048 * 512 * 2
    flops = 2 * tokens * (310_902_784 + 19 * 8 * 3 * 2048 * 512)
    flops += tokens * 4 * 16 * 128 * 20 * (32768 + 32)
    assert (f["kv_bytes"], f["weight_bytes"], f["flops"]) == (kv, weights, flops)
    assert f["floor_ms"] == pytest.approx((weights + kv) / 4.3e12 * 1e3)
    assert f["bound"] == "memory" and 15 < f["floor_ms"] < 18  # 31.2 GB weights + 43 GB KV
    assert f["weight_bytes_all_experts"] == weights  # every expert hit at 1,024 tokens

    # HERALD at 5%: 2 dense layers over the prefix, 18 over k + the last block
    k = math.ceil(0.05 * 32768)
    for mode, length in (("herald", 32), ("herald-draft", 64)):
        shape = forward_floor.ForwardShape(mode, 32768, 80, 32, 0.05)
        f = forward_floor.floor(cfg, shape, hbm_tbps=4.8, peak_tflops=1000)
        rows = 2 * (32768 + length) + 18 * (k + 32 + length)
        assert f["kv_bytes"] == rows * 80 * 2 * 4 * 128 * 2
        keys = 2 * (32768 + 32) + 18 * (k + 32 + 32)  # each query: the prefix rows + its block
        t = 80 * length
        assert f["flops"] == 2 * t * (310_902_784 + 19 * 8 * 3 * 2048 * 512) + t * 8192 * keys
        assert f["experts_basis"] == "uniform" and f["experts_hit"] == 19 * 256
        assert f["floor_ms"] == pytest.approx(
            max((f["weight_bytes"] + f["kv_bytes"]) / 4.8e12, f["flops"] / 1e15) * 1e3
        )


def test_floor_arithmetic_matches_a_hand_computation_on_sdar_8b_chat():
    cfg = get_preset("sdar-8b-chat", block_size=32)
    g = forward_floor.weight_geometry(cfg)
    per_layer = 4096 * (32 + 16) * 128 + 4096 * 4096 + 3 * 4096 * 12288
    assert g.dense_matmul_params == 36 * per_layer and g.all_experts == 0
    assert g.dense_bytes == 2 * (36 * per_layer + 36 * (2 * 4096 + 2 * 128) + 4096)
    f = forward_floor.floor(cfg, forward_floor.ForwardShape("dense", 32768, 12, 32))
    t = 12 * 32
    assert f["kv_bytes"] == 36 * (32768 + 32) * 12 * 2 * 8 * 128 * 2
    assert f["flops"] == 2 * t * 36 * per_layer + t * 4 * 32 * 128 * 36 * (32768 + 32)
    assert f["weight_bytes"] == g.dense_bytes + t * 4096 * 2 and f["experts_basis"] == "uniform"
    target = forward_floor.target_for("sdar-8b-chat", "dense", 32768, 12, None)
    assert target is not None and target.limit_ms(f["floor_ms"]) == 1.3 * f["floor_ms"]


def test_expected_experts_and_targets():
    assert forward_floor.expected_experts_hit(4, 2, 1) == pytest.approx(2.0)
    assert forward_floor.expected_experts_hit(256, 8, 0) == 0.0
    assert forward_floor.expected_experts_hit(256, 8, 32) == pytest.approx(
        256 * (1 - (1 - 8 / 256) ** 32)
    )
    assert forward_floor.target_for("llada2-mini", "dense", 32768, 32, None).ms == 21.0
    assert forward_floor.target_for("llada2-mini", "herald", 32768, 80, 0.1) is None
    assert forward_floor.prefill_target("llada2-mini", 16384) == 60_000
    assert forward_floor.prefill_target("llada2-mini", 4096) is None


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        ("block_attention", "attention"),
        ("gate_up_swiglu", "expert GEMMs"),
        (
            "void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<>>>",
            "expert GEMMs",
        ),  # fmt: skip
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "router/top-k"),
        ("triton_per_fused_add_sigmoid_topk_0", "router/top-k"),
        ("nvjet_tst_128x64_64x8_1x2_h_bz_TNN", "dense GEMMs"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms/rope/elementwise"),
        ("Memcpy DtoD (Device -> Device)", "copies"),
        ("aten::mm", "dense GEMMs"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_categories(name, category):
    assert categorize(name) == category


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: a bad input must stop the command before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the command got past its checks")

    monkeypatch.setattr("herald.models.loader.load_model", refuse)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--models", "tiny-nope"], "unknown preset 'tiny-nope'"),
        (["--models", "tiny-sdar", "--contexts", "256"], "--contexts and --batches together"),
        (["--models", "tiny-sdar", "--contexts", "16", "--batches", "1"], "--contexts must be"),
        (["--models", "tiny-sdar", "--contexts", "256", "--batches", "0"], "--batches must be"),
        (["--models", "tiny-sdar", "--kv-budget", "1.5"], "--kv-budget is a fraction"),
        (["--models", "tiny-sdar", "--prefill-prompts", "0"], "--prefill-prompts must be >= 32"),
        (["--models", "tiny-sdar", "--prefill-prompts", "none", "64"], "lengths or none"),
        (["--models", "tiny-sdar", "--reps", "0"], "--reps must be >= 1"),
        (["--models", "tiny-sdar", "--hbm-tbps", "0"], "--hbm-tbps must be positive"),
        (["--models", "tiny-sdar", "--device", "tpu"], "--device must be"),
        (["--models", "tiny-sdar"], "no acceptance target"),
        (["--models", "tiny-sdar", "--prefill-only"], "nothing to measure"),
        (["--models", "tiny-sdar", "--prefill-only", "--contexts", "64"], "--prefill-only"),
    ],
)
def test_bad_inputs_fail_before_any_work(flags, message, tmp_path, capsys, no_model):
    assert forward.main(["--device", "cpu", *flags, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "forward.jsonl").exists()


@pytest.mark.parametrize(
    ("given", "lengths"),
    [
        (["64", "128"], [64, 128]),
        (["64,128"], [64, 128]),
        (["4K,", "16K"], [4096, 16384]),
        (["none"], []),
        (["off"], []),
    ],
)
def test_prefill_prompts_take_spaces_or_commas_and_none_skips(given, lengths, no_model):
    args = forward.build_parser().parse_args(["--device", "cpu", "--prefill-prompts", *given])
    forward.check_args(args)
    assert forward.prefill_prompts(args) == lengths


def test_budget_is_a_deprecated_alias_of_kv_budget(capsys):
    args = forward.build_parser().parse_args(["--budget", "0.1"])
    assert args.budget == 0.1 and forward.settings(args).budget == 0.1
    assert "--budget is deprecated" in capsys.readouterr().err
    assert forward.build_parser().parse_args(["--kv-budget", "0.2"]).budget == 0.2
    assert "--budget" not in forward.build_parser().format_help().replace("--kv-budget", "")


def test_a_point_that_does_not_fit_is_refused_before_allocating(
    tmp_path, capsys, monkeypatch, no_model
):
    monkeypatch.setattr("herald.bench.throughput_point.mem_available_gib", lambda: 16.0)
    argv = ["--device", "cpu", "--models", "sdar-8b-chat", "--contexts", "32K", "--batches",
            "8", "--modes", "dense", "--out", str(tmp_path)]  # fmt: skip
    assert forward.main(argv) == 2
    err = capsys.readouterr().err
    assert "sdar-8b-chat 32K bs 8 (dense engine): needs ~" in err and "16.0 GiB available" in err
    # the estimate: the weights and the KV cache as the dense engine sizes it
    cfg = get_preset("sdar-8b-chat", block_size=32)
    st = forward_point.Settings(torch.device("cpu"))
    seq = 32768 + st.new_tokens(32)
    assert (
        forward_point.store_bytes(cfg, "dense", 32768, 8, st) == cfg.kv_bytes_per_token() * 8 * seq
    )


def test_dry_run_lists_the_targets_with_their_floors(capsys, no_model):
    assert forward.main(["--dry-run", "--device", "cuda", "--prefill-prompts", "16K"]) == 0
    out = capsys.readouterr().out
    assert "llada2-mini   herald-draft  32K      80" in out and "<= 26 ms" in out
    assert "<= 1.3x floor" in out and "prefill: 16K prompts" in out


def test_the_timed_forward_runs_in_inference_mode_as_the_engines_step():
    """Outside inference mode a compiled piece recompiles for grad mode inside the CUDA-graph
    capture, which invalidates it (the H200 run failed so); on any device the forward must not
    record autograd state."""
    from herald.models.loader import load_model

    st = forward_point.Settings(device=torch.device("cpu"), steps=2, selection_threads=1)
    model, cfg, _ = load_model("tiny-llada2", device="cpu", dtype=torch.float32,
                               random_init_seed=0, block_size=32)  # fmt: skip
    ps = forward_point.point_settings(model, cfg, st, None)
    engine, _ = forward_point.open_engine(ps, "tiny-llada2", 64, 1, "dense", st)
    try:
        call = forward_point.forward_call(engine, "dense")
        for out in (call(), call.eager()):
            assert out.is_inference() and not out.requires_grad
    finally:
        engine.close()
