"""Load an HF checkpoint folder: config.json plus one or many *.safetensors files.

Sharded folders list their files in model.safetensors.index.json; otherwise every *.safetensors
file in the folder is read. Tensors are read lazily through safetensors' `safe_open` (memory
mapped), one at a time, so peak host memory stays near one copy of the model.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from checkpoints import progress
from checkpoints.errors import CheckpointError
from checkpoints.name_table import hf_to_params
from jaxserve.config import ConfigError, ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not an HF checkpoint folder)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from None
    try:
        return ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


@contextmanager
def open_safetensors(folder: Path):
    """Every tensor of the folder's safetensors files, opened lazily (memory-mapped):
    yields (names, get) where get(name) reads one tensor. Unreadable files or tensors, and a
    tensor in two files, are CheckpointErrors naming them."""
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for f in safetensors_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(f), framework="numpy"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
            for name in handle.keys():
                if name in where:
                    raise CheckpointError(f"tensor {name!r} appears in more than one file")
                where[name] = handle

        def get(name: str) -> np.ndarray:
            try:
                w = where[name].get_tensor(name)
                progress.tick(len(where))
                return w
            except SafetensorError as e:
                raise CheckpointError(f"tensor {name!r}: unreadable ({e})") from None

        yield set(where), get


def load_hf_params(folder: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Returns the config and the parameter arrays in their on-disk dtype (fp32/fp16/bf16)."""
    folder = Path(folder)
    cfg = read_hf_config(folder)
    with open_safetensors(folder) as (names, get):
        return cfg, hf_to_params(cfg, names, get)
