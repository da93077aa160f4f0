"""``herald serve`` argument errors: one ``error:`` line (an option's value out of range:
argparse's usage and error lines), exit 2, before any model loads; the ready banner of the real
command."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from helpers import user_error

from herald.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["serve", "--device", "cpu", "--max-waiting", "0"], "--max-waiting"),
        (["serve", "--device", "cpu", "--port", "70000"], "--port"),
        (["serve", "--device", "cpu", "--max-batch-size", "0"], "--max-batch-size"),
        (["serve", "--device", "tpu"], "--device"),
        (["serve", "--device", "cpu", "--kv-budget", "0.5"], "--kv-budget"),
        (["serve", "--device", "cpu", "--mode", "herald", "--kv-budget", "0"], "--kv-budget"),
        (["serve", "--device", "cpu", "--max-prefill-tokens", "0"], "--max-prefill-tokens"),
        (["serve", "--device", "cpu", "--mode", "herald", "--dtype", "fp32"], "bf16"),
    ],
)
def test_serve_user_errors(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in user_error(capsys.readouterr().err)


def _no_model(monkeypatch):
    from herald.server import launch

    def no_build(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(launch, "build_app", no_build)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--header-timeout-s", "0"], "--header-timeout-s"),
        (["--body-timeout-s", "nan"], "--body-timeout-s"),
        (["--keep-alive-timeout-s", "-1"], "--keep-alive-timeout-s"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--port", "-1"], "--port"),
    ],
)
def test_front_flags_are_checked_before_the_model_loads(flags, needle, monkeypatch, capsys):
    _no_model(monkeypatch)
    assert main(["serve", "--device", "cpu", *flags]) == 2
    assert needle in user_error(capsys.readouterr().err)


def test_a_port_in_use_is_found_before_the_model_loads(monkeypatch, capsys):
    _no_model(monkeypatch)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0] and "--port" in err[0]


def test_cpu_pool_larger_than_memory_is_refused_before_the_model_loads(monkeypatch, capsys):
    from herald import cliargs

    _no_model(monkeypatch)
    monkeypatch.setattr(cliargs, "memory_gib", lambda: (3.0, 4.0))  # what check_pool_flags reads
    assert main(["serve", "--device", "cpu", "--mode", "herald", "--cpu-kv-gb", "5"]) == 2
    msg = user_error(capsys.readouterr().err)
    assert "--cpu-kv-gb 5 is more than this machine's available memory" in msg
    assert "3.0 GiB available of 4.0 GiB" in msg
    # and without the stand-in, on this machine: a petabyte does not fit
    monkeypatch.undo()
    _no_model(monkeypatch)
    assert main(["generate", "--prompt", "x", "--mode", "herald", "--cpu-kv-gb", "1e6"]) == 2
    assert "available memory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--mode", "herald", "--cpu-kv-tokens", "30000000"], "--cpu-kv-tokens 30000000"),
        (["--mode", "herald", "--max-batch-size", "1000000"], "--max-batch-size 1000000"),
        (["--max-batch-size", "1000000"], "the KV store of --max-batch-size 1000000"),
    ],
)
def test_kv_larger_than_memory_is_refused_before_the_model_loads(
    flags, needle, monkeypatch, capsys
):
    """The CPU pool by tokens or by slots, and the dense engine's KV store on the CPU, against
    the machine's available memory, from the model's config alone (the embedded model: 8
    layers x 2 KV heads x 64 dims, 4 KiB of K and V per token in bf16)."""
    from herald import cliargs

    _no_model(monkeypatch)
    monkeypatch.setattr(cliargs, "memory_gib", lambda: (3.0, 4.0))
    assert main(["serve", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "more than this machine's available" in err[0]
    assert "3.0 GiB of 4.0 GiB" in err[0]


def test_a_pool_too_small_for_any_request_is_named_at_start(capsys):
    argv = ["serve", "--device", "cpu", "--mode", "herald", "--cpu-kv-tokens", "10", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("error:") and "CPU KV pool is too small to serve any request" in err[-1]
    )
    assert "--cpu-kv-tokens" in err[-1]


def test_a_blank_api_key_variable_is_refused(monkeypatch, capsys):
    from herald.env import reload_settings

    _no_model(monkeypatch)
    monkeypatch.setenv("HERALD_API_KEY", "  ")
    reload_settings()
    try:
        assert main(["serve", "--device", "cpu"]) == 2
    finally:
        monkeypatch.delenv("HERALD_API_KEY")
        reload_settings()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HERALD_API_KEY is set but blank" in err[0]


def test_a_host_that_does_not_resolve_is_named_as_such(monkeypatch, capsys):
    _no_model(monkeypatch)
    assert main(["serve", "--device", "cpu", "--host", "nosuchhost.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen on nosuchhost.invalid:0" in err[0]
    assert "does not resolve" in err[0] and "another server" not in err[0]


def test_serve_prints_a_banner_when_ready_and_serves():
    """The real command in a process of its own: the banner names the model, mode, address and
    limits once the server accepts requests (waited for by reading its stderr, not by time)."""
    argv = [sys.executable, "-m", "herald", "serve", "--model", "tiny-sdar", "--device", "cpu"]
    argv += ["--port", "0", "--max-batch-size", "2", "--max-model-len", "512"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=180)
            if line.startswith("herald serve ready on "):
                break
        url = line.removeprefix("herald serve ready on ").split(": ", 1)[0]
        for part in (
            "model tiny-sdar",
            "mode dense",
            "dtype float32",
            "max batch size 2",
            "max seq len 512",
            "; warm-up ",
            "KV slots on cpu",
            "prefill budget 4096 tokens per forward",
        ):
            assert part in line, line
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_warm_up_runs_before_serving_and_leaves_no_trace() -> None:
    """One short request through the engine at start-up (its one-time costs paid before any
    client), then the engine as if new: nothing held, counters at zero; --no-warmup skips it."""
    from server_kit import start_server

    for mode in ("dense", "herald"):
        srv = start_server(mode=mode, dtype=torch.bfloat16 if mode != "dense" else torch.float32)
        try:
            eng = srv.state.engine_loop.engine
            assert srv.app.state.herald_warmup_s is not None and srv.app.state.herald_warmup_s > 0
            assert eng.stats.num_generated_tokens == 0 and eng.stats.num_forwards == 0
            usage = eng.usage()
            assert usage.gpu_slots_used == 0 and usage.cpu_pages_used == 0, usage
        finally:
            srv.close()
    from herald.server.defaults import SERVE_DEFAULTS
    from herald.server.launch import build_app

    cold = build_app("tiny-sdar", SERVE_DEFAULTS.replace(max_seq_len=256), warm_up=False)
    assert cold.state.herald_warmup_s is None
    assert cold.state.herald.engine_loop.engine.stats.num_forwards == 0


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_weights_larger_than_memory_are_refused_before_they_load(command, monkeypatch, capsys):
    """The embedded model's 14.75M float32 parameters (~56 MiB) against 10 MiB available: one
    error line naming the model and the memory, and nothing loaded."""
    from herald import cliargs
    from herald.models import loader

    _no_model(monkeypatch)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    monkeypatch.setattr(cliargs, "memory_gib", lambda: (10 / 1024, 4.0))
    argv = [command, "--device", "cpu", "--dtype", "fp32"]
    argv += ["--prompt", "x"] if command == "generate" else ["--max-batch-size", "1"]
    argv += [] if command == "generate" else ["--max-seq-len", "64"]  # 2 MiB of KV
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the weights of code-sdar need 56.3 MiB")
    assert "more than this machine's available memory (0.0 GiB of 4.0 GiB)" in err[0]
    assert "use --dtype bf16, a smaller model" in err[0]  # float32 weights: bf16 halves them


def test_the_kv_check_counts_max_seq_len_as_served(monkeypatch):
    """``--max-seq-len`` past the model's context is served at the context (unless
    HERALD_ALLOW_LONG_CONTEXT): the pre-load KV check counts that, not the flag's value."""
    import argparse

    from herald import cliargs
    from herald.cli.serve import _check_kv_memory
    from herald.env import settings
    from herald.models.loader import load_config

    cfg = load_config("code-sdar")
    monkeypatch.setattr(cliargs, "memory_gib", lambda: (3.0, 4.0))
    monkeypatch.delenv("HERALD_ALLOW_LONG_CONTEXT", raising=False)
    settings.cache_clear()
    args = argparse.Namespace(max_batch_size=4, max_seq_len=10**9)
    need = _check_kv_memory(args, cfg, torch.device("cpu"), None, torch.float32)
    per_token = cfg.kv_bytes_per_token(4)
    assert need == pytest.approx(4 * cfg.max_position_embeddings * per_token / 2**30)
    monkeypatch.setenv("HERALD_ALLOW_LONG_CONTEXT", "1")
    settings.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"--max-seq-len 1000000000 tokens needs"):
            _check_kv_memory(args, cfg, torch.device("cpu"), None, torch.float32)
    finally:
        monkeypatch.delenv("HERALD_ALLOW_LONG_CONTEXT")
        settings.cache_clear()
    assert _check_kv_memory(args, cfg, torch.device("cuda"), None, torch.float32) == 0.0


def test_the_memory_check_counts_the_int8_gpu_copy_of_k(monkeypatch):
    """``--first-pass int8-gpu``: its int8 copy of K (D + 4 bytes per offloaded layer, slot, KV
    head and token) goes beside the weights, on the GPU as on the CPU."""
    import argparse

    from herald import cliargs
    from herald.cli.serve import _check_kv_memory
    from herald.config import OffloadConfig
    from herald.models.loader import load_config

    cfg = load_config("code-sdar")
    monkeypatch.setattr(cliargs, "memory_gib", lambda: (64.0, 64.0))
    args = argparse.Namespace(max_batch_size=4, max_seq_len=1024)
    layers = cfg.num_layers - 2
    copy = layers * 4 * cfg.num_kv_heads * 1024 * (cfg.head_dim + 4) / 2**30
    for gb in (None, 1.0):
        plain = OffloadConfig.for_mode("herald", cpu_kv_gb=gb)
        int8 = OffloadConfig.for_mode("herald", cpu_kv_gb=gb, first_pass="int8-gpu")
        cuda = torch.device("cuda")
        assert _check_kv_memory(args, cfg, cuda, plain, torch.bfloat16) == 0.0
        assert _check_kv_memory(args, cfg, cuda, int8, torch.bfloat16) == pytest.approx(copy)
        cpu = torch.device("cpu")
        extra = _check_kv_memory(args, cfg, cpu, int8, torch.bfloat16)
        assert extra - _check_kv_memory(args, cfg, cpu, plain, torch.bfloat16) == pytest.approx(
            copy
        )


def test_a_request_value_wins_over_the_server_denoising_default():
    """vLLM's rule: a request's own value wins; ``steps`` overrides ``threshold``, so a request
    that gives ``threshold`` alone runs threshold mode even where the server's default is
    fixed steps."""
    from herald.server.defaults import DenoiseDefaults

    server = DenoiseDefaults(threshold=0.8, steps=3)
    assert server.resolve(None, None) == (0.8, 3)
    assert server.resolve(None, 2) == (0.8, 2)
    assert server.resolve(0.9, None) == (0.9, None)
    assert server.resolve(0.9, 2) == (0.9, 2)
    assert DenoiseDefaults(threshold=0.8).resolve(None, None) == (0.8, None)
    assert DenoiseDefaults() == DenoiseDefaults(threshold=0.95, steps=None)  # the engine's


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--threshold", "0"], "--threshold must be in (0, 1], got 0"),
        (["--threshold", "1.5"], "--threshold must be in (0, 1], got 1.5"),
        (["--threshold", "nan"], "--threshold must be a finite number, got nan"),
        (["--steps", "0"], "--steps must be in [1, "),
        (["--steps", "-2"], "--steps must be in [1, "),
    ],
)
def test_denoising_defaults_are_checked_before_the_model_loads(flags, needle, monkeypatch, capsys):
    _no_model(monkeypatch)
    assert main(["serve", "--device", "cpu", *flags]) == 2
    assert needle in user_error(capsys.readouterr().err)


def _capture_build_app(monkeypatch) -> dict[str, object]:
    """``herald serve``'s ``build_app`` and ``serve`` stood in for: the keywords ``build_app``
    was given land in the returned dict."""
    from herald.server import launch

    built: dict[str, object] = {}

    def build_app(*args, **kwargs):
        built.update(kwargs)
        return object()

    monkeypatch.setattr(launch, "build_app", build_app)
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: None)
    return built


@pytest.mark.parametrize(
    "flags, threshold, steps",
    [([], 0.95, None), (["--steps", "3"], 0.95, 3), (["--threshold", "0.8"], 0.8, None)],
)
def test_serve_passes_its_denoising_defaults_to_the_app(flags, threshold, steps, monkeypatch):
    from herald.server.defaults import DenoiseDefaults

    built = _capture_build_app(monkeypatch)
    assert main(["serve", "--model", "tiny-sdar", "--device", "cpu", "--port", "0", *flags]) == 0
    assert built["denoise"] == DenoiseDefaults(threshold=threshold, steps=steps)


@pytest.mark.parametrize("flags, on", [([], True), (["--disable-log-stats"], False)])
def test_serve_logs_throughput_lines_unless_disabled(flags, on, monkeypatch):
    built = _capture_build_app(monkeypatch)
    assert main(["serve", "--model", "tiny-sdar", "--device", "cpu", "--port", "0", *flags]) == 0
    assert built["log_stats"] is on


def test_the_app_keeps_its_denoising_defaults_and_names_them_when_ready():
    from herald.server.defaults import SERVE_DEFAULTS, DenoiseDefaults
    from herald.server.launch import banner, build_app

    engine = SERVE_DEFAULTS.replace(max_seq_len=256)
    app = build_app("tiny-sdar", engine, warm_up=False, denoise=DenoiseDefaults(steps=3))
    assert app.state.herald.denoise == DenoiseDefaults(steps=3)
    assert ", by default 3 denoising steps per block;" in banner(app, "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="threshold must be in"):
        build_app("no-such-model", engine, denoise=DenoiseDefaults(threshold=2.0))


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "inf"])
def test_gpu_memory_utilization_out_of_range_is_refused_before_the_model_loads(
    value, monkeypatch, capsys
):
    _no_model(monkeypatch)
    assert main(["serve", "--device", "cpu", "--gpu-memory-utilization", value]) == 2
    want = f"--gpu-memory-utilization must be in (0, 1], got {float(value):g}"
    assert user_error(capsys.readouterr().err) == want


def test_gpu_memory_utilization_is_refused_on_the_cpu(monkeypatch, capsys):
    _no_model(monkeypatch)
    assert main(["serve", "--device", "cpu", "--gpu-memory-utilization", "0.5"]) == 2
    msg = user_error(capsys.readouterr().err)
    assert "--gpu-memory-utilization limits GPU memory only, and the device here is cpu" in msg
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the default device: cpu
    assert main(["serve", "--gpu-memory-utilization", "0.5"]) == 2
    assert "the device here is cpu: give it with --device cuda" in capsys.readouterr().err


def _stand_in_gpu(monkeypatch, free_gib: float, total_gib: float) -> None:
    """A CUDA device 0 whose memory reads ``free_gib`` free of ``total_gib``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda dev=None: (int(free_gib * 2**30), int(total_gib * 2**30))
    )


def test_the_weights_check_counts_the_cap_where_it_is_below_the_free_memory(monkeypatch):
    """On CUDA the weights and KV must fit in the free memory or, where lower, the cap; the
    refusal names whichever was short."""
    from herald.cli.common import check_weights_memory
    from herald.models.loader import load_config

    cfg = load_config("code-sdar")  # 56.3 MiB of float32 weights, 30 GiB of KV beside them
    cuda = torch.device("cuda:0")

    def check(fraction: float | None) -> float:
        return check_weights_memory(
            "code-sdar", cfg, cuda, torch.float32, 30.0, gpu_memory_utilization=fraction
        )

    _stand_in_gpu(monkeypatch, free_gib=70.0, total_gib=80.0)
    assert check(None) == check(0.5) == pytest.approx(56.3 / 1024, abs=1e-3)
    with pytest.raises(ValueError) as e:
        check(0.35)  # 28 GiB allowed
    msg = str(e.value)
    assert "more than what --gpu-memory-utilization 0.35 allows on cuda:0 (28.0 GiB of 80.0" in msg
    assert msg.endswith("or a higher --gpu-memory-utilization") and "free memory" not in msg
    _stand_in_gpu(monkeypatch, free_gib=20.0, total_gib=80.0)  # the free memory is lower
    for fraction in (None, 0.5):
        with pytest.raises(ValueError, match=r"more than cuda:0's free memory \(20.0 GiB of 80"):
            check(fraction)


def test_serve_passes_gpu_memory_utilization_to_the_checks_and_the_app(monkeypatch, capsys):
    """On a (stand-in) GPU the flag reaches the pre-load weights check and ``build_app``."""
    built = _capture_build_app(monkeypatch)
    _stand_in_gpu(monkeypatch, free_gib=70.0, total_gib=80.0)
    argv = ["serve", "--model", "tiny-sdar", "--device", "cuda", "--port", "0"]
    assert main([*argv, "--gpu-memory-utilization", "0.5"]) == 0
    assert built["gpu_memory_utilization"] == 0.5 and built["device"] == torch.device("cuda")
    built.clear()
    assert main(argv) == 0
    assert built["gpu_memory_utilization"] is None
    # a cap of 80 KiB holds none of the weights: refused before the model loads
    built.clear()
    assert main([*argv, "--gpu-memory-utilization", "1e-6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "more than what --gpu-memory-utilization 1e-06 allows on cuda" in err[-1]
    assert not built
