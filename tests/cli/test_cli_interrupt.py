"""Ctrl-C on the ``herald`` command: one ``interrupted`` line and exit status 130, whenever it
comes, also while Python still imports torch (the first seconds of every command) and where a
library swallows the KeyboardInterrupt (:mod:`herald.cli.interrupt`).

The interrupt is sent at a point fixed by what the process does, not after a delay: an import
hook in the child sends the child SIGINT when the import named begins; in this process,
``signal.raise_signal`` runs the handler before it returns."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from herald.cli import interrupt, main

CHILD = textwrap.dedent(
    """
    import importlib.abc, os, signal, sys

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive shell leaves it

    module = sys.argv.pop(1)

    class CtrlC(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == module:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, CtrlC())
    from herald.cli import main  # what the installed `herald` script runs

    sys.exit(main())
    """
)


@pytest.mark.parametrize("module", ["torch", "herald.cli.serve", "herald.train.cli"])
def test_ctrl_c_while_the_modules_load(module: str) -> None:
    """torch is imported by the command's modules, herald.cli.serve by its parser, the train
    command's module while the parser is built: each was a traceback before."""
    argv = [sys.executable, "-c", CHILD, module, "serve", "--model", "tiny-sdar", "--port", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr
    assert out.stderr.splitlines() == ["interrupted"], out.stderr
    assert out.stdout == ""


def test_ctrl_c_while_torch_imports_numpy() -> None:
    """torch's extension imports numpy from C++ and dropped the KeyboardInterrupt: the command
    ran to its end and exited 0."""
    argv = [sys.executable, "-c", CHILD, "numpy", "generate", "--model", "tiny-sdar"]
    argv += ["--device", "cpu", "--prompt", "x", "--max-new-tokens", "1", "--quiet"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 130, out.stderr
    assert out.stderr.splitlines() == ["interrupted"], out.stderr
    assert out.stdout == ""


@pytest.fixture(autouse=True)
def _sigint_handler_restored() -> Iterator[None]:
    """A command that ends on a Ctrl-C leaves a quick-exit handler for the interpreter's
    shutdown (interrupt.quiet_exit_on_next): not for the rest of this test process."""
    old = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """SIGINT handled by Python's own handler, as in the ``herald`` script."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def swallowed_ctrl_c() -> None:
    """A Ctrl-C that the code it interrupts drops (as torch's C++ did)."""
    with contextlib.suppress(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_swallowed_ctrl_c_is_still_seen(python_sigint) -> None:
    with interrupt.recorded():
        swallowed_ctrl_c()
        assert interrupt.seen()
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupt.recorded():
        assert not interrupt.seen()


def test_a_deferred_ctrl_c_comes_at_the_end_and_a_second_at_once(python_sigint) -> None:
    steps = []
    with interrupt.recorded(), pytest.raises(KeyboardInterrupt), interrupt.deferred():
        signal.raise_signal(signal.SIGINT)
        steps.append("ran on")
    assert steps == ["ran on"]
    with interrupt.recorded(), pytest.raises(KeyboardInterrupt), interrupt.deferred():
        signal.raise_signal(signal.SIGINT)
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            steps.append("second")
    assert steps == ["ran on", "second"]


@pytest.mark.parametrize("then", [None, ImportError("half-imported"), RuntimeError("broken")])
def test_a_swallowed_ctrl_c_ends_the_command(then, python_sigint, monkeypatch, capsys, tmp_path):
    """The command ran on (exit 0), or failed on what the interrupt left half done (exit 2,
    ``error: RecursionError``); either is reported as the interrupt."""
    import herald.cli

    def command(args) -> int:
        swallowed_ctrl_c()
        if then is not None:
            raise then
        return 0

    monkeypatch.setattr(herald.cli, "cmd_init_random", command)
    assert main(["init-random", "--preset", "tiny-sdar", "--out", str(tmp_path / "c")]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]


def test_ctrl_c_while_the_modules_load_waits_for_them(python_sigint, monkeypatch, capsys) -> None:
    """A Ctrl-C while the parser's modules import is raised once they have imported."""
    import herald.cli

    built = []
    build = herald.cli.build_parser

    def build_parser():
        signal.raise_signal(signal.SIGINT)
        built.append(build())
        return built[-1]

    monkeypatch.setattr(herald.cli, "build_parser", build_parser)
    assert main(["generate", "--prompt", "x"]) == 130
    assert len(built) == 1 and capsys.readouterr().err.splitlines() == ["interrupted"]


def test_a_ctrl_c_swallowed_while_the_model_loads_stops_generate(
    python_sigint, monkeypatch, capsys
) -> None:
    from herald.cli import generate

    def load(*args):
        swallowed_ctrl_c()
        return None, None, None

    def no_engine(*args, **kwargs):
        raise AssertionError("decoding began after the Ctrl-C")

    monkeypatch.setattr(generate, "_load", load)
    monkeypatch.setattr("herald.engines.build_engine", no_engine)
    assert main(["generate", "--model", "tiny-sdar", "--device", "cpu", "--prompt", "x"]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]


def test_ctrl_c_while_the_model_loads(monkeypatch, capsys) -> None:
    """Ctrl-C in a command's own work (here the model's load, before the server runs)."""
    from herald.models import loader

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "load_model", interrupted)
    monkeypatch.setattr("herald.server.launch.load_model", interrupted)
    assert main(["serve", "--model", "tiny-sdar", "--port", "0"]) == 130
    err = capsys.readouterr().err.splitlines()  # the "loading ..." line, then
    assert err[-1] == "interrupted" and not any("Traceback" in line for line in err), err


def test_the_script_imports_little_before_main_handles_ctrl_c() -> None:
    """The ``herald`` script imports herald.cli before main runs, and a Ctrl-C then is a
    traceback: importing it runs herald's two small modules and nothing else (it was argparse
    and typing too)."""
    code = "import sys; old = set(sys.modules); import herald.cli; print(*set(sys.modules) - old)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) <= {"__future__", "herald", "herald.onednn", "herald.cli"}


def test_after_a_ctrl_c_a_second_one_while_python_shuts_down_exits_at_once(
    python_sigint, monkeypatch, capsys
) -> None:
    """The command ended on a Ctrl-C: the next SIGINT (during the interpreter's shutdown: atexit
    handlers, threads) is a quiet exit with 130, not a traceback from wherever it lands."""
    import herald.cli as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run", interrupted)
    assert main(["generate"]) == 130
    assert signal.getsignal(signal.SIGINT) is interrupt._exit_now
    child = textwrap.dedent(
        """
        import os, signal, sys, time
        from herald.cli import interrupt

        signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupt.quiet_exit_on_next()
        print("before", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # never reached: the handler exits
        """
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (130, "before\n", "")


def test_a_process_that_ignores_sigint_keeps_ignoring_it() -> None:
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        interrupt.quiet_exit_on_next()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
