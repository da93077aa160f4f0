"""HF-format checkpoints: load them into herald models, and write random ones.

A checkpoint directory holds ``config.json``, the weights as one ``model.safetensors`` or as shards
``model-0000i-of-0000n.safetensors`` listed in ``model.safetensors.index.json``, and optionally
``tokenizer.json`` / ``tokenizer_config.json``. Tensor names and shapes are exactly those of the
real SDAR-8B-Chat and LLaDA2.0-mini checkpoints (docs/MODELS.md §4, §5), so a downloaded
checkpoint loads unchanged and a random one written here loads like a real one.

Loading checks every name and shape against the architecture's :class:`WeightSpec` list *before*
allocating the model (reading only the safetensors headers), then builds the model uninitialised on
the target device and copies tensor by tensor straight from the files (peak memory: the model plus
one tensor).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from herald.models.common import DecoderLM
from herald.models.config import LLADA2_ARCH, ModelConfig
from herald.models.quant import (
    SCALE_SUFFIX,
    check_scale,
    checkpoint_storage,
    dequantize_rowwise,
    is_quantized,
)
from herald.models.registry import (
    build_model,
    default_device,
    default_dtype,
    get_preset,
    init_std,
    list_presets,
    weight_specs,
)
from herald.models.tokenizer import Tokenizer, byte_level_tokenizer, load_tokenizer
from herald.models.weights import WeightSpec, get_target, random_tensor

SINGLE_FILE = "model.safetensors"

BUNDLED_CHECKPOINTS: dict[str, Path] = {
    "code-sdar": Path(__file__).resolve().parents[2] / "checkpoints" / "code-sdar" / "ckpt",
}
"""Trained checkpoints that ship in the repository's ``checkpoints/`` folder, by name
(``code-sdar``: a small SDAR model trained on Python code, ``checkpoints/code-sdar/README.md``)."""
INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters add that carry nothing herald needs (recomputed buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the architecture (missing, extra, wrong shape)."""


def _list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def open_weights(path: Path, device: str = "cpu") -> Iterator[Any]:
    """``safe_open`` of one weights file; a file that is not valid safetensors (truncated, cut
    short by a failed download, overwritten) raises :class:`CheckpointError` naming it."""
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({e}): it is truncated or corrupted; "
            "download or write it again"
        ) from None
    with handle as st:
        yield st


def checkpoint_tensors(ckpt_dir: str | Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Name -> (file, shape) of every tensor in the checkpoint, from the safetensors headers only.

    Raises:
        FileNotFoundError: no weights file, or a shard named in the index is absent (named).
        CheckpointError: the index lists a tensor that its shard does not contain.
    """
    root = Path(ckpt_dir)
    index = root / INDEX_FILE
    if index.is_file() and (root / SINGLE_FILE).is_file():
        raise CheckpointError(
            f"{root} holds both {SINGLE_FILE} and {INDEX_FILE}: ambiguous, remove one"
        )
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid index (no weight_map): {e}") from None
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(
                    f"shard {f.name} listed in {INDEX_FILE} is missing from {root}"
                )
    elif (root / SINGLE_FILE).is_file():
        files, weight_map = [root / SINGLE_FILE], {}
    else:
        files, weight_map = sorted(root.glob("*.safetensors")), {}
        if not files:
            raise FileNotFoundError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {root}")
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with open_weights(f) as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in weight_map or weight_map[name] == f.name:
                    found[name] = (f, tuple(st.get_slice(name).get_shape()))
    absent = sorted(n for n, f in weight_map.items() if n not in found)
    if absent:
        raise CheckpointError(
            f"{INDEX_FILE} in {root} lists {len(absent)} tensor(s) missing from their shard: "
            + _list(absent)
        )
    return found


def check_tensors(
    specs: list[WeightSpec],
    found: dict[str, tuple[Path, tuple[int, ...]]],
    where: str | Path,
    storage: str = "bf16",
) -> None:
    """Raise :class:`CheckpointError` naming every missing / unexpected tensor and wrong shape.

    ``storage="int8"`` (:mod:`herald.models.quant`): every 2-D tensor also has its
    ``<name>_scale`` of shape [rows]."""
    expected = {s.name: s.shape for s in specs}
    if storage == "int8":
        for s in specs:
            if is_quantized(s.shape):
                expected[s.name + SCALE_SUFFIX] = (s.shape[0],)
    problems = []
    missing = [n for n in expected if n not in found]
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_list(missing)}")
    unexpected = sorted(n for n in found if n not in expected and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        hint = (
            " (int8 row scales, but config.json declares no int8 quantization_config)"
            if storage != "int8" and any(n.endswith(SCALE_SUFFIX) for n in unexpected)
            else ""
        )
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_list(unexpected)}{hint}")
    wrong = [
        f"{n}: expected {list(shape)}, found {list(found[n][1])}"
        for n, shape in expected.items()
        if n in found and found[n][1] != shape
    ]
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {_list(wrong)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {where} does not match the architecture: " + "; ".join(problems)
        )


def _safetensors_device(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


@torch.no_grad()
def load_weights_(model: DecoderLM, ckpt_dir: str | Path) -> None:
    """Check the checkpoint against ``model``'s architecture, then copy every tensor into it.

    Tensors are read straight onto the model's device and cast to the target's dtype.

    Raises:
        FileNotFoundError / CheckpointError: see :func:`checkpoint_tensors`, :func:`check_tensors`;
        CheckpointError also for a tensor holding NaN or infinite values (a corrupted file).
    """
    specs = model.weight_specs(model.config)
    found = checkpoint_tensors(ckpt_dir)
    storage = checkpoint_storage(ckpt_dir)
    check_tensors(specs, found, ckpt_dir, storage)
    device = _safetensors_device(next(model.parameters()).device)
    by_file: dict[Path, list[WeightSpec]] = {}
    for spec in specs:
        by_file.setdefault(found[spec.name][0], []).append(spec)
    for f, file_specs in by_file.items():
        with open_weights(f, device) as st:
            for spec in file_specs:
                t = st.get_tensor(spec.name)
                target = get_target(model, spec)
                if storage == "int8" and is_quantized(spec.shape):
                    if t.dtype != torch.int8:
                        raise CheckpointError(
                            f"{ckpt_dir}: {spec.name} is {t.dtype}, expected int8 "
                            "(config.json declares int8 storage)"
                        )
                    sname = spec.name + SCALE_SUFFIX
                    sf = found[sname][0]
                    if sf == f:
                        scale = st.get_tensor(sname)
                    else:  # the writer keeps them together; another writer may not
                        with open_weights(sf, device) as ss:
                            scale = ss.get_tensor(sname)
                    try:
                        check_scale(sname, scale)
                    except ValueError as e:
                        raise CheckpointError(f"{ckpt_dir}: {e}") from None
                    t = dequantize_rowwise(t, scale, target.dtype)
                elif not t.dtype.is_floating_point:
                    hint = (
                        "" if storage == "int8" else
                        " (an int8 checkpoint needs its quantization_config in config.json)"
                    )  # fmt: skip
                    raise CheckpointError(
                        f"{ckpt_dir}: {spec.name} is {t.dtype}, expected a floating-point "
                        f"tensor{hint}"
                    )
                target.copy_(t)
                if not bool(torch.isfinite(target).all()):
                    raise CheckpointError(
                        f"{f}: {spec.name} holds NaN or infinite values (a corrupted file?)"
                    )


def bundled_checkpoint(name: str | Path) -> Path | None:
    """The directory of the bundled checkpoint ``name`` (:data:`BUNDLED_CHECKPOINTS`), or None
    when ``name`` is not one (or is an existing directory).

    Raises:
        FileNotFoundError: ``name`` is bundled but its files are not there (an install without
            the repository's ``checkpoints/`` folder).
    """
    if Path(name).is_dir() or str(name) not in BUNDLED_CHECKPOINTS:
        return None
    path = BUNDLED_CHECKPOINTS[str(name)]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled checkpoint {str(name)!r} is not at {path}: it ships in the repository's "
            "checkpoints/ folder (install from a clone with `pip install -e .`), or pass "
            "--model with a checkpoint directory or a preset"
        )
    return path


def checkpoint_path(path_or_preset: str | Path) -> Path:
    """Where a checkpoint named by ``--model`` is: a bundled checkpoint's directory, else the path
    itself; a directory without ``config.json`` whose ``ckpt/`` holds one (the layout `herald
    train` writes and ``checkpoints/`` ships) means that ``ckpt/``."""
    path = bundled_checkpoint(path_or_preset) or Path(path_or_preset)
    if (
        path.is_dir()
        and not (path / "config.json").is_file()
        and (path / "ckpt" / "config.json").is_file()
    ):
        return path / "ckpt"
    return path


def is_preset(name: str | Path) -> bool:
    """True when ``name`` is a preset name (and not an existing directory)."""
    return not Path(name).is_dir() and str(name) in list_presets()


def load_model(
    path_or_preset: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    random_init_seed: int | None = None,
    **config_overrides: Any,
) -> tuple[DecoderLM, ModelConfig, Tokenizer]:
    """Load a checkpoint directory, or build a preset with random weights.

    Args:
        path_or_preset: an HF checkpoint directory (or a folder holding one as ``ckpt/``, the
            layout `herald train` writes), a bundled checkpoint's name
            (:data:`BUNDLED_CHECKPOINTS`), or a preset name (:func:`list_presets`).
        device: default CUDA when available, else CPU.
        dtype: default bfloat16 on CUDA, float32 on CPU.
        random_init_seed: seed of a preset's random weights (default 0); ignored for a
            checkpoint directory, whose weights are always loaded.
        config_overrides: :class:`ModelConfig` fields to replace (``block_size``,
            ``mask_token_id``, ``max_position_embeddings``, ...).

    Returns:
        (model in eval mode without grads, its config, its tokenizer).

    Raises:
        FileNotFoundError: not a directory nor a preset; no config.json; missing weight file.
        ConfigError: unsupported architecture (lists the supported ones) or bad config.
        CheckpointError: missing / unexpected tensors or wrong shapes (all named).
    """
    dev = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(dev)
    config = load_config(path_or_preset, **config_overrides)
    path = checkpoint_path(path_or_preset)
    if path.is_dir():
        tokenizer = load_tokenizer(path, config)
        storage = checkpoint_storage(path)
        check_tensors(weight_specs(config), checkpoint_tensors(path), path, storage)
        model = build_model(config, dev, dtype)
        load_weights_(model, path)
        return model, config, tokenizer
    seed = 0 if random_init_seed is None else random_init_seed
    return build_model(config, dev, dtype, seed=seed), config, byte_level_tokenizer(config)


def load_config(path_or_preset: str | Path, **config_overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` that :func:`load_model` would build, without building the model:
    a checkpoint directory's (or a bundled checkpoint's) ``config.json``, else a preset's;
    ``config_overrides`` as there.

    Raises:
        FileNotFoundError: not a directory nor a preset; no config.json.
        ConfigError: unsupported architecture or bad config.
    """
    path = checkpoint_path(path_or_preset)
    if path.is_dir():
        return ModelConfig.from_file(path, **config_overrides)
    if is_preset(str(path_or_preset)):
        return get_preset(str(path_or_preset), **config_overrides)
    raise FileNotFoundError(
        f"{str(path_or_preset)!r} is neither a checkpoint directory nor a preset; bundled: "
        + ", ".join(BUNDLED_CHECKPOINTS)
        + "; presets: "
        + ", ".join(list_presets())
    )


def hf_config_dict(config: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The ``config.json`` dict for ``config``: its raw HF dict with every normalised field written
    back, plus ``mask_token_id`` / ``block_size`` / ``eos_token_ids``, so that
    ``ModelConfig.from_hf(hf_config_dict(c)) == c``."""
    d = dict(config.hf_config)
    d.update(
        architectures=[config.architecture],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        mask_token_id=config.mask_token_id,
        block_size=config.block_size,
        eos_token_ids=list(config.eos_token_ids),
        pad_token_id=config.pad_token_id,
    )
    if config.architecture == LLADA2_ARCH:
        d.update(
            rotary_dim=config.rotary_dim,
            partial_rotary_factor=config.rotary_dim / config.head_dim,
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            num_shared_experts=config.num_shared_experts,
            first_k_dense_replace=config.first_k_dense_replace,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
        )
    if dtype is not None:
        d["torch_dtype"] = str(dtype).removeprefix("torch.")
    return d


def _shard_plan(
    specs: list[WeightSpec], dtype: torch.dtype, max_shard_bytes: int
) -> list[list[WeightSpec]]:
    shards: list[list[WeightSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * (spec.file_dtype or dtype).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_random_checkpoint(
    config_or_preset: ModelConfig | str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a random-weight HF checkpoint: config.json, safetensors, tokenizer files.

    Weights are generated tensor by tensor on the CPU (memory: one shard at a time) with the same
    per-tensor seeds as :func:`herald.models.registry.init_random_weights`, so loading the
    directory in float32 on CPU gives the model ``build_model(config, "cpu", float32, seed=seed)``
    gives (up to the ``dtype`` rounding of the files). More than ``max_shard_bytes`` of weights ->
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    Returns:
        ``out_dir`` as a Path (created if needed).
    """
    config = get_preset(config_or_preset) if isinstance(config_or_preset, str) else config_or_preset
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    stale = sorted(p.name for p in out.glob("*.safetensors*")) if out.is_dir() else []
    if stale:
        # Writing next to old weights would leave an index or shards that the loader prefers.
        raise FileExistsError(
            f"{out} already holds a checkpoint ({', '.join(stale[:3])}); use an empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_config_dict(config, dtype)
    hf["herald_random_weights"] = True  # so tools can say the weights are noise
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    byte_level_tokenizer(config).save(out)
    specs = weight_specs(config)
    std = init_std(config)
    shards = _shard_plan(specs, dtype, max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {
            s.name: random_tensor(s, seed=seed, std=std, dtype=s.file_dtype or dtype) for s in shard
        }
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update((s.name, fname) for s in shard)
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def config_fields_equal(a: ModelConfig, b: ModelConfig) -> bool:
    """True when every compared field (all but the raw ``hf_config``) is equal."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.compare)
