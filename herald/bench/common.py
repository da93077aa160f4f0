"""Shared helpers for benchmark scripts: machine facts, result files, GPU memory caps."""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, GPU, software versions: recorded with every result."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_total_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = p.name
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def code_version() -> dict[str, str]:
    """Which code measured a result: ``source_sha256`` (16 hex digits over the path and bytes
    of every ``.py``, ``.cpp``, ``.h`` and ``.json`` file under ``herald/``: code and model
    presets; the same wherever the tree is copied, e.g. to a device machine without git
    history) and ``git`` (the commit, with ``+dirty`` for uncommitted changes under ``herald/``)
    where ``herald/`` sits in a git checkout of its own repository."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h", ".json") and f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    out = {"source_sha256": h.hexdigest()[:16]}
    try:
        git = ["git", "-C", str(root.parent)]
        kw: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 10, "check": True}
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], **kw).stdout.strip()
        if Path(top).resolve() != root.parent:
            return out  # herald/ installed inside some other checkout: its commit is not ours
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], **kw).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "herald"], **kw).stdout
        out["git"] = rev + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def command_line() -> str:
    """The command as typed (``sys.orig_argv``: interpreter, ``-m module`` and arguments)."""
    return " ".join(shlex.quote(a) for a in sys.orig_argv)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def append_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Append one ``{"kind": "run", machine, code, command}`` line, then ``records``, to the
    JSON-lines file ``path`` (directories created): every record stays traceable to the run,
    machine and code that measured it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {
        "kind": "run",
        "machine": machine_info(),
        "code": code_version(),
        "command": command_line(),
    }
    with path.open("a") as f:
        for rec in (head, *records):
            f.write(json.dumps(rec) + "\n")


def random_prompts(config: Any, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids drawn uniformly (seeded) from the vocabulary
    without its special ids (the mask and every EOS), whatever their positions in it (a model
    whose EOS is id 0 included)."""
    special = {config.mask_token_id, *config.eos_token_ids}
    allowed = torch.tensor([t for t in range(config.vocab_size) if t not in special])
    if allowed.numel() == 0:
        raise ValueError("the vocabulary holds no token besides its special ids")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, allowed.numel(), (batch, length), generator=g)
    out: list[list[int]] = allowed[picks].tolist()
    return out


def cap_gpu_memory(gb: float | None) -> None:
    """Emulate a smaller GPU: limit this process's CUDA caching allocator to ``gb`` GB (1e9 B)."""
    if gb is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gb * 1e9 / total))


SELECTION_THREADS_HELP = (
    "CPU selection kernel threads (default: $HERALD_SELECTION_THREADS, else every usable core)"
)
"""``--selection-threads`` of the benchmarks that build offloading engines: unset, the engines
choose as :func:`herald.env.selection_threads` does."""


def register_benchmark(
    subparsers: Any,
    name: str,
    help_text: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
) -> None:
    """Add ``herald bench NAME`` to the ``herald`` command line (``bench`` is created by the
    first benchmark that registers)."""
    bench = subparsers.choices.get("bench")
    if bench is None:
        bench = subparsers.add_parser("bench", help="benchmarks (herald bench BENCHMARK ...)")
    sub = next(
        (a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None
    ) or bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    p = sub.add_parser(
        name, help=help_text, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    p.set_defaults(handler=handler)


def benchmark_parser(
    prog: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """The parser of ``python -m PROG`` (the options of ``herald bench NAME``)."""
    from herald.cliargs import HelpFormatter

    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
    add_arguments(p)
    return p


def benchmark_main(
    parser: argparse.ArgumentParser,
    handler: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """``python -m PROG``: parse ``argv`` and run; a user error prints one ``error:`` line (an
    option's value out of range: argparse's usage and error lines) and exits 2, a run that
    failed (e.g. a full-size model that does not fit) exits 1; ``--debug`` re-raises."""
    from herald.cliargs import option_error

    args = parser.parse_args(argv)
    try:
        return handler(args)
    except (ValueError, OSError, KeyError) as e:
        if args.debug:
            raise
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        if (status := option_error(parser, msg)) is not None:
            return status  # an option's value out of range: as argparse reports a bad value
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as e:
        if args.debug:
            raise
        print(f"error: {type(e).__name__}: {str(e)[:300]} (--debug for the traceback)",
              file=sys.stderr)  # fmt: skip
        return 1
