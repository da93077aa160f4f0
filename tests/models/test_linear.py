"""herald.layers.linear: the float32 path of CPU bf16/fp16 matmuls and HERALD_CPU_MATMUL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from herald.env import overridden, parse
from herald.layers import linear as linear_mod
from herald.layers.linear import Linear, cpuinfo_has_native_bf16, linear, upcasts
from herald.models.registry import build_model, get_preset

_CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {name}
flags\t\t: fpu vme sse sse2 avx avx2 fma {extra}
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: {vendor}
flags\t\t: fpu vme sse sse2 avx avx2 fma {extra}
"""
_ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize(
    ("extra", "native"),
    [
        ("", False),
        ("avx512f avx512bw avx512vl avx512_vnni", False),
        ("avx512f avx512_bf16 avx512_vnni", True),
        ("amx_tile amx_bf16 amx_int8", True),
        ("avx512_fp16 avx512_bf16_x", False),  # whole flags only
    ],
)
def test_cpuinfo_flags_decide_native_bf16(extra: str, native: bool) -> None:
    text = _CPUINFO.format(vendor="GenuineIntel", name="Xeon", extra=extra)
    assert cpuinfo_has_native_bf16(text) is native


def test_cpuinfo_without_x86_flags_counts_as_native() -> None:
    """No ``flags`` line (an Arm CPU, an empty file): assume native, i.e. change nothing."""
    assert cpuinfo_has_native_bf16(_ARM_CPUINFO) is True
    assert cpuinfo_has_native_bf16("") is True


def test_native_detection_off_linux_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_mod.sys, "platform", "darwin")
    linear_mod.native_bf16_matmul.cache_clear()
    try:
        assert linear_mod.native_bf16_matmul() is True
    finally:
        linear_mod.native_bf16_matmul.cache_clear()


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("", "auto"), ("auto", "auto"), ("native", "native"), ("FP32", "fp32"), (" fp32 ", "fp32")],
)
def test_herald_cpu_matmul_values(value: str, parsed: str) -> None:
    assert parse({"HERALD_CPU_MATMUL": value}).cpu_matmul == parsed
    assert parse({}).cpu_matmul == "auto"


def test_a_bad_herald_cpu_matmul_names_the_variable() -> None:
    with pytest.raises(ValueError, match="HERALD_CPU_MATMUL='bf16'; expected one of auto"):
        parse({"HERALD_CPU_MATMUL": "bf16"})


def _operands(dtype: torch.dtype, bias: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 384, generator=g).to(dtype)
    w = (torch.randn(520, 384, generator=g) * 0.05).to(dtype)
    b = torch.randn(520, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.fixture
def linear_inputs(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Records the input dtype of every ``F.linear`` call (herald's ``linear`` calls it)."""
    seen: list[torch.dtype] = []
    real = F.linear

    def spy(x, w, b=None):
        seen.append(x.dtype)
        return real(x, w, b)

    monkeypatch.setattr(F, "linear", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("mode", "native_cpu", "upcast"),
    [
        ("auto", False, True),
        ("auto", True, False),
        ("fp32", True, True),
        ("fp32", False, True),
        ("native", False, False),
        ("native", True, False),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_takes_the_path_its_switch_names(
    mode, native_cpu, upcast, dtype, bias, linear_inputs, monkeypatch
) -> None:
    monkeypatch.setattr(linear_mod, "native_bf16_matmul", lambda: native_cpu)
    x, w, b = _operands(dtype, bias)
    if upcast:
        bf = None if b is None else b.float()
        expected = F.linear(x.float(), w.float(), bf).to(dtype)
    else:
        expected = F.linear(x, w, b)
    linear_inputs.clear()
    with overridden({"HERALD_CPU_MATMUL": mode}):
        assert upcasts(x) is upcast
        out = linear(x, w, b)
    assert linear_inputs == [torch.float32 if upcast else dtype]
    assert out.dtype == dtype and torch.equal(out, expected)


@pytest.mark.parametrize("mode", ["auto", "fp32", "native"])
def test_float32_inputs_are_untouched(mode, linear_inputs, monkeypatch) -> None:
    monkeypatch.setattr(linear_mod, "native_bf16_matmul", lambda: False)
    x, w, b = _operands(torch.float32, bias=True)
    expected = F.linear(x, w, b)
    linear_inputs.clear()
    with overridden({"HERALD_CPU_MATMUL": mode}):
        assert not upcasts(x)
        assert torch.equal(linear(x, w, b), expected)
    assert linear_inputs == [torch.float32]


def test_only_cpu_tensors_are_upcast(monkeypatch) -> None:
    """A bf16 input on another device (meta here, CUDA alike) runs ``F.linear`` as it is."""
    monkeypatch.setattr(linear_mod, "native_bf16_matmul", lambda: False)
    x = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    w = torch.empty(16, 8, dtype=torch.bfloat16, device="meta")
    with overridden({"HERALD_CPU_MATMUL": "fp32"}):
        assert not upcasts(x)
        out = linear(x, w)
    assert out.shape == (4, 16) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
def test_linear_module_loads_an_nn_linear_state_dict(bias: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=bias)
    mine = Linear(24, 40, bias=bias)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    mine.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(5, 24)
    assert torch.equal(mine(x), ref(x))


def test_linear_module_forward_is_herald_linear(monkeypatch) -> None:
    monkeypatch.setattr(linear_mod, "native_bf16_matmul", lambda: False)
    mod = Linear(384, 520, bias=True, dtype=torch.bfloat16)
    x = _operands(torch.bfloat16)[0]
    with torch.no_grad(), overridden({"HERALD_CPU_MATMUL": "auto"}):
        assert torch.equal(mod(x), linear(x, mod.weight, mod.bias))


@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2"])
def test_every_model_projection_is_herald_linear(preset: str) -> None:
    """The models build their weight matmuls from :class:`Linear` (none is a plain nn.Linear)."""
    model = build_model(get_preset(preset), dtype=torch.bfloat16, device="meta")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is Linear for m in linears)
