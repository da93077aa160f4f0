"""``herald serve``: the OpenAI-compatible HTTP server over one engine (:mod:`herald.server`)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

from herald.cli.common import (
    add_first_pass,
    add_kv_pad,
    add_model_source_args,
    check_weights_memory,
    engine_help,
    kv_budget_defaults,
    loading_line,
    model_dtype,
    offload_config,
    pool_error,
    refuse_offload_flags,
)
from herald.cliargs import flag_message, token_count
from herald.config import check_kv_pad, resolve_device
from herald.engines import MODES
from herald.server.defaults import DEFAULT_HOST, DEFAULT_PORT, DENOISE_DEFAULTS, DenoiseDefaults

if TYPE_CHECKING:
    import torch

    from herald.config import OffloadConfig
    from herald.models.config import ModelConfig
    from herald.server.defaults import FrontLimits

_POOL_FLAGS = ("kv_budget", "cpu_kv_gb", "cpu_kv_tokens", "first_pass")


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``serve`` subcommand to ``sub``; engine flags default to ``SERVE_DEFAULTS``."""
    from herald.server.defaults import SERVE_DEFAULTS as D

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (dense or an offloading mode)")
    add_model_source_args(s)
    s.add_argument("--host", default=DEFAULT_HOST, help="bind address (0.0.0.0: every interface)")
    s.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="TCP port (0: one the system picks)"
    )
    # The second name of each is vLLM's for the same setting.
    for flags, name in (
        (("--max-batch-size", "--max-num-seqs"), "max_batch_size"),
        (("--max-seq-len", "--max-model-len"), "max_seq_len"),
    ):
        s.add_argument(
            *flags,
            dest=name,
            type=token_count if name == "max_seq_len" else int,
            default=getattr(D, name),
            help=engine_help(name).rstrip(".")
            + (
                "; at most the model's context (max_position_embeddings) unless "
                "HERALD_ALLOW_LONG_CONTEXT=1"
                if name == "max_seq_len"
                else ""
            )
            + " (default: %(default)s)",
        )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=D.max_waiting,
        help=engine_help("max_waiting").replace("None: unbounded.", "") + " (default: %(default)s)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 and /tokenize, /detokenize (default: "
        "$HERALD_API_KEY, else no key)",
    )
    s.add_argument(
        "--no-warmup",
        action="store_true",
        help="start serving at once, without the warm-up and the memory check. The warm-up runs "
        "every batch size from --max-batch-size down to 1 through the engine on the GPU, so that "
        "its CUDA graphs are captured before any client (on the CPU: one short request). The "
        "memory check then runs a full batch near --max-seq-len beside a whole "
        "--max-prefill-tokens prefill once, on the GPU, and refuses a configuration that runs out "
        "of memory there; it adds about one long prefill and a few blocks to the start-up",
    )
    s.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic throughput line in the server's output (by default one every 10 s "
        "while requests run: generated and prompt tokens/s, running and waiting requests; the "
        "same figures are on /metrics)",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id /v1/models reports and requests may name; several: /v1/models lists "
        "each, requests may name any, responses carry the first (default: the model's name, a "
        "directory's last component)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed for a preset's random weights")
    _add_denoise_args(s)
    s.add_argument(
        "--mode",
        default="dense",
        choices=list(MODES),
        help="the one engine this server runs (requests asking for another mode get a 400)",
    )
    s.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help="offloading modes: fraction of the prefix kept per KV head, in (0, 1] (default: "
        f"{kv_budget_defaults()})",
    )
    s.add_argument(
        "--cpu-kv-gb",
        type=float,
        default=None,
        help="offloading modes: CPU KV pool size in GiB (default: what --max-batch-size "
        "requests of --max-seq-len tokens need); on 4 KiB pages, HERALD_HUGE_PAGES=1 for 2 MiB "
        "pages",
    )
    s.add_argument(
        "--cpu-kv-tokens",
        type=token_count,
        default=None,
        help="offloading modes: CPU KV pool size in tokens, instead of --cpu-kv-gb (default: "
        "as --cpu-kv-gb's)",
    )
    s.add_argument(
        "--max-prefill-tokens",
        type=token_count,
        default=D.max_prefill_tokens,
        help=engine_help("max_prefill_tokens").split(" None:")[0] + " (default: %(default)s)",
    )
    s.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="the fraction of the GPU's memory, in (0, 1], that this server's PyTorch allocator "
        "may reserve (the weights, KV slots, CUDA graphs and activations; not the CUDA context), "
        "applied before the model loads, so the start-up memory check runs under it; CUDA "
        "devices only (default: the whole card)",
    )
    add_first_pass(s)
    add_kv_pad(s)
    _add_front_args(s)
    s.set_defaults(handler=cmd_serve)
    return s


def _add_denoise_args(s: argparse.ArgumentParser) -> None:
    """``--threshold`` or ``--steps``: the request fields' defaults (a request's own wins)."""
    g = s.add_argument_group(
        "denoising defaults",
        "how a request that sets neither steps nor threshold denoises: one of the two modes, "
        "so not both flags; a request's own steps, or its own threshold (threshold mode at it), "
        "wins; a request that sets both is refused",
    )
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--threshold",
        type=float,
        default=DENOISE_DEFAULTS.threshold,
        help="threshold mode: accept every masked position whose confidence is above this, at "
        "least one per step; in (0, 1]",
    )
    mode.add_argument(
        "--steps",
        type=int,
        default=DENOISE_DEFAULTS.steps,
        help="fixed-steps mode: T denoising steps per block, no threshold (default: none, "
        "threshold mode)",
    )


def denoise_defaults(args: argparse.Namespace) -> DenoiseDefaults:
    """The :class:`DenoiseDefaults` of the flags; ValueError naming the flag out of range."""
    denoise = DenoiseDefaults(threshold=args.threshold, steps=args.steps)
    try:
        denoise.validate()
    except ValueError as e:
        msg = flag_message(str(e), {"threshold": "--threshold", "steps": "--steps"})
        raise ValueError(msg) from None
    return denoise


_FRONT_FLAGS = {
    "header_timeout_s": "--header-timeout-s",
    "body_timeout_s": "--body-timeout-s",
    "keep_alive_timeout_s": "--keep-alive-timeout-s",
    "shutdown_timeout_s": "--shutdown-timeout-s",
}
""":class:`FrontLimits` field -> ``herald serve`` flag (besides ``--max-body-mb``)."""


def _add_front_args(s: argparse.ArgumentParser) -> None:
    from herald.config import field_help
    from herald.server.defaults import FRONT_DEFAULTS, FrontLimits

    g = s.add_argument_group("HTTP limits", "what a client may send, and how slowly")
    for name, flag in _FRONT_FLAGS.items():
        help_text = field_help(FrontLimits, name, default=False)
        g.add_argument(flag, type=float, default=getattr(FRONT_DEFAULTS, name), help=help_text)
    g.add_argument(
        "--max-body-mb",
        type=float,
        default=FRONT_DEFAULTS.max_body_bytes / 2**20,
        help="largest request body in MiB (413 above it), checked from Content-Length before "
        "the body is read and counted while a chunked body is read",
    )


def front_limits(args: argparse.Namespace) -> FrontLimits:
    """The :class:`FrontLimits` of the flags; ValueError naming the flag that is out of range."""
    from herald.server.defaults import FrontLimits

    for name, flag in _FRONT_FLAGS.items():
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value:g}")
    mb = args.max_body_mb
    if not (math.isfinite(mb) and mb * 2**20 >= 1):
        raise ValueError(f"--max-body-mb must be a finite positive size in MiB, got {mb:g}")
    return FrontLimits(
        **{name: getattr(args, name) for name in _FRONT_FLAGS}, max_body_bytes=int(mb * 2**20)
    )


def _model_config(model: str) -> ModelConfig | None:
    """The model's config, read before its weights load for the checks below; None when it
    cannot be read (a model that cannot be found is left to the loader's own error)."""
    from herald.models.loader import load_config

    try:
        return load_config(model)
    except (OSError, ValueError):
        return None


def _check_room(cfg: ModelConfig, max_seq_len: int) -> None:
    """ValueError when ``--max-seq-len`` leaves no room for a one-token prompt and one block of
    output."""
    block = cfg.block_size
    if max_seq_len <= block:
        raise ValueError(
            f"--max-seq-len {max_seq_len} leaves no room for a prompt and one block of {block} "
            f"tokens: give at least {block + 1}"
        )


def _check_kv_memory(
    args: argparse.Namespace,
    cfg: ModelConfig,
    device: torch.device,
    offload: OffloadConfig | None,
    dtype: torch.dtype,
) -> float:
    """ValueError, before the model loads, when the KV the flags ask for is more than this
    machine's available memory: the CPU pool of an offloading mode (``--cpu-kv-tokens``, or
    by default every slot at ``--max-seq-len``; ``--cpu-kv-gb`` is checked with the other pool
    flags) and, on the CPU device, the dense engine's KV store. ``--max-seq-len`` counts as the
    server will serve it: capped at the model's context unless HERALD_ALLOW_LONG_CONTEXT is set.
    Returns the GiB of that KV which shares the weights' memory (on the CPU device; with
    ``--first-pass int8-gpu`` also its int8 copy of K, on any device), for
    :func:`~herald.cli.common.check_weights_memory`; a lower bound either way (the engine's
    buffers come on top)."""
    import torch

    from herald.cliargs import memory_gib
    from herald.env import settings

    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = cfg.kv_bytes_per_token(itemsize) // cfg.num_layers  # K and V of one layer
    seq = args.max_seq_len
    if not settings().allow_long_context:
        seq = min(seq, cfg.max_position_embeddings)
    seq_flag = f"--max-seq-len {args.max_seq_len}" + (
        f" (served as {seq}, the model's context)" if seq != args.max_seq_len else ""
    )
    slots = f"--max-batch-size {args.max_batch_size} x {seq_flag}"
    on_device = 0.0  # --first-pass int8-gpu: the int8 copy of K, beside the weights
    if offload is not None and offload.first_pass == "int8-gpu":
        from herald.offload.selection.compact_device import store_bytes

        offloaded = max(cfg.num_layers - offload.num_dense_layers, 0)
        dims = (offloaded, args.max_batch_size, cfg.num_kv_heads, seq, cfg.head_dim)
        on_device = store_bytes(*dims) / 2**30
    if offload is not None:
        if offload.cpu_kv_gb is not None:
            return on_device
        layers = max(cfg.num_layers - offload.num_dense_layers, 0)
        if offload.cpu_kv_tokens is not None:
            tokens, flags = offload.cpu_kv_tokens, f"--cpu-kv-tokens {offload.cpu_kv_tokens}"
        else:
            tokens, flags = args.max_batch_size * seq, slots
        what = "the CPU KV pool of"
    elif device.type == "cpu":
        layers, tokens, flags = cfg.num_layers, args.max_batch_size * seq, slots
        what = "the KV store of"
    else:
        return 0.0
    need = tokens * layers * per_layer / 2**30
    memory = memory_gib()
    if memory is not None and need > memory[0]:
        raise ValueError(
            f"{what} {flags} tokens needs {need:,.1f} GiB, more than this machine's available "
            f"memory ({memory[0]:.1f} GiB of {memory[1]:.1f} GiB): give fewer tokens"
        )
    return (need if device.type == "cpu" else 0.0) + on_device


def cmd_serve(args: argparse.Namespace) -> int:
    from herald.cli import interrupt
    from herald.models.loader import is_preset
    from herald.server.defaults import SERVE_DEFAULTS
    from herald.server.launch import build_app, reserve_port, serve
    from herald.server.peak import check_memory_fraction

    device = resolve_device(args.device)
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_kv_pad(args.kv_pad, "--kv-pad")
    limits = front_limits(args)
    denoise = denoise_defaults(args)
    offload = None
    if args.mode == "dense":
        refuse_offload_flags(args, _POOL_FLAGS)
    else:
        offload = offload_config(args, _POOL_FLAGS)
    dtype = model_dtype(args, device)
    flags = {"--max-batch-size (--max-num-seqs)": args.max_batch_size}
    flags |= {"--max-seq-len (--max-model-len)": args.max_seq_len}
    flags |= {"--max-waiting": args.max_waiting, "--max-prefill-tokens": args.max_prefill_tokens}
    for flag, value in flags.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_memory_fraction(args.gpu_memory_utilization, device)
    if args.api_key is not None and not args.api_key.strip():
        # an unset variable in `--api-key "$KEY"` must not open the server
        raise ValueError(
            "--api-key is empty: give the key, or leave the option out (then $HERALD_API_KEY "
            "if set, else no key)"
        )
    if args.api_key is None:
        from herald.env import settings

        key = settings().api_key
        if key is not None and not key.strip():
            raise ValueError(
                "HERALD_API_KEY is set but blank: no client could send it; give the key, or "
                "unset the variable for an open server"
            )
    cfg = _model_config(args.model)
    if cfg is not None:
        _check_room(cfg, args.max_seq_len)
        kv_gib = _check_kv_memory(args, cfg, device, offload, dtype)
        what = "KV (with --first-pass int8-gpu's int8 copy of K)"
        int8 = offload is not None and offload.first_pass == "int8-gpu"
        gib = check_weights_memory(
            args.model, cfg, device, dtype, kv_gib, what if int8 else "KV",
            gpu_memory_utilization=args.gpu_memory_utilization,
        )  # fmt: skip
    engine = SERVE_DEFAULTS.replace(
        max_batch_size=args.max_batch_size,
        max_seq_len=args.max_seq_len,
        max_waiting=args.max_waiting,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_pad=args.kv_pad,
        offload=offload,
    )
    sock = reserve_port(args.host, args.port)  # a port in use is found before the model loads
    if cfg is not None:
        print(loading_line(args.model, cfg, device, dtype, gib), file=sys.stderr, flush=True)
    try:
        try:
            app = build_app(
                args.model, engine, device=device, dtype=dtype, api_key=args.api_key,
                seed=args.seed, served_model_name=args.served_model_name, limits=limits,
                warm_up=not args.no_warmup, denoise=denoise,
                log_stats=not args.disable_log_stats,
                gpu_memory_utilization=args.gpu_memory_utilization,
            )  # fmt: skip
        except ValueError as e:
            raise pool_error(args, e) from None
        if is_preset(args.model):
            print(
                f"NOTE: '{args.model}' has RANDOM weights: completions are noise.", file=sys.stderr
            )
        interrupt.check()  # a Ctrl-C that the load's libraries swallowed: not on to serving
        serve(app, sock=sock, limits=limits)
    finally:
        sock.close()
    return 0
