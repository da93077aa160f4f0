"""What the ``herald`` subcommands share: model and device flags, the offloading and engine
flags, and their validation in CLI terms (errors name the flag, not the field)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from herald.cliargs import (
    DEFAULT_MODEL,
    DTYPE_HELP,
    add_model_source_args,
    check_pool_flags,
    flag_message,
    memory_gib,
    parse_dtype,
    resolve_dtype,
)
from herald.config import (
    DEFAULT_KV_PAD,
    FIRST_PASSES,
    MAX_KV_PAD,
    EngineConfig,
    OffloadConfig,
    SamplingParams,
    field_help,
)
from herald.config import OFFLOAD_MODES as OFFLOAD_MODE_SPECS

__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_HELP",
    "add_model_source_args",
    "check_pool_flags",
    "memory_gib",
    "parse_dtype",
]  # re-exported

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


def add_first_pass(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--first-pass",
        choices=list(FIRST_PASSES),
        default=None,
        help="--mode herald only: how the representative query scores the prefix. none (default): "
        "the CPU kernel over every key in bf16, exact; int8: an int8 copy of K in the CPU pool "
        "scanned first, exact indices (rarely faster); int8-gpu: an int8 copy of K on the model's "
        "device (max batch x max length x KV heads x (head_dim + 4) bytes per offloaded layer; "
        "on the GPU, or with --device cpu in CPU memory), scored there, the CPU pool only "
        "storing the KV: approximate (the top-k of the int8 importances; needs the selected "
        "kernel output, the default)",
    )


def kv_budget_defaults() -> str:
    return ", ".join(f"{m} {OffloadConfig.for_mode(m).kv_budget:g}" for m in OFFLOAD_MODES)


def flags_given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) is not None]


def refuse_offload_flags(args: argparse.Namespace, dests: tuple[str, ...]) -> None:
    """``--mode dense``: refuse the offloading modes' flags (``dests``) that were given."""
    if getattr(args, "first_pass", None) is not None:
        raise ValueError(f"--first-pass applies to --mode herald only, not --mode {args.mode}")
    given = flags_given(args, dests)
    if given:
        names = given[0] if len(given) == 1 else ", ".join(given[:-1]) + " and " + given[-1]
        verb = "needs" if len(given) == 1 else "need"
        raise ValueError(
            f"{names} {verb} an offloading --mode ({', '.join(OFFLOAD_MODES)}); "
            "--mode dense keeps the whole KV on the device"
        )


def model_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    """:func:`herald.cliargs.resolve_dtype` of ``--mode`` and ``--dtype``."""
    return resolve_dtype(args.mode, args.dtype, device)


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
    "first_pass": "first_pass",
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
    if "first_pass" in chosen and args.mode != "herald":
        raise ValueError(f"--first-pass applies to --mode herald only, not --mode {args.mode}")
    if "selection_device" in chosen and args.mode != "mage":
        raise ValueError(
            f"--selection-device applies to --mode mage only (--mode {args.mode} selects "
            + ("on the CPU)" if args.mode == "herald" else "with proxy channels on the GPU)")
        )
    try:
        cfg = OffloadConfig.for_mode(args.mode, **chosen)
    except ValueError as e:
        msg = str(e).replace("lookahead='off'", "--lookahead off")
        msg = msg.replace("first_pass=", "--first-pass ")
        msg = msg.replace("output_mode='selected'", "--kernel-output selected")
        named = flag_message(msg, {"kv_budget": "--kv-budget"})
        if named == msg and "selection needs" in msg:
            named = f"--mode {args.mode}: {msg}"
        msg = named
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
        raise ValueError(flag_message(str(e), SAMPLING_FLAGS)) from None


def engine_help(name: str) -> str:
    """Help of an engine flag: the :class:`EngineConfig` field's attribute docstring."""
    return field_help(EngineConfig, name, default=False)


def weights_gib(config: Any, dtype: torch.dtype) -> float:
    """GiB of the model's weights in memory at ``dtype``: every checkpoint tensor's elements
    (an int8 checkpoint is widened to ``dtype`` when it loads)."""
    from herald.models.registry import count_params

    return count_params(config) * torch.empty((), dtype=dtype).element_size() / 2**30


def check_weights_memory(
    model: str,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    kv_gib: float = 0.0,
    kv_what: str = "KV",
    gpu_memory_utilization: float | None = None,
) -> float:
    """ValueError, before the model loads, when its weights (plus ``kv_gib`` of KV that goes to
    the same memory) cannot fit where they go: this machine's available memory on the CPU, the
    GPU's free memory on CUDA, or less where ``gpu_memory_utilization`` (``herald serve
    --gpu-memory-utilization``: PyTorch's allocator may reserve that fraction of the card's
    total) caps it lower. Returns the weights' GiB (for the loading line). Where the free memory
    cannot be read, nothing is checked."""
    from herald import cliargs  # read at call time (tests stand in for the machine's memory)

    need = weights_gib(config, dtype)
    name = str(dtype).removeprefix("torch.")
    capped = False
    if device.type == "cpu":
        mem = cliargs.memory_gib()
        where = "this machine's available memory"
    elif device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        cap = total if gpu_memory_utilization is None else gpu_memory_utilization * total
        capped = cap < free
        mem = (min(free, cap) / 2**30, total / 2**30)
        where = f"{device}'s free memory"
        if capped:
            where = f"what --gpu-memory-utilization {gpu_memory_utilization:g} allows on {device}"
    else:
        mem = None
    if mem is not None and need + kv_gib > mem[0]:
        kv = f" and {_gib(kv_gib)} of {kv_what}" if kv_gib else ""
        fix = "a smaller model, a GPU" if device.type == "cpu" else "a smaller model"
        if dtype == torch.float32:  # every engine runs bf16 too, in half the memory
            fix = f"--dtype bf16, {fix}"
        if kv_gib:
            fix += ", fewer --max-batch-size x --max-seq-len tokens"
        fix += ", or a higher --gpu-memory-utilization" if capped else ", or free memory"
        raise ValueError(
            f"the weights of {model} need {_gib(need)} in {name}{kv}, more than {where} "
            f"({mem[0]:,.1f} GiB of {mem[1]:,.1f} GiB): use {fix}"
        )
    return need


def _gib(n: float) -> str:
    return f"{n:,.1f} GiB" if n >= 0.1 else f"{n * 1024:,.1f} MiB"


def loading_line(model: str, config: Any, device: torch.device, dtype: torch.dtype,
                 gib: float) -> str:  # fmt: skip
    """The line printed before a model loads (a large one takes a while)."""
    name = str(dtype).removeprefix("torch.")
    size = f"{gib:,.1f} GiB" if gib >= 1 else f"{gib * 1024:,.1f} MiB"
    return f"loading {model} ({config.architecture}, {size} of {name} weights) on {device}"
