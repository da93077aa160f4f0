"""Build recipe of the native selection library (herald/csrc), shared by setup.py and the loader.

Stand-alone on purpose: ``setup.py`` loads this file by path, so building needs neither torch nor
the herald package. The library is plain C++17 with a C ABI (no libtorch, no Python headers),
compiled without ``-march`` so it runs on any x86-64 CPU; the AVX-512 BF16 kernels carry their own
target attributes and are chosen at run time.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"

#: Compiler flags (both the setup.py extension and the on-demand build use them).
CXX_FLAGS = [
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-pthread",
    "-fno-strict-aliasing",
    "-fvisibility=hidden",
]
LINK_FLAGS = ["-shared", "-pthread"]


def source_files(csrc_dir: Path = CSRC_DIR) -> list[Path]:
    """The C++ translation units, sorted by name."""
    return sorted(csrc_dir.glob("*.cpp"))


def source_hash(csrc_dir: Path = CSRC_DIR) -> str:
    """16 hex digits over every source and header, the flags and the machine type.

    The library records the hash it was built from (``herald_source_hash``), so the loader can
    tell a stale build (sources edited after ``pip install``) from a current one.
    """
    h = hashlib.sha256()
    for path in sorted([*csrc_dir.glob("*.cpp"), *csrc_dir.glob("*.h")]):
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    h.update(" ".join(CXX_FLAGS + LINK_FLAGS).encode())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def hash_define(csrc_dir: Path = CSRC_DIR) -> str:
    """The ``-D`` value that embeds the source hash in the library."""
    return f'"{source_hash(csrc_dir)}"'


def compile_command(output: Path, cxx: str = "g++", csrc_dir: Path = CSRC_DIR) -> list[str]:
    """Command line building the shared library ``output`` from ``csrc_dir``."""
    return [
        cxx,
        *CXX_FLAGS,
        f"-DHERALD_SOURCE_HASH={hash_define(csrc_dir)}",
        *[str(p) for p in source_files(csrc_dir)],
        *LINK_FLAGS,
        "-o",
        str(output),
    ]
