"""The on-demand build of the native library (an unbuilt source tree, e.g. on the GPU machine)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from selection_utils import check_selection, make_inputs, reference

from herald.offload.selection import _kernel, _kernel_build
from herald.offload.selection.cpu import select_topk


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_build_on_first_use_then_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HERALD_SELECTION_LIB", raising=False)
    monkeypatch.setattr(_kernel, "_installed_candidates", lambda: [])  # as if never installed
    built = _kernel._load()
    assert built.origin == "built"
    assert Path(built.path).parent == tmp_path
    assert built.lib.herald_source_hash().decode() == _kernel_build.source_hash()
    cached = _kernel._load()
    assert cached.origin == "cache" and cached.path == built.path
    # a library built from other sources is refused
    with pytest.raises(OSError, match="other sources"):
        _kernel._open(Path(built.path), "installed", "0" * 16)
    # and the freshly built library serves the public API
    monkeypatch.setattr(_kernel, "_loaded", cached)
    monkeypatch.setattr(_kernel, "_tried", True)
    monkeypatch.setenv("HERALD_SELECTION_BACKEND", "native")
    inp = make_inputs(30, [200, 45], [10, 8], n_q=2)
    check_selection(select_topk(*inp.args()), reference(inp, "full"), inp, "full")
