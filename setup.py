"""Build hook: compiles the C++ selection kernel (herald/csrc) into ``herald/_selection*.so``.

The library is plain C++17 with a C ABI, loaded by ``herald/offload/selection/_kernel.py`` through ctypes (it
is *not* a Python extension module: never ``import herald._selection``). It is declared as an
optional setuptools Extension so that ``pip install .`` and ``pip install -e .`` build it in a
fresh, isolated environment without torch or Python headers, and so that a failed build only
warns: herald then compiles it on first use into a cache directory, or falls back to PyTorch.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "_herald_kernel_build", _ROOT / "herald" / "offload" / "selection" / "_kernel_build.py"
)
assert _spec is not None and _spec.loader is not None
_kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kb)


class BuildSharedLibrary(build_ext):
    """build_ext for a plain shared library (language="c++" links it with the C++ driver)."""

    def get_export_symbols(self, ext):  # noqa: D102
        return []  # no PyInit_*: the C ABI symbols are exported by visibility attributes


def _extension() -> Extension:
    csrc = _ROOT / "herald" / "csrc"
    return Extension(
        "herald._selection",
        sources=[str(p.relative_to(_ROOT)) for p in _kb.source_files(csrc)],
        language="c++",
        extra_compile_args=[*_kb.CXX_FLAGS, f"-DHERALD_SOURCE_HASH={_kb.hash_define(csrc)}"],
        extra_link_args=[f for f in _kb.LINK_FLAGS if f != "-shared"],
        optional=True,
    )


setup(ext_modules=[_extension()], cmdclass={"build_ext": BuildSharedLibrary})
