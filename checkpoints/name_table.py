"""HF tensor names <-> jaxserve parameter paths, one explicit table for the Llama family.

Llama, Mistral and Qwen2 share HF's `model.layers.{i}...` naming, so one table serves all three
(Qwen2 adds the q/k/v biases, listed only when the config has them). Each entry knows how an HF
tensor (torch Linear layout, [out, in]) maps onto our einsum-friendly layout and back:

  "same"  : identical shape                      (norms, embedding)
  "linear": ours = hf.T reshaped; `in_dims` leading dims of ours are HF's `in` side
             q_proj [N*H, D] -> wq [D, N, H] (in_dims=1);  o_proj [D, N*H] -> wo [N, H, D] (in_dims=2)
  "bias"  : [N*H] -> [N, H]

Per-layer entries are stacked along a leading layer axis by `hf_to_params`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from checkpoints.errors import CheckpointError
from jaxserve.config import ModelConfig
from jaxserve.model.llama import param_shapes


@dataclasses.dataclass(frozen=True)
class Entry:
    hf: str  # HF name; "{i}" is the layer index for per-layer entries
    path: str  # jaxserve parameter path (see jaxserve.model.llama.param_shapes)
    layout: str  # "same" | "linear" | "bias"
    in_dims: int = 1  # for "linear": how many leading dims of ours form HF's input side

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def llama_family_table(cfg: ModelConfig) -> list[Entry]:
    p = "model.layers.{i}."
    table = [
        Entry("model.embed_tokens.weight", "embed", "same"),
        Entry(p + "input_layernorm.weight", "layers.attn_norm", "same"),
        Entry(p + "self_attn.q_proj.weight", "layers.wq", "linear"),
        Entry(p + "self_attn.k_proj.weight", "layers.wk", "linear"),
        Entry(p + "self_attn.v_proj.weight", "layers.wv", "linear"),
        Entry(p + "self_attn.o_proj.weight", "layers.wo", "linear", in_dims=2),
        Entry(p + "post_attention_layernorm.weight", "layers.mlp_norm", "same"),
        Entry(p + "mlp.gate_proj.weight", "layers.w_gate", "linear"),
        Entry(p + "mlp.up_proj.weight", "layers.w_up", "linear"),
        Entry(p + "mlp.down_proj.weight", "layers.w_down", "linear"),
        Entry("model.norm.weight", "final_norm", "same"),
    ]
    if cfg.attention_bias:
        table += [Entry(p + f"self_attn.{x}_proj.bias", f"layers.b{x}", "bias") for x in "qkv"]
    if not cfg.tie_word_embeddings:
        table.append(Entry("lm_head.weight", "lm_head", "linear"))
    return table


# Tensors some checkpoints carry that the model does not need (recomputed or tied), by suffix.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_shape(entry: Entry, ours: tuple[int, ...]) -> tuple[int, ...]:
    if entry.layout == "same":
        return ours
    if entry.layout == "bias":
        return (math.prod(ours),)
    return (math.prod(ours[entry.in_dims:]), math.prod(ours[:entry.in_dims]))


def _to_ours(entry: Entry, w: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    if entry.layout == "linear":
        return np.ascontiguousarray(w.T).reshape(ours)
    return w.reshape(ours)


def _to_hf(entry: Entry, w: np.ndarray) -> np.ndarray:
    hf = _hf_shape(entry, w.shape)
    if entry.layout == "linear":
        return np.ascontiguousarray(w.reshape(hf[::-1]).T)
    return w.reshape(hf)


def expected_hf_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config calls for, with its HF shape."""
    shapes = param_shapes(cfg)
    out = {}
    for e in llama_family_table(cfg):
        ours = shapes[e.path]
        if e.per_layer:
            for i in range(cfg.num_layers):
                out[e.hf.format(i=i)] = _hf_shape(e, ours[1:])
        else:
            out[e.hf] = _hf_shape(e, ours)
    return out


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


def hf_to_params(cfg: ModelConfig, names: set[str],
                 get: Callable[[str], np.ndarray]) -> dict[str, np.ndarray]:
    """Read HF-named tensors through `get` into jaxserve parameter arrays.

    `names` is every tensor the checkpoint holds. Missing, unexpected or misshapen tensors are
    errors naming the tensor (and both shapes).
    """
    expected = check_names(cfg, names)

    def fetch(name: str, entry: Entry, ours: tuple[int, ...]) -> np.ndarray:
        w = get(name)
        if tuple(w.shape) != expected[name]:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {expected[name]}")
        return _to_ours(entry, w, ours)

    shapes = param_shapes(cfg)
    params = {}
    for e in llama_family_table(cfg):
        ours = shapes[e.path]
        if e.per_layer:
            params[e.path] = np.stack([fetch(e.hf.format(i=i), e, ours[1:])
                                       for i in range(cfg.num_layers)])
        else:
            params[e.path] = fetch(e.hf, e, ours)
    return params


def params_to_hf(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of hf_to_params: jaxserve parameter arrays -> HF-named tensors."""
    out = {}
    for e in llama_family_table(cfg):
        w = params[e.path]
        if e.per_layer:
            for i in range(cfg.num_layers):
                out[e.hf.format(i=i)] = _to_hf(e, w[i])
        else:
            out[e.hf] = _to_hf(e, w)
    return out
