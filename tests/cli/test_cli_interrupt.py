"""Ctrl-C on the ``herald`` command: one ``interrupted`` line and exit status 130, whenever it
comes, also while Python still imports torch (the first seconds of every command).

The interrupt is sent at a point fixed by what the process does, not after a delay: an import
hook in the child sends the child SIGINT when the import named begins."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from herald.cli import main

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
