"""Checkpoint loading and random checkpoints: round trips and every error path."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import TINY_PRESETS, ExactAttention
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from herald.models.config import ConfigError, ModelConfig
from herald.models.loader import (
    CheckpointError,
    config_fields_equal,
    hf_config_dict,
    is_preset,
    load_config,
    load_model,
)
from herald.models.registry import build_model, get_preset, list_presets


def _logits(model: torch.nn.Module, n: int = 40) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(n).expand(2, n)
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, ExactAttention(32)))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_round_trip_single_and_sharded_give_identical_outputs(
    preset: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    single = tiny_checkpoint(preset)
    sharded = tiny_checkpoint(preset, sharded=True)
    assert (single / "model.safetensors").is_file()
    assert not (single / "model.safetensors.index.json").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    m1, c1, _ = load_model(single, "cpu", torch.float32)
    m2, c2, _ = load_model(sharded, "cpu", torch.float32)
    in_memory = build_model(get_preset(preset), "cpu", torch.float32, seed=0)
    assert config_fields_equal(c1, get_preset(preset)) and config_fields_equal(c1, c2)
    out = _logits(m1)
    assert torch.equal(out, _logits(m2))
    assert torch.equal(out, _logits(in_memory))


def test_bf16_checkpoint_keeps_fp32_expert_bias(tiny_checkpoint: Callable[..., Path]) -> None:
    ckpt = tiny_checkpoint("tiny-llada2", dtype=torch.bfloat16)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.expert_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _, _ = load_model(ckpt, "cpu", torch.bfloat16)
    ref = build_model(get_preset("tiny-llada2"), "cpu", torch.float32, seed=0)
    bias = model.layers[1].mlp.gate.expert_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, ref.layers[1].mlp.gate.expert_bias)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight.to(torch.bfloat16))


def test_config_overrides_and_defaults(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = tiny_checkpoint("tiny-sdar")
    _, cfg, tok = load_model(ckpt, "cpu", block_size=4, mask_token_id=257)
    assert cfg.block_size == 4 and cfg.mask_token_id == 257 and tok.mask_token_id == 257
    # Without the keys, the architecture defaults apply (SDAR: block 4, mask 151669).
    hf = json.loads((ckpt / "config.json").read_text())
    del hf["block_size"], hf["mask_token_id"]
    assert ModelConfig.from_hf(hf).block_size == 4
    assert ModelConfig.from_hf(hf).mask_token_id == 151669


@pytest.mark.parametrize("preset", ["tiny-sdar", "tiny-llada2", "sdar-8b-chat", "llada2-mini"])
def test_hf_config_dict_round_trips(preset: str) -> None:
    cfg = get_preset(preset)
    assert config_fields_equal(ModelConfig.from_hf(hf_config_dict(cfg)), cfg)
    changed = cfg.replace(block_size=8, num_layers=2)
    assert config_fields_equal(ModelConfig.from_hf(hf_config_dict(changed)), changed)


def test_presets_load_with_random_weights() -> None:
    assert {"sdar-8b-chat", "llada2-mini", "tiny-sdar", "tiny-llada2"} <= set(list_presets())
    assert is_preset("tiny-sdar") and not is_preset("no-such-model")
    m1, cfg, tok = load_model("tiny-llada2", "cpu", random_init_seed=3)
    m2, _, _ = load_model("tiny-llada2", "cpu", random_init_seed=3)
    m3, _, _ = load_model("tiny-llada2", "cpu")
    assert cfg.architecture == "LLaDA2MoeModelLM" and tok.mask_token_id == cfg.mask_token_id
    assert torch.equal(_logits(m1), _logits(m2)) and not torch.equal(_logits(m1), _logits(m3))
    assert next(m1.parameters()).dtype == torch.float32  # CPU default


def test_unknown_preset_or_path_lists_presets() -> None:
    with pytest.raises(
        FileNotFoundError, match="neither a checkpoint directory nor a preset.*tiny-sdar"
    ):
        load_model("no-such-model", "cpu")
    with pytest.raises(KeyError, match="unknown preset 'nope'; presets: .*llada2-mini"):
        get_preset("nope")


def test_unknown_architecture(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "ckpt")
    hf = json.loads((ckpt / "config.json").read_text())
    hf["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        ConfigError, match="'LlamaForCausalLM'.*supported: SDARForCausalLM, LLaDA2MoeModelLM"
    ):
        load_model(ckpt, "cpu")


def test_missing_config_json(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        load_model(ckpt, "cpu")


def test_a_run_folder_means_its_ckpt(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    # `herald train` writes <out>/ckpt/ and checkpoints/ ships the same layout: --model <out> works
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "run" / "ckpt")
    model, cfg, _ = load_model(tmp_path / "run", "cpu")
    direct, _, _ = load_model(ckpt, "cpu")
    assert torch.equal(_logits(model), _logits(direct))
    assert load_config(tmp_path / "run") == cfg
    # the other readers of --model resolve it the same way
    from herald.bench.serve import _load_tokenizer
    from herald.eval.cli_checks import checkpoint_dir

    assert checkpoint_dir(str(tmp_path / "run")) == ckpt
    assert _load_tokenizer(str(tmp_path / "run"))[0] == cfg
    (ckpt / "config.json").unlink()  # a folder with neither: the plain error, naming the folder
    with pytest.raises(FileNotFoundError, match=f"no config.json at {tmp_path / 'run'}"):
        load_config(tmp_path / "run")


def test_missing_weights_and_missing_shard(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar", sharded=True), tmp_path / "sharded")
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard.name} listed in .*index.json"):
        load_model(ckpt, "cpu")
    single = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "single")
    (single / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(single, "cpu")


def _rewrite(ckpt: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-llada2"), tmp_path / "ckpt")
    _rewrite(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor\(s\): model.layers.2.mlp.experts.5.up_proj.weight"
    ):
        load_model(ckpt, "cpu")


def test_unexpected_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "ckpt")
    _rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(256)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected 1 tensor\(s\): model.layers.0.self_attn.q_proj.bias"
    ):
        load_model(ckpt, "cpu")


def test_wrong_shape_names_expected_and_found(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "ckpt")
    _rewrite(
        ckpt, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 128)})
    )
    with pytest.raises(
        CheckpointError,
        match=r"model.layers.1.self_attn.k_proj.weight: expected \[64, 128\], found \[32, 128\]",
    ):
        load_model(ckpt, "cpu")


def test_index_listing_an_absent_tensor(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar", sharded=True), tmp_path / "ckpt")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.extra.weight"] = first
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing from their shard: model.layers.0.extra"):
        load_model(ckpt, "cpu")


def test_harmless_rotary_inv_freq_is_ignored(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt = _copy(tiny_checkpoint("tiny-sdar"), tmp_path / "ckpt")
    _rewrite(
        ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)})
    )
    model, _, _ = load_model(ckpt, "cpu", torch.float32)
    ref = build_model(get_preset("tiny-sdar"), "cpu", torch.float32, seed=0)
    assert torch.equal(_logits(model), _logits(ref))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupted_weights_file_is_named(tmp_path, damage):
    from herald.models.loader import write_random_checkpoint

    write_random_checkpoint("tiny-sdar", tmp_path, seed=0)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(
        {"truncated": data[: len(data) // 3], "garbage": b"not safetensors" * 8, "empty": b""}[
            damage
        ]
    )
    with pytest.raises(CheckpointError, match="is not a readable safetensors file") as e:
        load_model(tmp_path, "cpu", torch.float32)
    assert str(weights) in str(e.value)


def test_a_corrupted_tokenizer_file_is_named(tmp_path):
    from herald.models.loader import write_random_checkpoint

    write_random_checkpoint("tiny-sdar", tmp_path, seed=0)
    (tmp_path / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(ValueError, match="tokenizer.json is not a readable tokenizer file"):
        load_model(tmp_path, "cpu", torch.float32)


def test_a_tensor_of_nan_is_refused_naming_file_and_tensor(tmp_path) -> None:
    """Bytes overwritten inside a shard's data (its header intact) load as NaN weights, which
    decode to nothing without a word: refused at load instead."""
    import json as _json

    from herald.models.loader import CheckpointError, load_model, write_random_checkpoint

    ckpt = write_random_checkpoint("tiny-sdar", tmp_path / "ck", seed=0)
    shard = next(ckpt.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    meta = _json.loads(raw[8 : 8 + header])
    name = next(k for k in meta if k != "__metadata__" and meta[k]["dtype"] in ("F32", "BF16"))
    lo, hi = meta[name]["data_offsets"]
    raw[8 + header + lo : 8 + header + hi] = b"\xff" * (hi - lo)  # NaN in F32 and BF16
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{name} holds NaN"):
        load_model(str(ckpt), "cpu")
