"""RMSNorm in one Triton kernel (herald.layers.rmsnorm_triton) against the PyTorch reference, in
the Triton interpreter (CPU) and on the GPU: values, the promoted dtype, strided inputs, and each
row's bits independent of the other rows in the call (batch invariance)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from herald.layers.moe_triton import triton_available

_CHECKS = textwrap.dedent(
    """
    import torch
    from herald.layers.rmsnorm import rms_norm, rms_norm_reference
    from herald.layers.rmsnorm_triton import rms_norm_triton, rms_norm_triton_available

    def check(device):
        g = torch.Generator().manual_seed(0)
        for dim in (128, 100, 2048):  # QK-norm head_dim, an odd width, LLaDA2.0-mini's hidden
            for xdt, wdt in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                             (torch.float32, torch.float32)):
                x = (torch.randn(7, 5, dim, generator=g) * 3).to(device, xdt)
                w = (1 + 0.1 * torch.randn(dim, generator=g)).to(device, wdt)
                assert rms_norm_triton_available(x, w), (dim, xdt, wdt)
                got = rms_norm(x, w, 1e-6)
                ref = rms_norm_reference(x, w, 1e-6)
                assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, ref.dtype)
                tol = 1e-5 if ref.dtype == torch.float32 and xdt == torch.float32 else 1.6e-2
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
                # each row alone: the same bits as in the whole call
                flat = x.reshape(-1, dim)
                for i in (0, 3, flat.shape[0] - 1):
                    alone = rms_norm_triton(flat[i : i + 1], w, 1e-6)
                    assert torch.equal(alone[0], got.reshape(-1, dim)[i]), (dim, i)
                # strided views: rows of a wider tensor, and per-head slices of a fused
                # projection's output as the QK-norm gets them ([bs, L, heads, dim] of a split)
                wide = torch.randn(9, 2 * dim, generator=g).to(device, xdt)
                fused = torch.randn(2, 3, 7 * dim, generator=g).to(device, xdt)
                heads = fused.split([4 * dim, 3 * dim], dim=-1)[1].view(2, 3, 3, dim)
                for view in (wide[:, :dim], heads, heads[0, 1]):
                    torch.testing.assert_close(rms_norm(view, w, 1e-6).float(),
                                               rms_norm_reference(view, w, 1e-6).float(),
                                               rtol=tol, atol=tol)
                assert rms_norm(x[:0], w, 1e-6).shape == (0, 5, dim)
    """
)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_rms_norm_kernel_matches_the_reference_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HERALD_TRITON": "all"}
    script = _CHECKS + "\ncheck('cpu')\nprint('ok')\n"
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_cpu_tensors_take_the_reference_path() -> None:
    from herald.layers.rmsnorm import rms_norm, rms_norm_reference
    from herald.layers.rmsnorm_triton import rms_norm_triton_available

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert not rms_norm_triton_available(x, w)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.gpu
def test_rms_norm_kernel_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERALD_TRITON", "all")  # float32 activations too
    namespace: dict[str, object] = {}
    exec(_CHECKS, namespace)  # noqa: S102
    namespace["check"]("cuda")  # type: ignore[operator]


@pytest.mark.gpu
def test_rms_norm_rows_do_not_depend_on_the_batch_on_gpu() -> None:
    """Every token count from 1 to 2,560 (a lockstep batch's rows x 32), LLaDA2.0-mini's hidden
    width, bf16: row i's output is the same bits at every count; and a CUDA graph replays it."""
    from herald.layers.rmsnorm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2560, 2048, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    full = rms_norm(x, w, 1e-6)
    for n in (1, 2, 31, 32, 96, 256, 1000, 2559):
        assert torch.equal(rms_norm(x[:n], w, 1e-6), full[:n]), n
    static = x[:64].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm(static, w, 1e-6)
    static.copy_(x[64:128])
    graph.replay()
    assert torch.equal(out, full[64:128])
