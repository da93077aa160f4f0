"""ctypes loader and call wrappers of the native selection library (herald/csrc).

Where the library comes from, in order:

1. ``HERALD_SELECTION_LIB``: an explicit path (debugging).
2. The extension built by ``pip install`` (``herald/_selection*.so``), if it was built from the
   sources next to it (the library embeds a hash of its sources; an edited tree is rebuilt).
3. A cache (``$HERALD_CACHE_DIR``, else ``$XDG_CACHE_HOME/herald``, else ``~/.cache/herald``)
   keyed by the source hash; if absent, built there on first use with ``g++`` (``$CXX``).

If none works, :func:`load_native` returns None and :func:`unavailable_reason` says why; the
caller falls back to PyTorch. ctypes releases the GIL for the duration of each call.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from herald.env import settings
from herald.offload.selection import _kernel_build

ABI_VERSION = 6  # must equal HERALD_ABI_VERSION in herald/csrc/herald_selection.h

OK, EINVAL, ENONFINITE, EINTERNAL = 0, 1, 2, 3

# Pointer fields are declared void* and set from tensor.data_ptr() (plain ints: cheaper than
# ctypes.cast). The C side reads them with the types of herald_selection.h.
_c_u16p = _c_i32p = _c_f32p = ctypes.c_void_p


class SelectArgs(ctypes.Structure):
    """Mirror of ``herald_select_args`` (same field order and types)."""

    _fields_ = [
        *[
            (name, ctypes.c_int32)
            for name in (
                "n_req",
                "n_q",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "page_size",
                "max_pages",
                "k_max",
                "s_max",
                "output_mode",
                "isa",
                "num_threads",
                "schedule",
                "prefetch_hint",
                "prefetch_distance",
                "_pad0",
            )
        ],
        ("num_pages", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("_pad1", ctypes.c_int32),
        ("q", _c_u16p),
        ("k_pages", _c_u16p),
        ("v_pages", _c_u16p),
        ("page_table", _c_i32p),
        ("seq_lens", _c_i32p),
        ("budget", _c_i32p),
        ("indices", _c_i32p),
        ("num_selected", _c_i32p),
        ("attn_output", _c_f32p),
        ("importance", _c_f32p),
        ("tail_lens", _c_i32p),  # nullable: None = no tail
        ("gather_out", _c_u16p),  # nullable: None = no fused gather
    ]


class GatherArgs(ctypes.Structure):
    """Mirror of ``herald_gather_args``."""

    _fields_ = [
        *[
            (name, ctypes.c_int32)
            for name in (
                "n_req",
                "num_kv_heads",
                "head_dim",
                "page_size",
                "max_pages",
                "k_max",
                "num_threads",
                "isa",
            )
        ],
        ("num_pages", ctypes.c_int64),
        ("page_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
        ("k_pages", _c_u16p),
        ("v_pages", _c_u16p),
        ("page_table", _c_i32p),
        ("indices", _c_i32p),
        ("num_selected", _c_i32p),
        ("out", _c_u16p),
    ]


class ScatterArgs(ctypes.Structure):
    """Mirror of ``herald_scatter_args``."""

    _fields_ = [
        *[
            (name, ctypes.c_int32)
            for name in ("outer", "n", "num_dst", "num_threads", "isa", "_pad0")
        ],
        ("block_bytes", ctypes.c_int64),
        ("src", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("index", ctypes.c_void_p),  # int64
    ]


@dataclass(frozen=True)
class NativeLibrary:
    """A loaded library: the handle, where it came from and what this CPU can run."""

    lib: ctypes.CDLL
    path: str
    origin: str  # "env", "installed", "cache" or "built"
    has_avx512bf16: bool


_lock = threading.Lock()
_loaded: NativeLibrary | None = None
_tried = False
_reason = ""


def _declare(lib: ctypes.CDLL) -> None:
    """The entry points of this ABI (after the version check: an older library lacks some)."""
    lib.herald_cpu_has_avx512bf16.restype = ctypes.c_int32
    lib.herald_last_error.restype = ctypes.c_char_p
    lib.herald_select_topk.restype = ctypes.c_int32
    lib.herald_select_topk.argtypes = [ctypes.POINTER(SelectArgs)]
    lib.herald_gather_selected.restype = ctypes.c_int32
    lib.herald_gather_selected.argtypes = [ctypes.POINTER(GatherArgs)]
    lib.herald_scatter_blocks.restype = ctypes.c_int32
    lib.herald_scatter_blocks.argtypes = [ctypes.POINTER(ScatterArgs)]
    lib.herald_read_probe.restype = ctypes.c_double
    lib.herald_read_probe.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]


def _open(path: Path, origin: str, want_hash: str | None) -> NativeLibrary:
    lib = ctypes.CDLL(str(path))
    lib.herald_abi_version.restype = ctypes.c_int32
    lib.herald_source_hash.restype = ctypes.c_char_p
    if lib.herald_abi_version() != ABI_VERSION:
        raise OSError(f"{path}: ABI {lib.herald_abi_version()} != {ABI_VERSION}")
    got = lib.herald_source_hash().decode()
    if want_hash is not None and got != want_hash:
        raise OSError(f"{path}: built from other sources (hash {got}, sources {want_hash})")
    _declare(lib)
    return NativeLibrary(lib, str(path), origin, bool(lib.herald_cpu_has_avx512bf16()))


def _cache_dir() -> Path:
    if d := settings().cache_dir:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "herald"


def _build(target: Path) -> None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise OSError(f"no C++ compiler ({cxx!r} not found)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    cmd = _kernel_build.compile_command(Path(tmp), cxx=cxx)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        os.unlink(tmp)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise OSError(f"compiling the selection kernel failed: {' | '.join(tail)}")
    os.replace(tmp, target)  # atomic: concurrent builders never see a half-written file


def _installed_candidates() -> list[Path]:
    pkg = Path(__file__).resolve().parents[2]
    return [pkg / f"_selection{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def _load() -> NativeLibrary:
    errors: list[str] = []
    if env := settings().selection_lib:
        return _open(Path(env), "env", None)
    have_sources = bool(_kernel_build.source_files())
    want = _kernel_build.source_hash() if have_sources else None
    for path in _installed_candidates():
        if path.exists():
            try:
                return _open(path, "installed", want)
            except OSError as e:
                errors.append(str(e))
    if want is None:
        raise OSError("; ".join(errors) or "no built library and no sources to build one")
    target = _cache_dir() / f"libherald_selection-{want}.so"
    if target.exists():
        try:
            return _open(target, "cache", want)
        except OSError as e:
            errors.append(str(e))
    _build(target)
    return _open(target, "built", want)


def load_native() -> NativeLibrary | None:
    """The native library, building it on first use if needed; None if impossible."""
    global _loaded, _tried, _reason
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load()
            except (OSError, subprocess.SubprocessError) as e:
                _reason = str(e)
        return _loaded


def unavailable_reason() -> str:
    """Why :func:`load_native` returned None (empty if it did not)."""
    return _reason


def check(lib: NativeLibrary, rc: int, what: str) -> None:
    """Turns a non-zero return code into the matching Python exception."""
    if rc == OK:
        return
    msg = lib.lib.herald_last_error().decode() or f"{what} failed with code {rc}"
    if rc == ENONFINITE:
        from herald.offload.selection.ref import NonFiniteScoreError

        raise NonFiniteScoreError(msg)
    if rc == EINVAL:
        raise ValueError(msg)
    raise RuntimeError(msg)
