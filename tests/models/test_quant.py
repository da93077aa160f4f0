"""int8 checkpoint storage (herald.models.quant): round trip, loading, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from herald.models.config import ConfigError
from herald.models.loader import CheckpointError, load_model
from herald.models.quant import dequantize_rowwise, quantize_rowwise, stored_bytes
from herald.train.checkpoint import save_checkpoint
from herald.train.config import ModelDims, check_checkpoint_size, model_config
from herald.train.objective import DenseDiffusionAttention, dense_block_diffusion_mask


def test_rowwise_round_trip_is_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0  # an all-zero row
    q, scale = quantize_rowwise(w.to(torch.bfloat16))
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_rowwise(q, scale, torch.float32)
    ref = w.to(torch.bfloat16).float()
    err = (back - ref).abs().amax(dim=1)
    assert torch.all(err <= scale / 2 * (1 + 1e-5))
    assert torch.equal(back[5], torch.zeros(48))
    assert int(q.abs().max()) == 127
    with pytest.raises(ValueError, match="2-D"):
        quantize_rowwise(torch.ones(3))
    with pytest.raises(ValueError, match="int8"):
        dequantize_rowwise(q.float(), scale, torch.float32)


def _save_both(tmp_path):
    model, config, tok = load_model("tiny-sdar", device="cpu", dtype=torch.float32)
    sizes = {
        s: save_checkpoint(model, config, tok, tmp_path / s, storage=s) for s in ("bf16", "int8")
    }
    return model, sizes


def test_int8_checkpoint_loads_within_a_step_and_is_about_half(tmp_path) -> None:
    model, sizes = _save_both(tmp_path)
    assert sizes["int8"] < 0.6 * sizes["bf16"]
    cfg = json.loads((tmp_path / "int8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "herald_int8_rowwise"
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    shapes = [tuple(p.shape) for p in model.state_dict().values()]
    assert stored_bytes(shapes, "int8") < stored_bytes(shapes, "bf16")

    loaded, _, _ = load_model(tmp_path / "int8", device="cpu", dtype=torch.float32)
    want, got = model.state_dict(), loaded.state_dict()
    for name, w in want.items():
        if w.dim() == 2:  # within half a quantization step of the row, after bf16 rounding
            step = w.abs().amax(dim=1, keepdim=True) / 127
            assert torch.all((got[name] - w).abs() <= step / 2 + 1e-2 * step + 1e-8), name
        else:
            assert torch.equal(got[name], w.to(torch.bfloat16).float()), name
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)[None]
    attn = DenseDiffusionAttention(dense_block_diffusion_mask(20, 4))
    a, b = model(ids, pos, attn), loaded(ids, pos, attn)
    # random weights amplify rounding; bf16 storage gives ~1% here, int8 ~4%
    assert float((a - b).norm() / a.norm()) < 0.1


def test_int8_checkpoint_refusals(tmp_path) -> None:
    _save_both(tmp_path)
    ckpt = tmp_path / "int8"
    files = sorted(ckpt.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(str(files[0]))
    scale = next(n for n in tensors if n.endswith("_scale"))
    # a missing scale is named
    save_file({n: t for n, t in tensors.items() if n != scale}, str(files[0]))
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_model(ckpt, device="cpu")
    # scales in a checkpoint that does not declare int8 storage are unexpected
    with pytest.raises(CheckpointError, match="unexpected"):
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.pop("quantization_config")
        (ckpt / "config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(files[0]))
        load_model(ckpt, device="cpu")
    # a quantization method herald does not read
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'fp8' is not supported"):
        load_model(ckpt, device="cpu")


def test_checkpoint_budget_counts_the_storage() -> None:
    config = model_config(ModelDims(hidden_size=512, num_layers=9, intermediate_size=1408), 8192)
    with pytest.raises(ValueError, match="int8 \\(--storage\\)"):
        check_checkpoint_size(config, 30.0)
    assert check_checkpoint_size(config, 30.0, "int8") <= 30e6
    with pytest.raises(ValueError):
        stored_bytes([(2, 2)], "fp4")


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.to(torch.bfloat16), "expected float32"),
        (lambda s: s.to(torch.int64), "expected float32"),
        (lambda s: torch.where(torch.arange(len(s)) == 0, float("nan"), s), "non-finite"),
        (lambda s: -s, "non-positive"),
    ],
)
def test_a_bad_scale_is_refused_not_loaded(tmp_path, edit, match) -> None:
    _save_both(tmp_path)
    (f,) = sorted((tmp_path / "int8").glob("*.safetensors"))
    tensors = load_file(str(f))
    name = next(n for n in tensors if n.endswith("_scale"))
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match=match):
        load_model(tmp_path / "int8", device="cpu")


def test_integer_tensors_need_the_int8_declaration(tmp_path) -> None:
    _save_both(tmp_path)
    ckpt = tmp_path / "int8"
    (f,) = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(str(f))
    # int8 weights without their scales and without the config entry: refused, not raw integers
    save_file({n: t for n, t in tensors.items() if not n.endswith("_scale")}, str(f))
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="needs its quantization_config"):
        load_model(ckpt, device="cpu")
    # a 1-D (norm) weight stored as int8 inside a declared int8 checkpoint
    tensors = {n: t for n, t in tensors.items()}
    norm = next(n for n, t in tensors.items() if t.dim() == 1 and not n.endswith("_scale"))
    tensors[norm] = tensors[norm].to(torch.int8)
    save_file(tensors, str(f))
    (ckpt / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(CheckpointError, match="expected a floating-point"):
        load_model(ckpt, device="cpu")
    # scales present but undeclared: the message says what they are
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="declares no int8 quantization_config"):
        load_model(ckpt, device="cpu")
    for bad, match in (("int8", "must be an object"), ({**qc, "bits": 4}, "stores 8 bits")):
        (ckpt / "config.json").write_text(json.dumps({**cfg, "quantization_config": bad}))
        with pytest.raises(ConfigError, match=match):
            load_model(ckpt, device="cpu")


def test_sharded_int8_index_lists_the_scales(tmp_path) -> None:
    model, config, tok = load_model("tiny-sdar", device="cpu", dtype=torch.float32)
    save_checkpoint(model, config, tok, tmp_path / "c", storage="int8", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    names = set()
    for f in sorted((tmp_path / "c").glob("*.safetensors")):
        names |= set(load_file(str(f)))
    assert set(index["weight_map"]) == names and any(n.endswith("_scale") for n in names)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size()
        for f in (tmp_path / "c").glob("*.safetensors")
        for t in load_file(str(f)).values()
    )
    load_model(tmp_path / "c", device="cpu")
