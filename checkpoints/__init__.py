"""Checkpoint loading: HF safetensors folders, GGUF files and the embedded default model.

`load_params(path)` returns the model config and host parameter arrays keyed by the paths of
jaxserve.model.llama.param_shapes; `load_model(path, dtype)` also builds the Flax model.

Layering (import-linter contracts in pyproject.toml): checkpoints build on jaxserve's bottom
(jaxserve.config and jaxserve.model, which never import checkpoints) and import nothing else of
jaxserve; the rest of jaxserve (loading, engine, server, cli) sits on top and imports them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from checkpoints.default_model import DefaultModelMissing, default_model_path
from checkpoints.errors import CheckpointError
from jaxserve.config import DTYPES, ModelConfig

# The readers and the model are imported where used, for import time only (no cycle to hide:
# the contracts above hold for these imports too): `from checkpoints.errors import
# CheckpointError` runs this file, and the CLI does that before every command, `jaxserve client`
# included, which would otherwise pay ~4 s for jax, flax, gguf and safetensors (0.5 s without).

__all__ = ["CheckpointError", "DefaultModelMissing", "LoadedParams", "default_model_path",
           "load_params", "load_model", "resolve_model_path"]


@dataclasses.dataclass
class LoadedParams:
    config: ModelConfig
    params: dict[str, np.ndarray]
    source: Path
    format: str  # "hf" or "gguf"
    gguf_metadata: dict[str, Any] | None = None


def resolve_model_path(path: str | Path | None) -> Path:
    """None -> the embedded default model; otherwise the path, which must exist."""
    if path is None:
        return default_model_path()
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model path {p} does not exist (expected an HF folder or a .gguf file)")
    return p


def load_params(path: str | Path | None = None) -> LoadedParams:
    p = resolve_model_path(path)
    if p.is_dir():
        from checkpoints.hf import load_hf_params
        cfg, params = load_hf_params(p)
        return LoadedParams(cfg, params, p, "hf")
    if p.suffix == ".gguf":
        from checkpoints.gguf_loader import load_gguf_params
        ckpt, params = load_gguf_params(p)
        return LoadedParams(ckpt.config, params, p, "gguf", ckpt.metadata)
    raise CheckpointError(f"model path {p}: not a folder or a .gguf file")


def load_model(path: str | Path | None = None, dtype: str = "float32"):
    """(Llama module, LoadedParams) with weights cast to `dtype`."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {DTYPES}")
    import jax.numpy as jnp

    from jaxserve.model.llama import Llama
    loaded = load_params(path)
    model = Llama.from_arrays(loaded.config, loaded.params, dtype=jnp.dtype(dtype))
    return model, loaded
