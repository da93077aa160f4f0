"""End-to-end load benchmark of ``herald serve`` over loopback.

``herald bench serve`` (or ``python -m herald.bench.serve``) starts the real server, ``herald
serve`` in a child process (127.0.0.1, a free port; the engine flags as ``herald serve``'s; its
output in ``OUT/server.log``; ``--server thread`` runs it in a thread of this process instead),
or with ``--url`` uses a server already running, and loads it through the official ``openai``
client: streaming completions of real text from the local Python standard library, cut to exactly
``--prompt-tokens`` of the model's tokens, one load level per ``--concurrency`` value and prompt
length, ``--requests`` per level, each level cut off after ``--duration-limit-s`` (the requests
left are cancelled and counted). Each level reports generated and prompt tokens/s over its wall
time, time to first chunk, time between chunks and end-to-end latency (p50 / p90 / p99) and its
completed / failed / cancelled counts; from the server's ``/metrics`` read before and after it,
the engine's prefill and decode seconds and prompt and generated tokens over the level, and the
served tokens/s without the prefill time. One JSON line per level is appended to
``OUT/serve_bench.jsonl`` after a line naming the machine, code and command, then a summary line
once the run has ended, and ``OUT/README.md`` is rebuilt from every record there.
``--throughput-point`` adds, per level, ``herald bench throughput``'s decode figure for the same
configuration and the ratio of the served rate to it.

On a CPU, with the embedded model, then HERALD on the tiny preset with the throughput figure
beside each level:

    herald bench serve --device cpu --prompt-tokens 256 --concurrency 1 4 --requests 8 \\
        --max-tokens 64 --steps 4 --out /tmp/serve-bench
    herald bench serve --device cpu --model tiny-sdar --mode herald --prompt-tokens 256 \\
        --concurrency 1 4 --requests 8 --max-tokens 64 --steps 4 --throughput-point \\
        --out /tmp/serve-bench
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import torch

from herald.bench.common import benchmark_main, benchmark_parser, register_benchmark
from herald.bench.serve_client import server_card
from herald.bench.serve_prompts import StdlibPrompts
from herald.bench.serve_report import (
    JSONL_NAME,
    comparison,
    group_runs,
    load_records,
    table,
    table_notes,
    write_readme,
)
from herald.bench.serve_run import (
    ChildServer,
    InProcessServer,
    Plan,
    Records,
    level_head,
    load_served_model,
    run_levels,
    run_points,
)
from herald.bench.throughput_records import log
from herald.cliargs import (
    add_list,
    add_model_source_args,
    check_pool_flags,
    flag_message,
    resolve_dtype,
    token_count,
)
from herald.config import OffloadConfig, resolve_device
from herald.engines import MODES
from herald.env import settings

_POOL_FLAGS = ("kv_budget", "cpu_kv_gb", "cpu_kv_tokens")
_SERVER_FLAGS = ("mode", "device", "dtype", *_POOL_FLAGS, "max_batch_size", "max_seq_len",
                 "max_prefill_tokens", "gpu_memory_utilization", "server")  # fmt: skip
"""Flags of the server this benchmark starts (refused with ``--url``)."""


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags, as ``herald serve``'s."""
    add_model_source_args(p)  # --model: with --url, the model whose tokenizer builds the prompts
    p.add_argument(
        "--url",
        default=None,
        help="load the server already running at this "
        "address (http://HOST:PORT) instead of starting one (default: start one)",
    )
    p.add_argument("--api-key", default=None, help="Bearer key of the --url server (default: none)")
    p.add_argument("--mode", default=None, choices=list(MODES), help="engine (default: dense)")
    p.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help="offloading modes' KV budget (default: the mode's)",
    )
    p.add_argument(
        "--cpu-kv-gb",
        type=float,
        default=None,
        help="offloading modes: CPU pool GiB (default: what the batch and length need)",
    )
    p.add_argument(
        "--cpu-kv-tokens",
        type=token_count,
        default=None,
        help="CPU pool size in tokens (default: --cpu-kv-gb, else what the batch and length need)",
    )
    # The second name of each is vLLM's for the same setting, as in herald serve.
    p.add_argument(
        "--max-batch-size",
        "--max-num-seqs",
        dest="max_batch_size",
        type=int,
        default=None,
        help="running requests at most (default: the largest --concurrency)",
    )
    p.add_argument(
        "--max-seq-len",
        "--max-model-len",
        dest="max_seq_len",
        type=token_count,
        default=None,
        help="tokens per request (default: the longest prompt + --max-tokens)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=token_count,
        default=None,
        help="herald serve's --max-prefill-tokens: prompt tokens prefilled per decode forward "
        "of the running batch (the offloading modes admit once per block, scaled by its "
        "forwards) (default: herald serve's)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="F",
        help="herald serve's cap on the fraction of the GPU's memory its PyTorch allocator may "
        "reserve, in (0, 1] (default: none, the whole card)",
    )
    p.add_argument("--seed", type=int, default=0, help="a preset's weights; the prompts' order")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_server_arguments(p)
    add_list(
        p,
        "--prompt-tokens",
        kind=token_count,
        default=[256],
        metavar="TOKENS",
        help="prompt length(s) in the model's tokens",
    )
    add_list(
        p,
        "--concurrency",
        kind=int,
        default=[1, 4],
        metavar="N",
        help="requests in flight, one load level each",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default: twice its concurrency)",
    )
    p.add_argument(
        "--max-tokens", type=token_count, default=64, help="tokens generated per request"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=20,
        help="denoising steps per block, sent as the request's steps (0: not sent)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode to --max-tokens past EOS (default: on; --no-ignore-eos stops at EOS)",
    )
    p.add_argument(
        "--duration-limit-s",
        type=float,
        default=120.0,
        help="each load level's wall-clock limit in seconds: requests still running or not yet "
        "sent then are cancelled and counted (per level, not the whole run's)",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="requests sent before each prompt length's levels, not recorded",
    )
    p.add_argument(
        "--throughput-point",
        action="store_true",
        help="also measure herald bench throughput's point of each level",
    )
    p.add_argument(
        "--server",
        choices=("process", "thread"),
        default=None,
        help="run the server started here as `herald serve` in a child process (default: as a "
        "user runs it, its output in OUT/server.log) or in a thread of this process, whose "
        "streaming clients then share the server's interpreter lock (slower, fewer processes)",
    )
    p.add_argument("--out", type=Path, required=True, help="folder of serve_bench.jsonl, README")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, values in (
        ("--concurrency", args.concurrency),
        ("--prompt-tokens", args.prompt_tokens),
    ):
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"{flag} must be >= 1, got {bad[0]}")
    for flag, value in (("--requests", args.requests),
                        ("--max-batch-size (--max-num-seqs)", args.max_batch_size),
                        ("--max-seq-len (--max-model-len)", args.max_seq_len),
                        ("--max-prefill-tokens", args.max_prefill_tokens)):  # fmt: skip
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    for flag, value in (("--steps", args.steps), ("--warmup-requests", args.warmup_requests)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if not (math.isfinite(args.duration_limit_s) and args.duration_limit_s > 0):
        raise ValueError(
            f"--duration-limit-s must be a positive number, got {args.duration_limit_s}"
        )
    if args.throughput_point and args.steps == 0:
        raise ValueError("--throughput-point needs --steps >= 1 (the throughput benchmark decodes "
                         "fixed steps per block)")  # fmt: skip


def _load_tokenizer(model: str) -> tuple[Any, Any]:
    """(config, tokenizer) of ``model`` without building it; ValueError for an unknown one."""
    from herald.models.loader import BUNDLED_CHECKPOINTS, checkpoint_path, is_preset, load_config
    from herald.models.registry import list_presets
    from herald.models.tokenizer import byte_level_tokenizer, load_tokenizer

    if not (Path(model).is_dir() or is_preset(model) or model in BUNDLED_CHECKPOINTS):
        raise ValueError(
            f"--model {model!r} is neither a checkpoint directory, a bundled checkpoint "
            f"({', '.join(BUNDLED_CHECKPOINTS)}) nor a preset ({', '.join(list_presets())})"
        )
    config = load_config(model)
    path = checkpoint_path(model)
    tok = load_tokenizer(path, config) if path.is_dir() else byte_level_tokenizer(config)
    return config, tok


def _check_lengths(args: argparse.Namespace, context: int, what: str) -> None:
    longest = max(args.prompt_tokens)
    if longest > context - args.max_tokens:
        raise ValueError(
            f"--prompt-tokens {longest} + --max-tokens {args.max_tokens} is more than {what} "
            f"({context} tokens): at most {context - args.max_tokens} prompt tokens"
        )


def _offload_config(args: argparse.Namespace, mode: str) -> OffloadConfig | None:
    given = {name: getattr(args, name) for name in _POOL_FLAGS if getattr(args, name) is not None}
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    if mode == "dense":
        if given:
            raise ValueError(f"{flags}: offloading modes' flags; --mode dense keeps the KV on "
                             "the device")  # fmt: skip
        return None
    check_pool_flags(args)
    try:
        return OffloadConfig.for_mode(mode, **given)
    except ValueError as e:
        msg = flag_message(str(e), {name: "--" + name.replace("_", "-") for name in given})
        raise ValueError(f"--mode {mode}: {msg}") from None


def _server_config(args: argparse.Namespace, mode: str, config: Any) -> tuple[Any, ...]:
    """(offload, engine, context) of the server to start, every flag checked."""
    from herald.server.defaults import SERVE_DEFAULTS

    offload = _offload_config(args, mode)
    model_ctx = config.max_position_embeddings
    msl = args.max_seq_len or max(args.prompt_tokens) + args.max_tokens
    if settings().allow_long_context:  # herald serve then serves past the model's context too
        model_ctx = max(model_ctx, msl)
    context = min(msl, model_ctx)
    if args.max_seq_len is not None and args.max_seq_len <= model_ctx:
        _check_lengths(args, context, "--max-seq-len")
    _check_lengths(args, context, f"the context of {args.model}, its max_position_embeddings")
    waiting = max(SERVE_DEFAULTS.max_waiting or 0, max(args.concurrency))
    engine = SERVE_DEFAULTS.replace(
        max_batch_size=args.max_batch_size or max(args.concurrency), max_seq_len=context,
        max_waiting=waiting, offload=offload,
        max_prefill_tokens=args.max_prefill_tokens or SERVE_DEFAULTS.max_prefill_tokens,
    )  # fmt: skip
    engine.validate()
    return offload, engine, context


def check_args(args: argparse.Namespace) -> Plan:
    """Every input checked before anything starts; ValueError with one line otherwise. The
    prompts are built here too (a standard library too small for them is an input error)."""
    _check_numbers(args)
    if importlib.util.find_spec("openai") is None:
        raise ValueError("herald bench serve loads the server through the openai client: "
                         "pip install openai (it is in herald's dev extras)")  # fmt: skip
    config, tok = _load_tokenizer(args.model)
    if args.url is not None:
        given = [f"--{d.replace('_', '-')}" for d in _SERVER_FLAGS if getattr(args, d) is not None]
        if given or args.throughput_point:
            given += ["--throughput-point"] if args.throughput_point else []
            does, sets, it = (
                ("does", "it sets", "it") if len(given) == 1 else ("do", "they set", "them")
            )
            raise ValueError(
                f"{', '.join(given)} {does} not apply with --url: {sets} up the server this "
                "benchmark starts, and --url loads one already running, which keeps its own "
                f"settings (leave {it} out, or leave out --url)"
            )
        if not args.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be http://HOST:PORT, got {args.url!r}")
        plan = Plan(
            args, torch.device("cpu"), None, "?", None, None, config.max_position_embeddings
        )
    else:
        from herald.server.peak import check_memory_fraction

        mode = args.mode or "dense"
        device = resolve_device(args.device)
        check_memory_fraction(args.gpu_memory_utilization, device)
        dtype = resolve_dtype(mode, args.dtype, device)
        offload, engine, context = _server_config(args, mode, config)
        plan = Plan(args, device, dtype, mode, offload, engine, context)
    plan.block_size = config.block_size
    source = StdlibPrompts(tok, seed=args.seed)
    n = max(max(plan.requests(c) for c in args.concurrency), args.warmup_requests)
    plan.prompts = {p: [source.prompt(p, i) for i in range(n)] for p in args.prompt_tokens}
    plan.source = source.describe()
    return plan


def run(args: argparse.Namespace) -> int:
    plan = check_args(args)
    records = Records(args.out)
    server: ChildServer | InProcessServer | None = None
    if args.url is None:
        where = args.server or "process"
        log(f"starting herald serve ({where}): {args.model}, {plan.mode}, {plan.device}")
        if where == "process":
            server = ChildServer(plan, args.out / "server.log")
        else:
            server = InProcessServer(plan)
        url = server.start()
    else:
        url = args.url.rstrip("/")
    try:
        card = server_card(url, args.api_key)
        if args.url is not None:
            _check_lengths(args, int(card.get("max_model_len") or plan.context),
                           "the server's max_model_len")  # fmt: skip
        info = server.describe() if server is not None else {
            "max_seq_len": card.get("max_model_len"),
            "block_size": card.get("herald", {}).get("block_size")}  # fmt: skip
        head = level_head(plan, card, info)
        failed = run_levels(plan, url, head, records)
    finally:
        net_config = server.stop() if server is not None else None
    if args.throughput_point and server is not None:
        run_points(plan, *(net_config or load_served_model(plan)), head, records)
    (this,) = [r for r in group_runs(load_records(args.out)) if r["levels"]
               and r["levels"][0]["run_id"] == records.run_id]  # fmt: skip
    records.add({"kind": "summary", "rows": comparison(this["levels"], this["points"])})
    write_readme(args.out)
    print("\n".join([table(this["levels"], this["points"]),
                     *table_notes(this["levels"], this["points"])]))  # fmt: skip
    log(f"wrote {args.out / JSONL_NAME} and {args.out / 'README.md'}")
    if failed:
        print(f"error: {failed} request(s) failed (see the records' errors)", file=sys.stderr)
    return 1 if failed else 0


def register(subparsers: Any) -> None:
    """Add ``herald bench serve`` to the ``herald`` command line."""
    what = "end-to-end load on a real herald serve: tokens/s and latency percentiles"
    register_benchmark(subparsers, "serve", what, __doc__, add_arguments, run)


def build_parser() -> argparse.ArgumentParser:
    return benchmark_parser("python -m herald.bench.serve", __doc__, add_arguments)


def main(argv: list[str] | None = None) -> int:
    return benchmark_main(build_parser(), run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
