"""HERALD_FETCH=gpu (the default on CUDA): the GPU reads the selected rows from the page-locked
CPU pool.

The kernel against its PyTorch reference in the Triton interpreter on the CPU (shapes with
partial tiles, requests that select nothing, pool rows that must stay untouched); on the GPU, the
same against a page-locked pool, and the engine's tokens equal with either fetch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import make_engine

from herald.config import OffloadConfig, SamplingParams
from herald.engine.hooks import EngineHooks, FaultInjection
from herald.env import parse
from herald.layers.moe_triton import triton_available
from herald.models.registry import build_model, get_preset

_CASES = textwrap.dedent(
    """
    import torch
    from herald.offload.gpu_fetch import fetch_rows, reference_rows

    def check(device, pin):
        g = torch.Generator().manual_seed(0)
        # (requests, KV heads, page size, head dim, pages, pool capacity): partial tiles of the
        # kernel's 32 rows, one request, one KV head, a request selecting nothing
        for n, hkv, page, d, pages, cap in [(3, 2, 8, 16, 20, 40), (1, 4, 32, 128, 6, 33),
                                            (5, 1, 4, 32, 40, 70)]:
            kp = torch.randn(pages, hkv, page, d, generator=g).bfloat16()
            vp = torch.randn(pages, hkv, page, d, generator=g).bfloat16()
            if pin:
                kp, vp = kp.pin_memory(), vp.pin_memory()
            per = pages // n
            table = torch.stack([torch.randperm(pages, generator=g)[:per] for _ in range(n)])
            seq = per * page
            nsel = torch.randint(0, min(cap, seq) + 1, (n,), generator=g).int()
            nsel[0] = min(cap, seq)
            if n > 2:
                nsel[1] = 0
            kmax = max(1, int(nsel.max()))
            idx = torch.full((n, hkv, kmax), -1, dtype=torch.int32)
            for r in range(n):
                for h in range(hkv):
                    k = int(nsel[r])
                    idx[r, h, :k] = torch.randperm(seq, generator=g)[:k].sort().values.int()
            m = int(nsel.max())
            kd = torch.full((n + 1, hkv, cap, d), 7.0, device=device).bfloat16()
            vd = torch.full_like(kd, -3.0)
            fetch_rows(kp, vp, table.int().to(device), idx.to(device), nsel.to(device), kd, vd, m)
            rk, rv = reference_rows(kp, vp, table.int(), idx, nsel, m)
            kd, vd = kd.cpu(), vd.cpu()
            assert torch.equal(kd[:n, :, :m], rk) and torch.equal(vd[:n, :, :m], rv), (n, hkv)
            # rows past the largest count and slots past the batch: untouched
            assert (kd[:n, :, m:] == 7).all() and (kd[n:] == 7).all(), (n, hkv)
            assert (vd[:n, :, m:] == -3).all() and (vd[n:] == -3).all(), (n, hkv)
    """
)


@pytest.mark.skipif(not triton_available(), reason="Triton not installed")
def test_fetch_rows_matches_the_reference_in_the_triton_interpreter() -> None:
    script = _CASES + "\ncheck('cpu', False)\nprint('ok')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_fetch_switch_parses() -> None:
    assert parse({}).fetch == "auto"
    assert parse({"HERALD_FETCH": "gpu"}).fetch == "gpu"
    assert parse({"HERALD_FETCH": " CPU "}).fetch == "cpu"
    with pytest.raises(ValueError, match="HERALD_FETCH"):
        parse({"HERALD_FETCH": "dma"})


def test_fetch_rows_rejects_mismatched_shapes() -> None:
    from herald.offload.gpu_fetch import fetch_rows

    kp = torch.zeros(4, 2, 8, 16, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    idx = torch.zeros(1, 2, 5, dtype=torch.int32)
    nsel = torch.full((1,), 5, dtype=torch.int32)
    pool = torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16)  # capacity 4 < 5 rows
    with pytest.raises(ValueError, match="fetch_rows"):
        fetch_rows(kp, kp, table, idx, nsel, pool, pool, 5)
    with pytest.raises(ValueError, match="fetch_rows"):  # int64 positions
        fetch_rows(kp, kp, table, idx.long(), nsel, pool, pool, 4)


@pytest.mark.gpu
def test_fetch_rows_reads_a_page_locked_pool_on_gpu() -> None:
    namespace: dict[str, object] = {}
    exec(_CASES, namespace)  # noqa: S102
    namespace["check"]("cuda", True)  # type: ignore[operator]


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2"])
def test_gpu_fetch_gives_the_cpu_fetchs_tokens(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same tokens with either fetch, at a budget that selects (0.3) and at 1.0, and with the
    retrieval stream's random delays (races of the copy stream against the main stream); at 0.3
    also with the retrieval job in 3 request groups (each group's fetch, staging region and
    query copy racing the others')."""
    config = get_preset(preset)
    model = build_model(config, device="cuda", dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (90, 33, 130, 5)]
    params = SamplingParams(max_new_tokens=160, num_denoise_steps=6, ignore_eos=True)
    outs: dict[tuple[str, float, bool, int], list[list[int]]] = {}
    for fetch in ("cpu", "gpu"):
        monkeypatch.setenv("HERALD_FETCH", fetch)
        for budget, groups in ((0.3, 1), (0.3, 3), (1.0, 1)):
            for delays in (False, True):
                faults = FaultInjection(max_delay=0.004, seed=3) if delays else None
                cfg = OffloadConfig.for_mode(
                    "herald", kv_budget=budget, selection_threads=2, retrieval_groups=groups
                )
                eng = make_engine(model, config, cfg, hooks=EngineHooks(faults=faults),
                                  max_batch_size=4, max_seq_len=320)  # fmt: skip
                try:
                    assert eng.policy.worker.gpu_fetch is (fetch == "gpu")  # type: ignore[attr-defined]
                    outs[fetch, budget, delays, groups] = [
                        r.output_ids for r in eng.generate(prompts, params)
                    ]
                finally:
                    eng.close()
                assert eng.cpu_pool.num_used_pages == 0
    for key, got in outs.items():
        assert got == outs["cpu", key[1], False, 1], key
