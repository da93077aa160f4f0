"""The device scripts' Python entry points exist: every ``python -m herald...`` a script in
scripts/ runs names a module that Python can run (a package needs a ``__main__``). The scripts
themselves only run on the GPU machine, so a renamed module would otherwise fail there first."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").rglob("*.sh"))
MODULE = re.compile(r"python3? -m (herald[\w.]*)")


def _modules() -> list[tuple[str, str]]:
    return sorted({(p.name, m) for p in SCRIPTS for m in MODULE.findall(p.read_text())})


def test_the_scripts_run_herald_modules():
    assert len(_modules()) >= 5  # the pattern still finds the scripts' commands


@pytest.mark.parametrize(("script", "module"), _modules())
def test_each_module_a_script_runs_is_runnable(script: str, module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{script}: no module {module}"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, (
            f"{script}: {module} is a package without __main__ (python -m {module} fails)"
        )
