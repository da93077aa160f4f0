"""Command line: ``herald generate | serve | eval | train | bench throughput | init-random``.

``herald generate`` decodes prompts (dense, or an offloading mode: herald, mage, infinigen) and
prints the completion and stats. Without ``--model`` it runs the embedded default model on the
CPU. ``herald serve`` runs the OpenAI-compatible HTTP server (:mod:`herald.server`).
``herald eval`` measures long-context accuracy (:mod:`herald.eval`), ``herald train`` trains the
small block dLLM (:mod:`herald.train`), ``herald bench throughput`` sweeps decode throughput
(:mod:`herald.bench.throughput`), ``herald init-random`` writes a random-weight checkpoint.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from herald.config import OffloadConfig, SamplingParams, resolve_device
from herald.kv.dense_cache import DEFAULT_KV_PAD, MAX_KV_PAD, check_kv_pad

DEFAULT_MODEL = "code-sdar"
"""The embedded default: the small SDAR code model trained with ``herald train`` that ships in
``checkpoints/code-sdar/`` (issue 6; :data:`herald.models.loader.BUNDLED_CHECKPOINTS`)."""


OFFLOAD_MODES = ("herald", "mage", "infinigen")

_DTYPE_HELP = (
    "bf16 | fp16 | fp32 (default: bf16 with an offloading --mode, which runs bf16 only, or on a "
    "GPU; fp32 for --mode dense on the CPU)"
)


def _dtype(name: str) -> torch.dtype:
    try:
        return {
            "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16,
            "fp16": torch.float16,
            "float16": torch.float16,
            "fp32": torch.float32,
            "float32": torch.float32,
        }[name]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {name!r}: use bf16, fp16 or fp32"
        ) from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory (HF format), bundled checkpoint (code-sdar) or preset name "
        "(default: %(default)s)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", type=_dtype, default=None, help=_DTYPE_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="diffusion block size B (default: from config.json or the architecture)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="override the mask token id")


def _add_kv_pad(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-pad",
        type=int,
        default=DEFAULT_KV_PAD,
        help="round attention key lengths up to a multiple of this, masked: outputs do not "
        "depend on the other requests in the batch, and the GPU's attention plans change once "
        f"per this many tokens (0 to {MAX_KV_PAD}; default {DEFAULT_KV_PAD}; 0: off)",
    )


def _kv_budget_defaults() -> str:
    return ", ".join(f"{m} {OffloadConfig.for_mode(m).kv_budget:g}" for m in OFFLOAD_MODES)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="herald", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode a prompt and print the completion and stats")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    _add_kv_pad(g)
    g.add_argument(
        "--threshold",
        type=float,
        default=0.95,
        help="accept masked positions with confidence > threshold (default 0.95)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed-steps mode: T denoising steps per block (overrides --threshold)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="keep only the last N prompt tokens (long files)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="decode past EOS")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--mode",
        default="dense",
        choices=["dense", "herald", "mage", "infinigen"],
        help="dense (full KV on the device) or an offloading mode (full KV in CPU "
        "memory): herald = CPU selection + representative query + draft lookahead; "
        "mage = block queries at each block's first step; infinigen = proxy channels of the "
        "block queries at each block's first step",
    )
    g.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help="offloading modes: fraction of the prefix kept per KV head, in (0, 1] (default: "
        f"{_kv_budget_defaults()})",
    )
    g.add_argument(
        "--cpu-kv-gb",
        type=float,
        default=None,
        help="offloading modes: CPU KV pool size in GiB (default: what this request needs)",
    )
    g.add_argument(
        "--cpu-kv-tokens",
        type=int,
        default=None,
        help="offloading modes: CPU KV pool size in tokens (instead of --cpu-kv-gb)",
    )
    g.add_argument(
        "--selection-device",
        choices=["cpu", "gpu"],
        default=None,
        help="--mode mage only: where each block's exact attention and top-k over the full KV "
        "run at its first step: gpu (the full KV of a layer crosses PCIe every block; mage's "
        "default) or cpu (the CPU kernel). Ignored by --mode herald (it always selects on the "
        "CPU) and --mode infinigen (proxy top-k on the GPU)",
    )
    g.add_argument(
        "--lookahead",
        choices=["draft", "off"],
        default=None,
        help="offloading modes: draft = select block n+1 from block n's draft while block n "
        "denoises (herald's default; only herald can); off = select after block n commits "
        "(mage and infinigen need off)",
    )
    g.add_argument(
        "--kernel-output",
        choices=["full", "selected"],
        default=None,
        help="CPU selection kernel output (--mode herald, and mage with --selection-device "
        "cpu): full = exact attention over the prefix (default) or selected",
    )

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (dense or an offloading mode)")
    s.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory (HF format), bundled checkpoint (code-sdar) or preset name "
        "(default: %(default)s)",
    )
    s.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    s.add_argument("--dtype", type=_dtype, default=None, help=_DTYPE_HELP)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch-size", type=int, default=16, help="running requests at most")
    s.add_argument(
        "--max-seq-len", type=int, default=2048, help="prompt + generated tokens per request"
    )
    s.add_argument(
        "--max-waiting", type=int, default=64, help="queued requests at most; beyond: HTTP 503"
    )
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument("--seed", type=int, default=0, help="seed for a preset's random weights")
    s.add_argument(
        "--mode",
        default="dense",
        choices=["dense", "herald", "mage", "infinigen"],
        help="the one engine this server runs (requests asking for another mode get a 400)",
    )
    s.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        help="offloading modes: fraction of the prefix kept per KV head, in (0, 1] (default: "
        f"{_kv_budget_defaults()})",
    )
    s.add_argument(
        "--cpu-kv-gb", type=float, default=None, help="offloading modes: CPU KV pool size in GiB"
    )
    s.add_argument(
        "--cpu-kv-tokens",
        type=int,
        default=None,
        help="offloading modes: CPU KV pool size in tokens (instead of --cpu-kv-gb)",
    )
    s.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens prefilled per block boundary at most; a longer prompt is prefilled "
        "in chunks over several boundaries (default: %(default)s)",
    )
    _add_kv_pad(s)

    r = sub.add_parser(
        "init-random", help="write a random-weight checkpoint (HF format) for a preset"
    )
    r.add_argument("--preset", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", type=_dtype, default=torch.bfloat16)
    for p in (g, s, r):
        p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    from herald.eval.cli import register as register_eval

    register_eval(sub)  # herald eval (sets args.handler)
    from herald.bench import throughput

    throughput.register(sub)  # herald bench throughput (sets args.handler)
    from herald.train.cli import register as register_train

    register_train(sub)  # herald train (sets args.handler)
    return parser


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = args.prompt
    else:
        path: Path = args.prompt_file
        if path.is_dir():
            raise ValueError(f"--prompt-file {path} is a directory")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"--prompt-file {path} is not UTF-8 text") from None
    if not text:
        raise ValueError("the prompt is empty")
    return text


def _flags_given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) is not None]


def _refuse_offload_flags(args: argparse.Namespace, dests: tuple[str, ...]) -> None:
    """``--mode dense``: refuse the offloading modes' flags (``dests``) that were given."""
    given = _flags_given(args, dests)
    if given:
        names = given[0] if len(given) == 1 else ", ".join(given[:-1]) + " and " + given[-1]
        verb = "needs" if len(given) == 1 else "need"
        raise ValueError(
            f"{names} {verb} an offloading --mode ({', '.join(OFFLOAD_MODES)}); "
            "--mode dense keeps the whole KV on the device"
        )


def _check_pool_flags(args: argparse.Namespace) -> None:
    """The CPU pool size flags, before the model loads (pages need its geometry: later)."""
    gb, tokens = args.cpu_kv_gb, args.cpu_kv_tokens
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        raise ValueError(f"--cpu-kv-gb must be a finite positive number (GiB), got {gb:g}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--cpu-kv-tokens must be >= 1, got {tokens}")
    if gb is not None and tokens is not None:
        raise ValueError("give the CPU pool size with --cpu-kv-gb or --cpu-kv-tokens, not both")


def _model_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype``, else bf16 on a GPU or with an offloading ``--mode`` and fp32 for dense on
    the CPU. Raises ValueError for an offloading mode with a dtype other than bf16."""
    mode, dtype = args.mode, args.dtype
    if mode != "dense" and dtype is not None and dtype != torch.bfloat16:
        raise ValueError(
            f"--mode {mode} runs bf16 models (the CPU pool and the selection kernel hold bf16), "
            f"got --dtype {str(dtype).removeprefix('torch.')}: give --dtype bf16 or leave it out"
        )
    return dtype or (torch.bfloat16 if device.type == "cuda" or mode != "dense" else torch.float32)


def _pool_error(args: argparse.Namespace, e: ValueError) -> ValueError:
    """``e`` naming ``--cpu-kv-gb`` when it says the pool holds no page (a page's size needs the
    model, so this is known only once it has loaded)."""
    if args.cpu_kv_gb is not None and "GiB holds no page" in str(e):
        return ValueError(f"--cpu-kv-gb {args.cpu_kv_gb:g} is too small: {e}")
    return e


_OFFLOAD_FLAGS = {
    "kv_budget": "kv_budget",
    "cpu_kv_gb": "cpu_kv_gb",
    "cpu_kv_tokens": "cpu_kv_tokens",
    "selection_device": "selection_device",
    "lookahead": "lookahead",
    "kernel_output": "output_mode",
}
"""``herald generate``'s offloading flags (argparse dest) -> :class:`OffloadConfig` field."""


def _offload_config(args: argparse.Namespace, dests: tuple[str, ...]) -> OffloadConfig:
    """The OffloadConfig of the offloading flags ``dests`` (argparse dests, keys of
    :data:`_OFFLOAD_FLAGS`), its errors in CLI flag syntax; flags a mode does not use are
    refused rather than ignored."""
    _check_pool_flags(args)
    chosen = {
        _OFFLOAD_FLAGS[dest]: getattr(args, dest)
        for dest in dests
        if getattr(args, dest, None) is not None
    }
    if "selection_device" in chosen and args.mode != "mage":
        raise ValueError(
            f"--selection-device applies to --mode mage only (--mode {args.mode} selects "
            + ("on the CPU)" if args.mode == "herald" else "with proxy channels on the GPU)")
        )
    try:
        cfg = OffloadConfig.for_mode(args.mode, **chosen)
    except ValueError as e:
        msg = str(e).replace("lookahead='off'", "--lookahead off")
        if msg.startswith("kv_budget "):
            msg = "--kv-budget " + msg.removeprefix("kv_budget ")
        elif "selection needs" in msg:
            msg = f"--mode {args.mode}: {msg}"
        raise ValueError(msg) from None
    if "output_mode" in chosen and cfg.selection_device != "cpu":
        raise ValueError(
            "--kernel-output applies where the CPU kernel selects: --mode herald, or --mode mage "
            "--selection-device cpu"
        )
    return cfg


_SAMPLING_FLAGS = {
    "num_denoise_steps": "--steps",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "threshold": "--threshold",
    "seed": "--seed",
}
""":class:`SamplingParams` field -> ``herald generate`` flag (for its validation errors)."""


def _validate_sampling(params: SamplingParams) -> None:
    """``params.validate()`` with the field named by its CLI flag."""
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        for field, flag in _SAMPLING_FLAGS.items():
            if msg.startswith(field + " "):
                msg = flag + msg.removeprefix(field)
                break
        raise ValueError(msg) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from herald.engine.dense import DenseEngine
    from herald.models.loader import is_preset, load_model

    # Everything that can be checked without the model is checked first.
    device = resolve_device(args.device)
    text = _read_prompt(args)
    if args.block_size is not None and not 1 <= args.block_size <= 1024:
        raise ValueError(f"--block-size must be in [1, 1024], got {args.block_size}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise ValueError(f"--mask-token-id must be a token id >= 0, got {args.mask_token_id}")
    check_kv_pad(args.kv_pad, "--kv-pad")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        threshold=args.threshold,
        num_denoise_steps=args.steps,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    _validate_sampling(params)
    offload: OffloadConfig | None = None
    if args.mode == "dense":
        _refuse_offload_flags(args, tuple(_OFFLOAD_FLAGS))
    else:
        offload = _offload_config(args, tuple(_OFFLOAD_FLAGS))
    dtype = _model_dtype(args, device)
    overrides = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.mask_token_id is not None:
        overrides["mask_token_id"] = args.mask_token_id
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    try:
        model, config, tokenizer = load_model(
            args.model, device=device, dtype=dtype, random_init_seed=args.seed, **overrides
        )
    except ValueError as e:  # the byte-level tokenizer's check of its special ids
        if args.mask_token_id is None or not str(e).startswith(f"special id {args.mask_token_id} "):
            raise
        raise ValueError(f"--mask-token-id {args.mask_token_id} is out of range: {e}") from None
    load_s = time.perf_counter() - t0
    if args.mask_token_id is not None and args.mask_token_id >= config.vocab_size:
        raise ValueError(
            f"--mask-token-id {args.mask_token_id} is out of range: the model's vocabulary has "
            f"{config.vocab_size} tokens (ids 0..{config.vocab_size - 1})"
        )
    if is_preset(args.model) or config.hf_config.get("herald_random_weights"):
        print(
            f"NOTE: '{args.model}' has RANDOM weights: the text below is noise, "
            "shown to exercise the decoder, not a trained model's output.",
            file=sys.stderr,
        )
    ids = tokenizer.encode(text)
    if args.max_prompt_tokens is not None:
        ids = ids[-args.max_prompt_tokens :]
    if len(ids) + args.max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the "
            f"model's context of {config.max_position_embeddings} tokens; keep the end of the "
            "prompt with --max-prompt-tokens"
        )
    max_len = len(ids) + args.max_new_tokens + config.block_size
    engine: Any
    if offload is None:
        engine = DenseEngine(
            model, config, max_batch_size=1, max_seq_len=max_len, kv_pad=args.kv_pad
        )
    else:
        from herald.engine.offload import OffloadEngine

        try:
            engine = OffloadEngine(
                model, config, offload, max_batch_size=1, max_seq_len=max_len, kv_pad=args.kv_pad
            )
        except ValueError as e:
            raise _pool_error(args, e) from None
        print(engine.cpu_pool.describe(), file=sys.stderr)
    pool_usage = None
    try:
        req = engine.add_request(ids, params)  # refused here, before any work, if it cannot fit
        bar = tqdm(
            total=args.max_new_tokens,
            unit="tok",
            disable=args.quiet,
            file=sys.stderr,
            desc="decoding",
        )
        while engine.has_unfinished():
            engine.step()
            bar.update(max(0, len(req.output_ids) - bar.n))
        bar.update(max(0, len(req.output_ids) - bar.n))
        bar.close()
        if offload is not None:  # before close(), which frees every page still held
            pool = engine.cpu_pool
            pool_usage = (
                f"CPU KV pool: {pool.num_used_pages} of {pool.num_pages} pages in use after the run"
            )
    finally:
        if offload is not None:
            engine.close()
    print(tokenizer.decode(req.output_ids))
    st = engine.stats
    decode_s = max(st.decode_seconds, 1e-9)
    print(
        f"\n--- model {args.model} ({config.architecture}, {device}, {str(dtype).split('.')[-1]}), "
        f"loaded in {load_s:.2f} s\n"
        f"prompt tokens {req.prompt_len} (prefilled {st.num_prefill_tokens} in "
        f"{st.prefill_seconds:.2f} s) | generated tokens {len(req.output_ids)} "
        f"({req.finish_reason}) | blocks {len(req.steps_per_block)} (B = {config.block_size}) | "
        f"denoising steps per block {req.steps_per_block} | forwards {st.num_forwards} | "
        f"decode {decode_s:.2f} s, {len(req.output_ids) / decode_s:.1f} tokens/s",
        file=sys.stderr,
    )
    for i, b in enumerate(getattr(st, "blocks", [])):
        print(
            f"block {i}: main stream {b.main * 1e3:.1f} ms | retrieval stream "
            f"{b.retrieval * 1e3:.1f} ms | boundary stall {b.stall * 1e3:.1f} ms",
            file=sys.stderr,
        )
    if pool_usage is not None:
        print(pool_usage, file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from herald.models.loader import is_preset
    from herald.server.launch import build_app, serve

    device = resolve_device(args.device)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    check_kv_pad(args.kv_pad, "--kv-pad")
    offload = None
    if args.mode == "dense":
        _refuse_offload_flags(args, ("kv_budget", "cpu_kv_gb", "cpu_kv_tokens"))
    else:
        offload = _offload_config(args, ("kv_budget", "cpu_kv_gb", "cpu_kv_tokens"))
    dtype = _model_dtype(args, device)
    try:
        app = build_app(
            args.model,
            device=device,
            dtype=dtype,
            mode=args.mode,
            offload=offload,
            max_prefill_tokens=args.max_prefill_tokens,
            kv_pad=args.kv_pad,
            max_batch_size=args.max_batch_size,
            max_seq_len=args.max_seq_len,
            max_waiting=args.max_waiting,
            api_key=args.api_key,
            seed=args.seed,
        )
    except ValueError as e:
        raise _pool_error(args, e) from None
    if is_preset(args.model):
        print(f"NOTE: '{args.model}' has RANDOM weights: completions are noise.", file=sys.stderr)
    serve(app, host=args.host, port=args.port)
    return 0


def cmd_init_random(args: argparse.Namespace) -> int:
    from herald.models.loader import write_random_checkpoint

    t0 = time.perf_counter()
    write_random_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(
        f"wrote random '{args.preset}' checkpoint to {args.out} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point. User errors print one ``error:`` line and exit 2; ``--debug`` re-raises."""
    args = _build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "init-random": cmd_init_random}
    try:
        return (getattr(args, "handler", None) or handlers[args.command])(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
        if getattr(args, "debug", False):
            raise
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        # torch's C++ errors append their native stack ("Exception raised from ..."): one line
        msg = msg.split("\nException raised from ", 1)[0]
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 2
    except Exception as e:  # e.g. safetensors / tokenizers parse errors on a broken checkpoint
        if getattr(args, "debug", False):
            raise
        print(
            f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
