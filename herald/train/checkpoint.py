"""Writing the trained model as an HF checkpoint, and the resume state beside it.

The checkpoint directory is what ``herald generate --model DIR`` and
:func:`herald.models.loader.load_model` read: ``config.json`` (``SDARForCausalLM`` with
``block_size``, ``mask_token_id``, ``eos_token_ids``, ``pad_token_id``), the weights in bf16 under
the real SDAR tensor names (one ``model.safetensors``, or shards plus
``model.safetensors.index.json`` when larger than the shard limit), ``tokenizer.json`` and
``tokenizer_config.json``.

The resume state is a small JSON file kept *outside* the checkpoint (step, tokens seen, data
position, the data manifest digest, the history of runs); AdamW's moments go to an optional
separate file. Neither belongs in the repo.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from herald.models.common import DecoderLM
from herald.models.config import ModelConfig
from herald.models.loader import INDEX_FILE, SINGLE_FILE, hf_config_dict
from herald.models.weights import WeightSpec, get_target
from herald.tokenizer import Tokenizer


def _shards(specs: list[WeightSpec], max_bytes: int) -> list[list[WeightSpec]]:
    shards: list[list[WeightSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = 2 * spec.numel
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


@torch.no_grad()
def save_checkpoint(
    model: DecoderLM,
    config: ModelConfig,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    *,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int = 15 * 2**20,
) -> int:
    """Write ``model`` (any dtype/device) as a bf16 HF checkpoint into ``out_dir``.

    The directory is written beside ``out_dir`` and swapped in at the end, so an interrupted save
    leaves the previous checkpoint intact. ``extra_config`` keys are added to ``config.json``
    (provenance; :class:`ModelConfig` ignores them).

    Returns:
        Bytes of the safetensors files.
    """
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf = hf_config_dict(config, torch.bfloat16)
    hf.pop("herald_random_weights", None)
    hf.update(extra_config or {})
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tokenizer.save(tmp)
    specs = model.weight_specs(config)
    shards = _shards(specs, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = (
            SINGLE_FILE
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {
            s.name: get_target(model, s).detach().to("cpu", torch.bfloat16).contiguous()
            for s in shard
        }
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        total += (tmp / name).stat().st_size
        weight_map.update((s.name, name) for s in shard)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": 2 * sum(s.numel for s in specs)},
            "weight_map": weight_map,
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
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
