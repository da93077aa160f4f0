"""Building a server: load the model, make the engine, its loop, metrics and the app.

:func:`build_app` is what ``herald serve`` and the tests use; :func:`make_server` and
:func:`serve` run it under uvicorn with the HTTP front's limits (:mod:`herald.server.front`) on a
socket :func:`reserve_port` bound before the model loaded. The engine is built from the same
:class:`~herald.config.EngineConfig` as a benchmark's, so what is served is what is measured
(CUDA graphs on, by default).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
from fastapi import FastAPI

from herald import env
from herald.config import EngineConfig
from herald.engines import build_engine
from herald.kv.manager import RequestTooLarge
from herald.models.loader import load_model
from herald.server import front
from herald.server.api import ServerState, create_app
from herald.server.chat import ChatTemplate
from herald.server.defaults import (
    DENOISE_DEFAULTS,
    FRONT_DEFAULTS,
    SERVE_DEFAULTS,
    DenoiseDefaults,
    FrontLimits,
)
from herald.server.engine_loop import EngineLoop
from herald.server.metrics import ServerMetrics
from herald.server.peak import CAP_FLAG, LOW_HEADROOM, PeakCheck, cap_gpu_memory, check_peak
from herald.server.state import served_names
from herald.server.warmup import WarmUp, warm_up_engine

log = logging.getLogger(__name__)


def build_app(
    model: str,
    engine: EngineConfig = SERVE_DEFAULTS,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    api_key: str | None = None,
    seed: int = 0,
    limits: FrontLimits = FRONT_DEFAULTS,
    served_model_name: str | Sequence[str] | None = None,
    warm_up: bool = True,
    denoise: DenoiseDefaults = DENOISE_DEFAULTS,
    check_memory: bool | None = None,
    gpu_memory_utilization: float | None = None,
    log_stats: bool = False,
) -> FastAPI:
    """Load ``model`` (checkpoint directory or preset) and return the app serving it with the
    engine ``engine`` describes (``engine.offload`` None: dense; offloading modes run bf16
    models), behind the HTTP front's ``limits``. ``max_seq_len`` is capped at the model's
    context. The engine thread starts with the app's lifespan. Raises ValueError for bad
    settings, before the model loads where it can. The model id the server reports and accepts
    is ``served_model_name`` (several: the first is reported, each accepted), else the model's
    name (:func:`~herald.server.state.served_names`); the API key is ``api_key``, else
    ``HERALD_API_KEY``, else none. With ``warm_up`` the engine's one-time costs are paid before
    it serves (:mod:`herald.server.warmup`: every batch size's CUDA graphs when it uses them).
    ``denoise``: how a request that sets neither ``steps`` nor ``threshold`` denoises.
    ``check_memory`` (default: with ``warm_up``, on CUDA) runs the engine's serving peak once
    after the warm-up (:mod:`herald.server.peak`) and raises
    :class:`~herald.server.peak.PeakCheckFailed` (a ValueError) when it runs out of GPU memory.
    ``gpu_memory_utilization`` (CUDA only; default None: the whole card) caps what PyTorch's
    allocator may reserve at that fraction of the card's memory before the model loads
    (:func:`~herald.server.peak.cap_gpu_memory`), so the weights, KV, CUDA graphs, warm-up and
    memory check all run under it; the memory check measures against the cap.
    ``log_stats``: the engine loop logs the periodic throughput line
    (:mod:`herald.server.stats_log`; shown by :func:`serve`).
    """
    names = served_names(model, served_model_name)
    key = (api_key if api_key is not None else env.settings().api_key) or None
    engine.validate()
    limits.validate()
    denoise.validate()
    cap = cap_gpu_memory(gpu_memory_utilization, device)
    net, config, tokenizer = load_model(model, device=device, dtype=dtype, random_init_seed=seed)
    engine = _fit_context(net, config, engine)
    eng = build_engine(net, config, engine)
    log.info("%s", eng.describe())
    usage = eng.usage()
    longest = eng.kv.pages_needed(1, eng.max_seq_len - 1)
    if usage.cpu_pages_total and longest > usage.cpu_pages_total:
        log.warning(
            "the CPU KV pool holds %d pages, a request of --max-seq-len %d tokens needs %d: "
            "such requests will be refused (enlarge --cpu-kv-gb / --cpu-kv-tokens)",
            usage.cpu_pages_total, eng.max_seq_len, longest,
        )  # fmt: skip
    warmed = _warm_up(eng, tokenizer) if warm_up else None
    run_check = check_memory if check_memory is not None else warm_up and eng.cuda
    peak = _check_memory(eng, tokenizer, cap) if run_check else None
    metrics = ServerMetrics()
    loop = EngineLoop(eng, metrics=metrics, log_stats=log_stats)
    template = ChatTemplate.for_model(model, tokenizer)
    state = ServerState(loop, tokenizer, names[0], metrics, key, template, aliases=names[1:],
                        denoise=denoise)  # fmt: skip
    app = create_app(state)
    app.state.herald_warmup = warmed
    app.state.herald_peak = peak
    app.state.herald_warmup_s = None if warmed is None else warmed.seconds
    front.install(app, limits, lambda: state.api_key)
    return app


def _fit_context(net: Any, config: Any, engine: EngineConfig) -> EngineConfig:
    """``engine`` with ``max_seq_len`` capped at the model's context (or the model's positions
    extended past it, with HERALD_ALLOW_LONG_CONTEXT)."""
    if engine.max_seq_len <= config.max_position_embeddings:
        return engine
    if env.settings().allow_long_context:
        log.warning(
            "--max-seq-len %d is more than the model's context (max_position_embeddings %d); "
            "serving it anyway (HERALD_ALLOW_LONG_CONTEXT=1): positions past the model's "
            "context were never trained, outputs there may be degraded",
            engine.max_seq_len, config.max_position_embeddings,
        )  # fmt: skip
        net.ensure_max_positions(engine.max_seq_len)
        return engine
    log.warning(
        "--max-seq-len %d is more than the model's context (max_position_embeddings %d): "
        "serving at most %d tokens per request (HERALD_ALLOW_LONG_CONTEXT=1 serves more)",
        engine.max_seq_len, config.max_position_embeddings, config.max_position_embeddings,
    )  # fmt: skip
    return engine.replace(max_seq_len=config.max_position_embeddings)


def _warm_up(eng: Any, tokenizer: Any) -> WarmUp:
    log.info("warming up")
    try:
        warmed = warm_up_engine(eng, tokenizer)
    except RequestTooLarge as e:
        # the pool cannot hold even the warm-up's one short request: no request could run
        raise ValueError(
            f"the CPU KV pool is too small to serve any request (the start-up warm-up's first "
            f"request did not fit: {e})"
        ) from None
    log.info("warm-up done: %s", warmed.describe())
    return warmed


def _check_memory(eng: Any, tokenizer: Any, cap: int | None) -> PeakCheck:
    log.info("memory check: a full batch at --max-seq-len beside a whole prefill budget")
    peak = check_peak(eng, tokenizer, limit_bytes=cap)
    log.info("memory check done: %s", peak.describe())
    if peak.headroom < LOW_HEADROOM:
        of = f"the GPU memory {CAP_FLAG} allows" if peak.capped else "GPU memory"
        more = f", or a higher {CAP_FLAG}," if peak.capped else ""
        log.warning(
            "the memory check's peak leaves %.1f%% of %s free: fragmentation under load can "
            "take the rest (a lower --max-batch-size or --max-prefill-tokens%s leaves more)",
            100 * peak.headroom, of, more,
        )  # fmt: skip
    return peak


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening), so that a port in use is found
    before the model loads and nobody takes it meanwhile. Port 0: the system picks one.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's, not permitted), with
            the host and port in the message.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror):
            why = "the host name does not resolve; give an address or name of this machine"
        elif e.errno == errno.EADDRINUSE:
            why = "another server holds the port; give another --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "not an address of this machine; give one of its addresses as --host"
        else:
            why = "give another --port, or --host"
        raise OSError(
            e.errno, f"cannot listen on {host}:{port} ({e.strerror or e}): {why}"
        ) from None
    return sock


def bound_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def banner(app: FastAPI, url: str) -> str:
    """The line printed once the server accepts requests: model, mode, device, dtype, limits,
    the KV pools (:meth:`~herald.engine.base.Engine.describe`) and the warm-up."""
    state: ServerState = app.state.herald
    eng = state.engine_loop.engine
    mode = eng.mode if eng.mode == "dense" else f"{eng.mode} (kv budget {eng.kv_budget:g})"
    waiting, budget = eng.scheduler.max_waiting, eng.scheduler.max_prefill_tokens
    warmed = getattr(app.state, "herald_warmup", None)
    peak = getattr(app.state, "herald_peak", None)
    return (
        f"herald serve ready on {url}: model {state.model_name}, mode {mode}, device "
        f"{eng.device}, dtype {str(eng.dtype).removeprefix('torch.')}, max batch size "
        f"{eng.max_batch_size}, max seq len {eng.max_seq_len}, "
        f"max waiting {'unbounded' if waiting is None else waiting}, prefill budget "
        f"{'unbounded' if budget is None else f'{budget} tokens per forward'}, by default "
        f"{state.denoise.describe()}; {eng.describe()}"
        + ("; no warm-up" if warmed is None else f"; warm-up {warmed.describe()}")
        + ("" if peak is None else f"; memory check {peak.describe()}")
        + ("; API key required on /v1, /tokenize and /detokenize" if state.api_key else "")
    )


class _ShutdownCut(logging.Filter):
    """On uvicorn's logger: its ERROR line "Cancel N running task(s), timeout graceful shutdown
    exceeded" becomes one warning of herald's, and so does the traceback of the lifespan that a
    forced quit cancelled. Those requests are answered: a non-streamed one
    gets a 503 ``server_shutting_down``, a stream that error as its last event, then ``data:
    [DONE]`` (:class:`~herald.server.respond.EventStream`): the designed end of a shutdown that
    ran out of time, not a server error."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Traceback") and msg.rstrip().endswith("CancelledError"):
            # a forced quit (a second Ctrl-C) cancelled the lifespan: starlette reports the
            # cancellation as a failed shutdown; serve() stops the engine on the way out
            log.warning("forced quit: requests still running were cut")
            return False
        if "timeout graceful shutdown exceeded" not in msg:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        log.warning("shutdown: %s request(s) still running after the shutdown timeout were cut "
                    "(answered server_shutting_down)", args[0] if args else "some")  # fmt: skip
        return False


_SHUTDOWN_CUT = _ShutdownCut()


def make_server(
    app: FastAPI,
    sock: socket.socket,
    *,
    limits: FrontLimits = FRONT_DEFAULTS,
    log_level: str = "info",
    on_ready: Any = None,
) -> Any:
    """A ``uvicorn.Server`` for ``app`` on ``sock`` with the front's limits; ``on_ready(line)`` is
    called with :func:`banner`'s line once it accepts requests. Run it with
    ``server.run(sockets=[sock])``."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_ready is not None:
                on_ready(banner(app, bound_url(sock)))

    config = uvicorn.Config(
        app,
        http=front.guarded_h11(limits.header_timeout_s),
        # typed int by uvicorn, used as call_later's delay: fractions of a second work
        timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=limits.shutdown_timeout_s,  # type: ignore[arg-type]
        log_level=log_level,
        lifespan="on",
    )
    logging.getLogger("uvicorn.error").addFilter(_SHUTDOWN_CUT)  # once, however many servers
    return ReadyServer(config)


def _show_stats_lines() -> None:
    """The engine loop's throughput lines (:mod:`herald.server.stats_log`, INFO) to stderr,
    once per process."""
    stats = logging.getLogger("herald.server.stats")
    if not any(getattr(h, "_herald_stats", False) for h in stats.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("INFO %(asctime)s %(message)s", "%H:%M:%S"))
        handler._herald_stats = True  # type: ignore[attr-defined]
        stats.addHandler(handler)
        stats.setLevel(logging.INFO)


def _print_ready(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    sock: socket.socket | None = None,
    limits: FrontLimits = FRONT_DEFAULTS,
) -> None:
    """Run ``app`` under uvicorn until interrupted, on ``sock`` (from :func:`reserve_port`) or a
    socket bound to ``host:port`` now; prints :func:`banner`'s line to stderr when ready, and
    the engine loop's throughput lines where the app was built with ``log_stats``."""
    _show_stats_lines()
    sock = sock or reserve_port(host, port)
    server = make_server(app, sock, limits=limits, on_ready=_print_ready)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        # A forced quit (a second Ctrl-C while requests run) cancels the lifespan before its
        # shutdown: the engine thread would still be in a step when the interpreter exits (the
        # process then aborts). Idempotent after a graceful shutdown.
        app.state.herald.engine_loop.stop()
