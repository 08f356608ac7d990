"""HF tensor names <-> jaxserve parameter paths, from the family's parameter table
(jaxserve/model/family.py: each row says its HF name and layout).

  "same"  : identical shape                      (norms, embedding)
  "linear": ours = hf.T reshaped; `in_dims` leading dims of ours are HF's `in` side
             q_proj [N*H, D] -> wq [D, N, H] (in_dims=1);  o_proj [D, N*H] -> wo [N, H, D] (in_dims=2)
  "bias"  : [N*H] -> [N, H]
  "norm1" : ours = 1 + hf (Gemma's (1 + w) RMSNorm, stored the way llama.cpp's GGUF stores it)
A row with `rows` reads its part of a fused HF tensor (Phi-3's qkv_proj and gate_up_proj):
the fused tensor is read once per layer and split by rows; writing joins the parts again.

Per-layer entries are stacked along a leading layer axis by `hf_to_params`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from checkpoints.errors import CheckpointError
from jaxserve.config import ModelConfig
from jaxserve.model import family
from jaxserve.model.family import Param, hf_names, hf_shape, lead_dims, param_shapes

# Tensors some checkpoints carry that the model does not need (recomputed or tied), by suffix.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def table(cfg: ModelConfig) -> list[Param]:
    return family.table(cfg)


def to_ours(p: Param, w: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    """One (layer's) HF tensor -> this row's array in our layout (a fused tensor: its rows)."""
    if p.rows is not None:
        w = w[p.rows[0]:p.rows[0] + p.rows[1]]
    if p.layout == "linear":
        return np.ascontiguousarray(w.T).reshape(ours)
    if p.layout == "norm1":
        return (w.astype(np.float32) + 1).astype(w.dtype).reshape(ours)
    return w.reshape(ours)


_to_ours = to_ours  # the name quantize.py and sharded.py used


def to_hf(p: Param, w: np.ndarray) -> np.ndarray:
    """Our array (one layer's) -> the HF tensor, or for a fused row its part of the rows."""
    hf = hf_shape(p, w.shape)
    if p.layout == "linear":
        return np.ascontiguousarray(w.reshape(hf[::-1]).T)
    if p.layout == "norm1":
        return (w.astype(np.float32) - 1).astype(w.dtype).reshape(hf)
    return w.reshape(hf)


def expected_hf_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config calls for, with its HF shape."""
    return family.hf_tensor_shapes(cfg)


def check_names(cfg: ModelConfig, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Missing or unexpected tensors are errors naming the first one; returns the expected
    HF shapes by name."""
    expected = expected_hf_names(cfg)
    ignorable = {n for n in names if n.endswith(IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        # Some tied checkpoints still store lm_head.weight (a copy of the embedding); HF ignores it.
        ignorable |= {"lm_head.weight"} & names
    missing = sorted(set(expected) - names)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} (expected shape {expected[missing[0]]})"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    unexpected = sorted(names - set(expected) - ignorable)
    if unexpected:
        raise CheckpointError(f"unexpected tensor {unexpected[0]!r} not used by a "
                              f"{cfg.architecture} model with this config"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    return expected


def checked_getter(cfg: ModelConfig, names: set[str], get: Callable[[str], np.ndarray]):
    """(expected HF shapes, get(name) with the shape checked against the table's). A fused
    tensor is read once for each of its rows (three small reads, not worth a cache)."""
    expected = check_names(cfg, names)

    def fetch(name: str) -> np.ndarray:
        w = get(name)
        if tuple(w.shape) != expected[name]:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {expected[name]}")
        return w

    return expected, fetch


def hf_to_params(cfg: ModelConfig, names: set[str],
                 get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Read HF-named tensors through `get` into jaxserve parameter arrays.

    `names` is every tensor the checkpoint holds. Missing, unexpected or misshapen tensors are
    errors naming the tensor (and both shapes).
    """
    _, fetch = checked_getter(cfg, names, get)
    shapes = param_shapes(cfg)
    params = {}
    for p in table(cfg):
        n_lead = lead_dims(p)
        full = shapes[p.path]
        parts = [to_ours(p, fetch(n), full[n_lead:]) for n in hf_names(p, cfg)]
        params[p.path] = np.stack(parts).reshape(full) if n_lead else parts[0]
    return params


def params_to_hf(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of hf_to_params: jaxserve parameter arrays -> HF-named tensors."""
    shapes = family.hf_tensor_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for p in table(cfg):
        w = np.asarray(params[p.path])
        n_lead = lead_dims(p)
        layers = list(w.reshape((-1,) + w.shape[n_lead:])) if n_lead else [w]
        for n, wi in zip(hf_names(p, cfg), layers):
            part = to_hf(p, wi)
            if p.rows is None:
                out[n] = part
            else:
                full = out.setdefault(n, np.zeros(shapes[n], part.dtype))
                full[p.rows[0]:p.rows[0] + p.rows[1]] = part
    return out
