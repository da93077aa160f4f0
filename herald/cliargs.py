"""Argument-parser pieces every ``herald`` subcommand shares.

- :class:`HelpFormatter`: plain-text help (reST roles and double backquotes reduced to their
  text) with each option's default shown;
- :func:`add_list`: an option that takes several values, given with spaces, commas or both;
- :func:`deprecated_alias`: an old option name kept, hidden, for one release; using it prints a
  one-line warning;
- :func:`add_model_source_args` / :func:`parse_dtype`: ``--model``, ``--device``, ``--dtype`` as
  every command that loads a model takes them (the benchmarks too).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]+?)(?:\s*<[^>]+>)?`")


def plain(text: str) -> str:
    """``text`` with reST markup reduced to plain text: ``:func:`~a.b``` -> ``b``,
    ``:mod:`a.b``` -> ``a.b``, double backquotes dropped."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return text.replace("``", "")


def show_default(value: Any) -> str:
    """How a default reads in help: lists space-separated, dtypes by their short name."""
    if isinstance(value, list | tuple):
        return " ".join(show_default(v) for v in value)
    if isinstance(value, Path):
        return str(value)
    name = str(value)
    return name.removeprefix("torch.") if name.startswith("torch.") else name


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written (paragraphs, examples) but in plain text; every option's
    help ends with its default unless the help already states it (or there is none to state:
    None, False, a flag)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text.strip():  # one paragraph written as one line: wrap it
            return argparse.HelpFormatter._fill_text(self, text, width, indent)
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        default = action.default
        shown = (
            action.option_strings
            and "default" not in text.lower()
            and not (default is None or default is False or default is argparse.SUPPRESS)
            and default != []
            and action.nargs != 0
        )
        if shown:
            text += f" (default: {show_default(default)})".replace("%", "%%")
        return text


def use_help_formatter(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand parser under it :class:`HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                use_help_formatter(sub)


def token_count(text: str) -> int:
    """An argparse ``type`` for a number of tokens: ``4096``, ``4K`` or ``4k`` (x 1024). The
    range is the caller's to check."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        msg = f"expected a token count like 4096 or 32K, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def flag_message(msg: str, flags: dict[str, str]) -> str:
    """A config error's message in command-line terms: a leading field name (``kv_budget ...``)
    becomes its flag (``--kv-budget ...``), by ``flags`` (field -> flag); other messages as
    they are."""
    for field, flag in flags.items():
        if msg.startswith(field + " "):
            return flag + msg.removeprefix(field)
    return msg


def list_of(kind: Callable[[str], Any], choices: Iterable[Any] | None = None) -> Any:
    """An argparse ``type``: one argument, split at commas, each part converted by ``kind`` (and
    checked against ``choices``)."""
    allowed = list(choices) if choices is not None else None

    def parse(text: str) -> list[Any]:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
        for item in items:
            if allowed is not None and item not in allowed:
                shown = ", ".join(map(str, allowed))
                raise argparse.ArgumentTypeError(f"invalid choice {item!r} (choose from {shown})")
        return items

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


class _FlatList(argparse.Action):
    """Stores the values of ``nargs="+"`` parts that are each a list, as one list."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:  # fmt: skip
        setattr(namespace, self.dest, [x for part in values for x in part])


def add_list(
    parser: Any,
    *flags: str,
    kind: Callable[[str], Any] = str,
    choices: Sequence[Any] | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Add an option taking one or more values: ``--x 1 2``, ``--x 1,2`` and ``--x 1, 2`` all
    give ``[1, 2]``. ``parser`` may be an argument group."""
    metavar = kwargs.pop("metavar", None) or (
        "{" + ",".join(map(str, choices)) + "}" if choices is not None else None
    )
    return parser.add_argument(  # type: ignore[no-any-return]
        *flags, type=list_of(kind, choices), nargs="+", action=_FlatList, metavar=metavar,
        **kwargs,
    )  # fmt: skip


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept option ``old`` as ``new`` (same values, same destination), hidden from the help;
    each use prints ``warning: OLD is deprecated, use NEW`` to stderr."""
    target = parser._option_string_actions[new]

    def call(
        self: argparse.Action, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
        values: Any, option_string: str | None = None,
    ) -> None:  # fmt: skip
        print(
            f"warning: {old} is deprecated and will be removed; use {new}",
            file=sys.stderr,
        )
        target(parser, namespace, values, new)

    pairs = parser.__dict__.setdefault("_herald_aliases", [])
    pairs.append((old, new))
    action = type("DeprecatedAlias", (argparse.Action,), {"__call__": call})
    kwargs: dict[str, Any] = {"type": target.type} if target.type is not None else {}
    parser.add_argument(
        old,
        action=action,
        dest=target.dest,
        nargs=target.nargs,
        choices=target.choices,
        metavar=target.metavar,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def check_alias_conflicts(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """``parser.error`` when ``argv`` gives both a deprecated name (:func:`deprecated_alias`) and
    its new one: argparse would keep whichever came last."""
    names = [o for o in parser._option_string_actions if o.startswith("--")]
    given = set()
    for arg in argv:
        if not arg.startswith("--"):
            continue
        typed = arg.split("=", 1)[0]
        # argparse also takes an unambiguous prefix of a name (--kv-bud for --kv-budget)
        hits = [typed] if typed in names else [o for o in names if o.startswith(typed)]
        if len(hits) == 1:
            given.add(hits[0])
    for old, new in parser.__dict__.get("_herald_aliases", []):
        if old in given and new in given:
            parser.error(f"{old} is the old name of {new}: give only {new}")


def option_error(parser: argparse.ArgumentParser, msg: str) -> int | None:
    """Report a user error whose message begins with one of ``parser``'s options (``--steps
    must be in [1, 1024], got 0``: a value out of range, checked after parsing) as argparse
    reports a value it cannot parse: the command's usage, then ``PROG: error: MESSAGE``; returns
    argparse's exit status, 2. None, reporting nothing, for any other message."""
    words = msg.split(maxsplit=1)
    if not words or words[0].rstrip(",:;") not in parser._option_string_actions:
        return None
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {msg}", file=sys.stderr)
    return 2


DEFAULT_MODEL = "code-sdar"
"""The embedded default: the small SDAR code model trained with ``herald train`` that ships in
``checkpoints/code-sdar/`` (:data:`herald.models.loader.BUNDLED_CHECKPOINTS`)."""


DTYPE_HELP = (
    "bf16 | fp16 | fp32 (default: bf16 with an offloading --mode, which runs bf16 only, or on a "
    "GPU; fp32 for --mode dense on the CPU)"
)


def parse_dtype(name: str) -> torch.dtype:
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


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--device``, ``--dtype``."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="checkpoint directory (HF format), bundled checkpoint (code-sdar) or preset name "
        "(default: %(default)s)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", type=parse_dtype, default=None, help=DTYPE_HELP)


def resolve_dtype(mode: str, dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``dtype`` (``--dtype``), else bf16 on a GPU or with an offloading ``mode`` and fp32 for
    dense on the CPU. Raises ValueError for an offloading mode with a dtype other than bf16."""
    if mode != "dense" and dtype is not None and dtype != torch.bfloat16:
        raise ValueError(
            f"--mode {mode} runs bf16 models (the CPU pool and the selection kernel hold bf16), "
            f"got --dtype {str(dtype).removeprefix('torch.')}: give --dtype bf16 or leave it out"
        )
    return dtype or (torch.bfloat16 if device.type == "cuda" or mode != "dense" else torch.float32)


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
