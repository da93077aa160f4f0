"""HERALD_SDPA_BACKENDS: the process-wide SDPA kernel switch used to measure cuDNN's plan cost."""

from __future__ import annotations

import pytest
import torch

from herald.attention import sdpa
from herald.env import parse


def test_backend_setting_applies_and_rejects_unknown_names():
    cuda = torch.backends.cuda
    saved = (
        cuda.cudnn_sdp_enabled(),
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
    )
    try:
        names = parse({"HERALD_SDPA_BACKENDS": "flash, math"}).sdpa_backends
        assert names == ("flash", "math")
        sdpa._configure(names)
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled()) == (False, True)
        assert (cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()) == (False, True)
        with pytest.raises(ValueError, match="comma-separated list of cudnn"):
            parse({"HERALD_SDPA_BACKENDS": "flash,cudnn3"})
        assert parse({}).sdpa_backends is None
    finally:
        sdpa._configure.cache_clear()
        cuda.enable_cudnn_sdp(saved[0])
        cuda.enable_flash_sdp(saved[1])
        cuda.enable_mem_efficient_sdp(saved[2])
        cuda.enable_math_sdp(saved[3])
