"""Suite-wide test settings."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _batch_invariant_cpu_matmul():
    """Run CPU matmuls through ATen's own GEMM, not oneDNN.

    Many tests compare engines token for token (offloading at budget 1.0 against dense, chunked
    against whole-prompt prefill, one batch composition against another). That needs a row's
    result not to depend on how many other rows share its matmul. oneDNN's bf16 GEMM picks its
    kernel by problem size on some CPUs (seen on an AMD EPYC with AVX512-BF16, torch 2.13.0: a
    prompt prefilled in 32-token chunks decoded other tokens than the whole prompt), so the
    comparisons would test the CPU's GEMM blocking, not the engines. GPU tests are unaffected.
    """
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before
