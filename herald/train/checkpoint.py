"""Writing the trained model as an HF checkpoint, and the resume state beside it.

The checkpoint directory is what ``herald generate --model DIR`` and
:func:`herald.models.loader.load_model` read: ``config.json`` (``SDARForCausalLM`` with
``block_size``, ``mask_token_id``, ``eos_token_ids``, ``pad_token_id``), the weights in bf16 (or
int8 with per-row scales, :mod:`herald.models.quant`) under the real SDAR tensor names (one
``model.safetensors``, or shards plus ``model.safetensors.index.json`` when larger than the shard
limit), ``tokenizer.json`` and ``tokenizer_config.json``.

The resume state is a small JSON file kept *outside* the checkpoint (step, tokens seen, data
position, the data manifest digest, the history of runs); AdamW's moments go to an optional
separate file. Neither belongs in the repo.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from herald.models.common import DecoderLM
from herald.models.config import ModelConfig
from herald.models.loader import INDEX_FILE, SINGLE_FILE, hf_config_dict
from herald.models.quant import (
    SCALE_SUFFIX,
    STORAGES,
    dequantize_rowwise,
    is_quantized,
    quantization_config,
    quantize_rowwise,
    stored_bytes,
)
from herald.models.tokenizer import Tokenizer
from herald.models.weights import WeightSpec, get_target


def _shards(specs: list[WeightSpec], max_bytes: int, storage: str) -> list[list[WeightSpec]]:
    shards: list[list[WeightSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = stored_bytes([spec.shape], storage)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def check_replaceable(out: Path) -> None:
    """The save may replace ``out``: absent, an empty directory, or a directory holding a
    ``config.json`` (a checkpoint).

    Raises:
        FileExistsError: otherwise (a file, or a directory of other data).
    """
    if not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a checkpoint directory; not replacing it")
    if any(out.iterdir()) and not (out / "config.json").is_file():
        raise FileExistsError(
            f"{out} is a non-empty directory without config.json (not a checkpoint); not "
            "replacing it"
        )


def _sibling(out: Path, tag: str) -> Path:
    """A new, unused hidden path beside ``out`` (never an existing one: nothing is clobbered)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        cand = out.with_name(f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")
        if not (cand.exists() or cand.is_symlink()):
            return cand


def _write_checkpoint(
    model: DecoderLM,
    config: ModelConfig,
    tokenizer: Tokenizer,
    tmp: Path,
    *,
    extra_config: dict[str, Any] | None,
    max_shard_bytes: int,
    storage: str,
) -> int:
    """Write the checkpoint files into the new directory ``tmp``; returns the safetensors bytes."""
    hf = hf_config_dict(config, torch.bfloat16)
    hf.pop("herald_random_weights", None)
    hf.pop("quantization_config", None)  # a resumed checkpoint's: this save decides its storage
    hf.update(extra_config or {})
    if storage == "int8":
        hf["quantization_config"] = quantization_config()
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tokenizer.save(tmp)
    specs = model.weight_specs(config)
    shards = _shards(specs, max_shard_bytes, storage)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = (
            SINGLE_FILE
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors: dict[str, torch.Tensor] = {}
        for s in shard:
            w = get_target(model, s).detach()
            if storage == "int8" and is_quantized(s.shape):
                tensors[s.name], tensors[s.name + SCALE_SUFFIX] = quantize_rowwise(w)
            else:
                tensors[s.name] = w.to("cpu", torch.bfloat16).contiguous()
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        total += (tmp / name).stat().st_size
        weight_map.update((t, name) for t in tensors)  # the int8 row scales too
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": stored_bytes([s.shape for s in specs], storage)},
            "weight_map": weight_map,
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # safetensors creates its files 0600; give every file the mode Python gave config.json
    # (0666 less the umask), like any other new file.
    mode = stat.S_IMODE((tmp / "config.json").stat().st_mode)
    for f in tmp.iterdir():
        os.chmod(f, mode)
    return total


@torch.no_grad()
def save_checkpoint(
    model: DecoderLM,
    config: ModelConfig,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 15 * 2**20,
    storage: str = "bf16",
) -> int:
    """Write ``model`` (any dtype/device) as an HF checkpoint into ``out_dir``: bf16 tensors, or
    with ``storage="int8"`` int8 2-D tensors with per-row float32 scales and a
    ``quantization_config`` in config.json (:mod:`herald.models.quant`; the loader dequantizes).

    The directory is written beside ``out_dir`` (under a new hidden name) and swapped in at the
    end, so an interrupted save leaves the previous checkpoint intact. An existing ``out_dir`` is
    replaced only when it is empty or a checkpoint (:func:`check_replaceable`); nothing else is
    deleted. The files get the permissions of ordinary new files (umask). ``extra_config`` keys
    are added to ``config.json`` (provenance; :class:`ModelConfig` ignores them).

    Raises:
        FileExistsError: ``out_dir`` is a file, or a non-empty directory without config.json.

    Returns:
        Bytes of the safetensors files.
    """
    out = Path(out_dir)
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    check_replaceable(out)
    tmp = _sibling(out, "tmp")
    tmp.mkdir()
    try:
        total = _write_checkpoint(
            model,
            config,
            tokenizer,
            tmp,
            extra_config=extra_config,
            max_shard_bytes=max_shard_bytes,
            storage=storage,
        )
        check_replaceable(out)  # again: the save comes at the end of a long run
        if out.exists():
            old = _sibling(out, "old")
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON via a temporary file (atomic replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def find_resume_state(resume: Path, explicit: Path | None) -> Path | None:
    """The state file of the run being resumed: ``explicit``, else ``train_state.json`` inside
    ``resume`` or beside it; None when there is none.

    Raises:
        FileNotFoundError: ``explicit`` was given but does not exist.
    """
    if explicit is not None:
        if not explicit.is_file():
            raise FileNotFoundError(f"resume state file {explicit} does not exist")
        return explicit
    for cand in (resume / "train_state.json", resume.parent / "train_state.json"):
        if cand.is_file():
            return cand
    return None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file. Raises ValueError if it is not a JSON object."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


@contextmanager
def stored_weights(model: DecoderLM, storage: str) -> Iterator[None]:
    """Inside: ``model``'s weights as a checkpoint in ``storage`` stores them (int8: each 2-D or
    stacked weight through the per-row int8 round trip, the rest rounded to bf16; bf16: every
    weight rounded to bf16); on exit the original weights are back."""
    # NOTE: the training weights wait on the CPU: a GPU copy of every weight right after
    # training (optimizer state still held) could run out of memory and lose the run.
    saved = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters()]
    try:
        with torch.no_grad():
            for p in model.parameters():  # a tied embedding is yielded once
                if storage == "int8" and p.dim() >= 2:
                    rows = p.detach().reshape(-1, p.shape[-1])
                    q, scale = quantize_rowwise(rows)
                    w = dequantize_rowwise(q, scale, p.dtype).reshape(p.shape)
                    p.copy_(w.to(p.device))
                else:
                    p.copy_(p.to(torch.bfloat16))
        yield
    finally:
        with torch.no_grad():
            for p, w in saved:
                p.copy_(w.to(p.device))
