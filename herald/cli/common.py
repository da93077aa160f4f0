"""What the ``herald`` subcommands share: model and device flags, the offloading and engine
flags, and their validation in CLI terms (errors name the flag, not the field)."""

from __future__ import annotations

import argparse
import math
import os

import torch

from herald.cliargs import DEFAULT_MODEL, DTYPE_HELP, add_model_source_args, parse_dtype
from herald.config import (
    DEFAULT_KV_PAD,
    MAX_KV_PAD,
    EngineConfig,
    OffloadConfig,
    SamplingParams,
    field_help,
)
from herald.config import OFFLOAD_MODES as OFFLOAD_MODE_SPECS

__all__ = ["DEFAULT_MODEL", "DTYPE_HELP", "add_model_source_args", "parse_dtype"]  # re-exported

OFFLOAD_MODES = tuple(OFFLOAD_MODE_SPECS)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """:func:`add_model_source_args` plus ``--seed``, ``--block-size``, ``--mask-token-id``."""
    add_model_source_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and sampling")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="diffusion block size B (default: from config.json or the architecture)",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="the mask token id (default: from config.json or the architecture)",
    )


def add_kv_pad(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-pad",
        type=int,
        default=DEFAULT_KV_PAD,
        help="round attention key lengths up to a multiple of this, masked: outputs do not "
        "depend on the other requests in the batch, and the GPU's attention plans change once "
        f"per this many tokens (0 to {MAX_KV_PAD}; default {DEFAULT_KV_PAD}; 0: off)",
    )


def kv_budget_defaults() -> str:
    return ", ".join(f"{m} {OffloadConfig.for_mode(m).kv_budget:g}" for m in OFFLOAD_MODES)


def flags_given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) is not None]


def refuse_offload_flags(args: argparse.Namespace, dests: tuple[str, ...]) -> None:
    """``--mode dense``: refuse the offloading modes' flags (``dests``) that were given."""
    given = flags_given(args, dests)
    if given:
        names = given[0] if len(given) == 1 else ", ".join(given[:-1]) + " and " + given[-1]
        verb = "needs" if len(given) == 1 else "need"
        raise ValueError(
            f"{names} {verb} an offloading --mode ({', '.join(OFFLOAD_MODES)}); "
            "--mode dense keeps the whole KV on the device"
        )


def memory_gib() -> tuple[float, float] | None:
    """(available, total) memory of this machine in GiB (``/proc/meminfo``'s MemAvailable and
    MemTotal, else the free and total physical pages), or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: v.split() for k, v in (line.split(":", 1) for line in f if ":" in line)}
        return int(info["MemAvailable"][0]) / 2**20, int(info["MemTotal"][0]) / 2**20
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        free, total = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None
    return free * page / 2**30, total * page / 2**30


def check_pool_flags(args: argparse.Namespace) -> None:
    """The CPU pool size flags, before the model loads (pages need its geometry: later); a
    ``--cpu-kv-gb`` above the machine's available memory is refused here, not by the
    allocator."""
    gb, tokens = args.cpu_kv_gb, args.cpu_kv_tokens
    if gb is not None and not (math.isfinite(gb) and gb > 0):
        raise ValueError(f"--cpu-kv-gb must be a finite positive number (GiB), got {gb:g}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--cpu-kv-tokens must be >= 1, got {tokens}")
    if gb is not None and tokens is not None:
        raise ValueError("give the CPU pool size with --cpu-kv-gb or --cpu-kv-tokens, not both")
    memory = memory_gib() if gb is not None else None
    if memory is not None and gb > memory[0]:
        raise ValueError(
            f"--cpu-kv-gb {gb:g} is more than this machine's available memory: "
            f"{memory[0]:.1f} GiB available of {memory[1]:.1f} GiB (and the pool shares it "
            "with the model)"
        )


def model_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """``--dtype``, else bf16 on a GPU or with an offloading ``--mode`` and fp32 for dense on
    the CPU. Raises ValueError for an offloading mode with a dtype other than bf16."""
    mode, dtype = args.mode, args.dtype
    if mode != "dense" and dtype is not None and dtype != torch.bfloat16:
        raise ValueError(
            f"--mode {mode} runs bf16 models (the CPU pool and the selection kernel hold bf16), "
            f"got --dtype {str(dtype).removeprefix('torch.')}: give --dtype bf16 or leave it out"
        )
    return dtype or (torch.bfloat16 if device.type == "cuda" or mode != "dense" else torch.float32)


def pool_error(args: argparse.Namespace, e: ValueError) -> ValueError:
    """``e`` naming ``--cpu-kv-gb`` when it says the pool holds no page (a page's size needs the
    model, so this is known only once it has loaded)."""
    if args.cpu_kv_gb is not None and "GiB holds no page" in str(e):
        return ValueError(f"--cpu-kv-gb {args.cpu_kv_gb:g} is too small: {e}")
    return e


OFFLOAD_FLAGS = {
    "kv_budget": "kv_budget",
    "cpu_kv_gb": "cpu_kv_gb",
    "cpu_kv_tokens": "cpu_kv_tokens",
    "selection_device": "selection_device",
    "lookahead": "lookahead",
    "kernel_output": "output_mode",
}
"""``herald generate``'s offloading flags (argparse dest) -> :class:`OffloadConfig` field."""


def offload_config(args: argparse.Namespace, dests: tuple[str, ...]) -> OffloadConfig:
    """The OffloadConfig of the offloading flags ``dests`` (argparse dests, keys of
    :data:`OFFLOAD_FLAGS`), its errors in CLI flag syntax; flags a mode does not use are
    refused rather than ignored."""
    check_pool_flags(args)
    chosen = {
        OFFLOAD_FLAGS[dest]: getattr(args, dest)
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


SAMPLING_FLAGS = {
    "num_denoise_steps": "--steps",
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "threshold": "--threshold",
    "seed": "--seed",
}
""":class:`SamplingParams` field -> ``herald generate`` flag (for its validation errors)."""


def validate_sampling(params: SamplingParams) -> None:
    """``params.validate()`` with the field named by its CLI flag."""
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        for field, flag in SAMPLING_FLAGS.items():
            if msg.startswith(field + " "):
                msg = flag + msg.removeprefix(field)
                break
        raise ValueError(msg) from None


def engine_help(name: str) -> str:
    """Help of an engine flag: the :class:`EngineConfig` field's attribute docstring."""
    return field_help(EngineConfig, name, default=False)
