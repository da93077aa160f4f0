"""``herald generate``: decode one prompt with any engine and print the completion and stats."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from herald.cli.common import (
    OFFLOAD_FLAGS,
    add_first_pass,
    add_kv_pad,
    add_model_args,
    check_weights_memory,
    kv_budget_defaults,
    loading_line,
    model_dtype,
    offload_config,
    pool_error,
    refuse_offload_flags,
    validate_sampling,
)
from herald.cliargs import token_count
from herald.config import EngineConfig, OffloadConfig, SamplingParams, check_kv_pad, resolve_device
from herald.engine.request import RequestStatus
from herald.engines import MODES


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``generate`` subcommand to ``sub``."""
    g = sub.add_parser("generate", help="decode a prompt and print the completion and stats")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (no default: give it or --prompt-file)")
    src.add_argument(
        "--prompt-file",
        type=Path,
        help="read the prompt from this file (no default: give it or --prompt)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=token_count,
        default=128,
        help="tokens to generate at most (EOS ends sooner)",
    )
    add_kv_pad(g)
    mode = g.add_mutually_exclusive_group()  # two modes: fixed steps use no threshold
    mode.add_argument(
        "--threshold",
        type=float,
        default=SamplingParams.threshold,
        help="threshold mode: accept masked positions whose confidence is above this, at least "
        "one per step; not with --steps",
    )
    mode.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fixed-steps mode: T denoising steps per block, no threshold; not with --threshold "
        "(default: threshold mode)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    g.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely tokens; 0: all"
    )
    g.add_argument(
        "--top-p", type=float, default=1.0, help="sample from the smallest set of probability p"
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=token_count,
        default=None,
        help="keep only the last N prompt tokens (long files; default: the whole prompt)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="decode past EOS")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--mode",
        default="dense",
        choices=list(MODES),
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
        f"{kv_budget_defaults()})",
    )
    g.add_argument(
        "--cpu-kv-gb",
        type=float,
        default=None,
        help="offloading modes: CPU KV pool size in GiB (default: what this request needs)",
    )
    g.add_argument(
        "--cpu-kv-tokens",
        type=token_count,
        default=None,
        help="offloading modes: CPU KV pool size in tokens (instead of --cpu-kv-gb; default: "
        "what this request needs)",
    )
    g.add_argument(
        "--selection-device",
        choices=["cpu", "gpu"],
        default=None,
        help="--mode mage only: where each block's exact attention and top-k over the full KV "
        "run at its first step: gpu (the full KV of a layer crosses PCIe every block; mage's "
        "default) or cpu (the CPU kernel). Refused with --mode herald (it selects on the CPU) and "
        "--mode infinigen (proxy top-k on the GPU)",
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
        "cpu): selected = attention over the selected rows (herald's default; reads K and only "
        "the selected V) or full = exact attention over the prefix (the paper's; mage's default)",
    )
    add_first_pass(g)
    g.set_defaults(handler=cmd_generate)
    return g


def read_prompt(args: argparse.Namespace) -> str:
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


def _params(args: argparse.Namespace) -> SamplingParams:
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
    validate_sampling(params)
    return params


def _check_flags(args: argparse.Namespace) -> tuple[SamplingParams, OffloadConfig | None]:
    """Everything that can be checked without the model, first."""
    if args.block_size is not None and not 1 <= args.block_size <= 1024:
        raise ValueError(f"--block-size must be in [1, 1024], got {args.block_size}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    if args.mask_token_id is not None and args.mask_token_id < 0:
        raise ValueError(f"--mask-token-id must be a token id >= 0, got {args.mask_token_id}")
    check_kv_pad(args.kv_pad, "--kv-pad")
    params = _params(args)
    if args.mode == "dense":
        refuse_offload_flags(args, tuple(OFFLOAD_FLAGS))
        return params, None
    return params, offload_config(args, tuple(OFFLOAD_FLAGS))


def _load(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    from herald.models.loader import is_preset, load_config, load_model

    overrides = {}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    if args.mask_token_id is not None:
        overrides["mask_token_id"] = args.mask_token_id
    config = load_config(args.model, **overrides)  # a bad model fails here, before the weights
    gib = check_weights_memory(args.model, config, device, dtype)
    if not args.quiet:
        print(loading_line(args.model, config, device, dtype, gib), file=sys.stderr)
    try:
        loaded = load_model(
            args.model, device=device, dtype=dtype, random_init_seed=args.seed, **overrides
        )
    except ValueError as e:  # the byte-level tokenizer's check of its special ids
        if args.mask_token_id is None or not str(e).startswith(f"special id {args.mask_token_id} "):
            raise
        raise ValueError(f"--mask-token-id {args.mask_token_id} is out of range: {e}") from None
    config = loaded[1]
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
    return loaded


def _prompt_ids(args: argparse.Namespace, text: str, tokenizer: Any, config: Any) -> list[int]:
    ids: list[int] = tokenizer.encode(text)
    if args.max_prompt_tokens is not None:
        ids = ids[-args.max_prompt_tokens :]
    if len(ids) + args.max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({args.max_new_tokens}) exceeds the "
            f"model's context of {config.max_position_embeddings} tokens; keep the end of the "
            "prompt with --max-prompt-tokens"
        )
    return ids


def _decode(engine: Any, ids: list[int], params: SamplingParams, quiet: bool) -> Any:
    """Run one request to completion with a progress bar; returns it."""
    from herald.progress import progress

    req = engine.add_request(ids, params)  # refused here, before any work, if it cannot fit
    opts: dict[str, Any] = {"unit": "tok", "disable": quiet}
    if req.layout.num_prefill_tokens:  # the prompt's whole blocks, then the decoding
        with progress(total=req.layout.num_prefill_tokens, desc="prefill", **opts) as pre:
            while engine.has_unfinished() and req.status is RequestStatus.WAITING:
                engine.step()
                pre.update(min(pre.total, engine.stats.num_prefill_tokens) - pre.n)
    bar = progress(total=params.max_new_tokens, desc="decoding", **opts)
    while engine.has_unfinished():
        engine.step()
        bar.update(max(0, len(req.output_ids) - bar.n))
    bar.update(max(0, len(req.output_ids) - bar.n))
    bar.close()
    return req


def cmd_generate(args: argparse.Namespace) -> int:
    from herald.cli import interrupt
    from herald.engines import build_engine

    device = resolve_device(args.device)
    text = read_prompt(args)  # an unreadable prompt fails before the model loads
    params, offload = _check_flags(args)
    dtype = model_dtype(args, device)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, config, tokenizer = _load(args, device, dtype)
    load_s = time.perf_counter() - t0
    interrupt.check()  # a Ctrl-C that the load's libraries swallowed: not on to the decoding
    ids = _prompt_ids(args, text, tokenizer, config)
    max_len = len(ids) + args.max_new_tokens + config.block_size
    cfg = EngineConfig(max_batch_size=1, max_seq_len=max_len, kv_pad=args.kv_pad, offload=offload)
    try:
        engine = build_engine(model, config, cfg)
    except ValueError as e:
        raise pool_error(args, e) from None
    if offload is not None:
        print(engine.describe(), file=sys.stderr)
    try:
        req = _decode(engine, ids, params, args.quiet)
        usage = engine.usage()  # before close(), which frees every page still held
    finally:
        engine.close()
    print(tokenizer.decode(req.output_ids))
    _print_stats(args, engine, config, device, dtype, load_s, req)
    if offload is not None:
        print(
            f"CPU KV pool: {usage.cpu_pages_used} of {usage.cpu_pages_total} pages in use after "
            "the run",
            file=sys.stderr,
        )
    return 0


def _print_stats(
    args: argparse.Namespace, engine: Any, config: Any, device: torch.device,
    dtype: torch.dtype, load_s: float, req: Any,
) -> None:  # fmt: skip
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
    for i, b in enumerate(st.blocks):
        print(
            f"block {i}: main stream {b.main * 1e3:.1f} ms | retrieval stream "
            f"{b.retrieval * 1e3:.1f} ms | boundary stall {b.stall * 1e3:.1f} ms",
            file=sys.stderr,
        )
