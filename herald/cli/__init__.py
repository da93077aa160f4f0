"""Command line: ``herald generate | serve | eval | train | bench throughput|forward|serve |
init-random``.

``herald generate`` decodes prompts (dense, or an offloading mode: herald, mage, infinigen) and
prints the completion and stats. Without ``--model`` it runs the embedded default model on the
CPU. ``herald serve`` runs the OpenAI-compatible HTTP server (:mod:`herald.server`).
``herald eval`` measures long-context accuracy (:mod:`herald.eval`), ``herald train`` trains the
small block dLLM (:mod:`herald.train`), ``herald bench throughput`` sweeps decode throughput
(:mod:`herald.bench.throughput`), ``herald bench forward`` times the GPU forward against its
floor (:mod:`herald.bench.forward`), ``herald bench serve`` loads a real ``herald serve``
(:mod:`herald.bench.serve`), ``herald init-random`` writes a random-weight checkpoint.
Every subcommand's help is plain text with its defaults (:mod:`herald.cliargs`).

This module imports nothing but ``sys`` at its top (not even ``argparse`` or ``typing``): the
``herald`` script imports it before :func:`main` runs, and a Ctrl-C then escapes every handler
as a traceback. :func:`main` imports the subcommands (and torch) itself, inside its handler of
Ctrl-C.
"""

from __future__ import annotations

import sys

from herald import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    import argparse
    from typing import Any

__all__ = ["DEFAULT_MODEL", "build_parser", "main"]


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_MODEL":  # re-exported, without importing torch with this module
        from herald.cliargs import DEFAULT_MODEL

        return DEFAULT_MODEL
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DESCRIPTION = """herald serves block diffusion LLMs (SDAR, LLaDA2-MoE). Without --model, generate
and serve run the embedded code model (checkpoints/code-sdar). herald COMMAND --help lists a
command's options with their defaults; an option that takes several values takes them
separated by spaces or commas."""


def build_parser() -> argparse.ArgumentParser:
    import argparse
    from pathlib import Path

    from herald.cli import generate, serve
    from herald.cli.common import parse_dtype
    from herald.cliargs import use_help_formatter

    parser = argparse.ArgumentParser(prog="herald", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"herald {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = generate.register(sub)
    s = serve.register(sub)
    r = sub.add_parser(
        "init-random", help="write a random-weight checkpoint (HF format) for a preset"
    )
    r.add_argument("--preset", required=True, help="preset name: " + ", ".join(_preset_names()))
    r.add_argument(
        "--out", type=Path, required=True, help="directory to write (must not hold a checkpoint)"
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    r.add_argument("--dtype", type=parse_dtype, default="bf16", help="dtype of the written tensors")
    r.set_defaults(handler=cmd_init_random)
    for p in (g, s, r):
        p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    # Research subcommands (each sets args.handler); the serving core never imports them.
    from herald.bench import forward, throughput
    from herald.bench import serve as serve_bench
    from herald.eval.cli import register as register_eval
    from herald.train.cli import register as register_train

    register_eval(sub)
    throughput.register(sub)
    forward.register(sub)
    serve_bench.register(sub)
    register_train(sub)
    use_help_formatter(parser)
    _mark_leaves(parser)
    return parser


_NEGATIVE = r"^-\d+(\.\d+)?[KkMm]?$|^-\d*\.\d+$"


def _mark_leaves(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)command's parser itself as the ``_parser`` default, so an unknown option
    is reported with that command's usage, not the top level's; and let negative token counts
    with a suffix parse as values."""
    import argparse
    import re

    parser.set_defaults(_parser=parser)
    # "-4K" is a (refused) negative count, not an option: argparse's own test knows only plain
    # numbers, so "--max-seq-len -4K" said "expected one argument" (no option looks like this)
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(_NEGATIVE)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to one parser
                _mark_leaves(child)


def _preset_names() -> list[str]:
    from herald.models.registry import list_presets

    return list(list_presets())


def cmd_init_random(args: argparse.Namespace) -> int:
    import time

    from herald.models.loader import write_random_checkpoint

    t0 = time.perf_counter()
    write_random_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype)
    print(
        f"wrote random '{args.preset}' checkpoint to {args.out} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point. User errors print one ``error:`` line and exit 2, an option's value out of
    range the command's usage and ``herald CMD: error: ...``, as argparse reports a value it
    cannot parse (:func:`herald.cliargs.option_error`); ``--debug`` re-raises.
    Ctrl-C at any time, also while the modules and the model load, prints ``interrupted`` and
    exits 130 (128 + SIGINT, as a shell reports a command it interrupted), also where a library
    swallowed the KeyboardInterrupt or turned it into another error (:mod:`.interrupt`)."""
    try:
        from herald.cli import interrupt

        with interrupt.recorded():
            code = _run(argv)
            interrupt.check()  # one that a library swallowed: the command ran on to its end
            return code
    except BaseException as e:
        if not _after_ctrl_c(e):
            raise
        print("interrupted", file=sys.stderr)
        from herald.cli import interrupt  # main got past this import

        interrupt.quiet_exit_on_next()  # a second Ctrl-C while Python shuts down: at once
        return 130


def _after_ctrl_c(e: BaseException) -> bool:
    """Whether ``e`` is a Ctrl-C's KeyboardInterrupt or an error that followed one."""
    if isinstance(e, KeyboardInterrupt):
        return True
    from herald.cli import interrupt  # main got past this import

    return interrupt.seen()


def _run(argv: list[str] | None) -> int:
    from herald.cli import interrupt

    # torch's import breaks on a KeyboardInterrupt at an arbitrary point (herald.cli.interrupt):
    # a Ctrl-C while the modules load stops the command once they have loaded
    with interrupt.deferred():
        from herald.cliargs import check_alias_conflicts, option_error
        from herald.env import settings

        parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    leaf = getattr(args, "_parser", parser)
    if extra:  # argparse would report them under the top-level usage
        leaf.error(f"unrecognized arguments: {' '.join(extra)}")
    check_alias_conflicts(leaf, sys.argv[1:] if argv is None else argv)
    try:
        settings()  # every HERALD_* switch checked up front, whichever of them the command uses
        return int(args.handler(args))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
        interrupt.check()  # an error that followed a Ctrl-C is the Ctrl-C's
        if getattr(args, "debug", False):
            raise
        msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e)
        if isinstance(e, OSError) and e.strerror and e.filename is not None:
            msg = f"{e.filename}: {e.strerror}"  # not "[Errno 2] No such file ...: 'x'"
        # torch's C++ errors append their native stack ("Exception raised from ..."): one line
        msg = msg.split("\nException raised from ", 1)[0]
        # a bad value, name or path is the user's: its message says what; others keep their kind
        user = (ValueError, KeyError, FileNotFoundError, IsADirectoryError, NotADirectoryError,
                PermissionError, FileExistsError)  # fmt: skip
        if isinstance(e, user) and (status := option_error(leaf, msg)) is not None:
            return status  # an option's value out of range: as argparse reports a bad value
        kind = "" if isinstance(e, user) else f"{type(e).__name__}: "
        print(f"error: {kind}{msg}", file=sys.stderr)
        return 2
    except Exception as e:  # e.g. safetensors / tokenizers parse errors on a broken checkpoint
        interrupt.check()
        if getattr(args, "debug", False):
            raise
        print(
            f"error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
