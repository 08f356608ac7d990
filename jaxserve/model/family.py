"""Model families: one parameter table per family, and the registry that finds a family by its
HF `model_type` / class name or its GGUF `general.architecture`.

A family is one module in jaxserve/model/families/ that registers a `Family`: its names, the
hooks that read its config.json / GGUF metadata into a `ModelConfig`, and `params(cfg)`, the
parameter table. Everything else is derived from that table, here, once:

  param_shapes(cfg)   path -> shape                     (the model builds itself from it)
  param_axes(cfg)     path -> logical axes              (sharding/rules.py maps them to the mesh)
  quantizable(cfg)    path -> in_axes                   (what --quantize / as-shipped may replace)
  hf names / gguf names per tensor                      (checkpoints/name_table.py, gguf_loader.py)

A table row (`Param`) names a parameter path, its dims as letters of the einsum legend
(jaxserve/model/layers.py: L D F N K H V), its logical axes, its HF and GGUF tensor names
("{i}" = layer index) and how the HF tensor (torch Linear layout, [out, in]) maps onto ours:

  "same"   identical shape                       (embedding, norms)
  "linear" ours = hf.T reshaped; our leading `in_dims` dims are HF's input side
           q_proj [N*H, D] -> wq [D, N, H] (in_dims=1);  o_proj [D, N*H] -> wo [N, H, D] (in_dims=2)
  "bias"   [N*H] -> [N, H]
  "norm1"  HF stores w, the model (and llama.cpp's GGUF) 1 + w: Gemma's RMSNorm scales by (1 + w)
`rows` = (offset, count) takes a row range of a fused HF tensor (Phi-3's qkv_proj, gate_up_proj).

Pure Python (stdlib + jaxserve.config): the config parser and the checkpoint loaders use it
without importing jax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jaxserve.config import ModelConfig

LAYOUTS = ("same", "linear", "bias", "norm1")


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # "embed", "layers.wq", ...; "layers.*" are stacked on a leading L axis
    dims: str  # letters of the einsum legend, e.g. "LDNH"
    axes: tuple[str | None, ...]  # logical axes, one per dim
    hf: str  # HF tensor name; "{i}" = layer index
    gguf: str | None  # GGUF tensor name ("{i}" = block index); None = not in GGUF files
    layout: str = "same"
    in_dims: int = 1  # "linear": how many leading dims of ours (after L) are HF's input side
    init: str = "normal"  # random init of a fresh model: "normal", "ones" or "zeros"
    rows: tuple[int, int] | None = None  # (offset, count) rows of a fused HF tensor
    expert: bool = False  # dims "LE...": one HF tensor per (layer {i}, expert {e}) (MoE)
    quantize: bool = True  # a "linear" row --quantize may replace (False: the MoE router)

    def __post_init__(self):
        assert self.layout in LAYOUTS, self.layout
        assert len(self.dims) == len(self.axes), (self.path, self.dims, self.axes)

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("layers.")

    @property
    def in_axes(self) -> tuple[int, ...] | None:
        """Axes of one matrix (the per-layer shape) the model contracts, for quantizable rows."""
        return tuple(range(self.in_dims)) if self.layout == "linear" else None


def dim_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"L": cfg.num_layers, "D": cfg.hidden_size, "F": cfg.intermediate_size,
            "N": cfg.num_heads, "K": cfg.num_kv_heads, "H": cfg.head_dim, "V": cfg.vocab_size,
            "E": cfg.num_experts}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture and HF model_type
    hf_class: str  # HF architectures[0], written by `jaxserve convert`
    params: Callable[[ModelConfig], list[Param]]
    gguf_arch: str | None = None  # GGUF general.architecture
    # config.json -> family-specific ModelConfig fields (the common ones are read generically)
    from_hf: Callable[[dict], dict] = lambda d: {}
    # ModelConfig -> family-specific config.json keys
    to_hf: Callable[[ModelConfig], dict] = lambda cfg: {}
    # GGUF metadata getter meta(key, default) -> family-specific ModelConfig fields
    from_gguf: Callable[[Callable[..., Any]], dict] = lambda meta: {}
    gguf_permuted_qk: bool = False  # llama.cpp permutes q/k rows for interleaved RoPE
    hf_model_types: tuple[str, ...] = ()  # further model_type spellings that load as this family


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    assert family.name not in _REGISTRY, family.name
    _REGISTRY[family.name] = family
    return family


def _load_all() -> None:
    import jaxserve.model.families  # noqa: F401  (each module registers its family)


def families() -> dict[str, Family]:
    _load_all()
    return dict(_REGISTRY)


def get(name: str) -> Family:
    _load_all()
    if name not in _REGISTRY:
        raise KeyError(f"unknown architecture {name!r}; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def by_hf(architectures: list[str], model_type: str | None) -> Family | None:
    _load_all()
    for a in architectures:
        for f in _REGISTRY.values():
            if f.hf_class == a:
                return f
    for f in _REGISTRY.values():
        if model_type == f.name or model_type in f.hf_model_types:
            return f
    return None


def by_gguf(arch: str) -> Family | None:
    _load_all()
    return next((f for f in _REGISTRY.values() if f.gguf_arch == arch), None)


# ---- derived from the table ----------------------------------------------------------------

def table(cfg: ModelConfig) -> list[Param]:
    return get(cfg.architecture).params(cfg)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by its flat path. The checkpoint loaders map onto these paths."""
    size = dim_sizes(cfg)
    out = {}
    for p in table(cfg):
        if p.path not in out:
            out[p.path] = tuple(size[c] for c in p.dims)
    return out


def param_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of every parameter, by path; sharding/rules.py maps them to mesh axes."""
    return {p.path: p.axes for p in table(cfg)}


def quantizable(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Path -> in_axes of every parameter that may be a QuantizedWeight: the linear rows (MoE
    experts included: stacked [L, E, N, .], read as stored by layers.moe_mlp's grouped matmul), and the
    embedding, whose [V, D] table is read row-wise by the lookup and as the tied head."""
    out = {p.path: p.in_axes for p in table(cfg) if p.layout == "linear" and p.quantize}
    out["embed"] = (1,)
    return out


def hf_names(p: Param, cfg: ModelConfig) -> list[str]:
    """The HF tensors of one row, in stacking order (layer-major, then expert)."""
    if p.expert:
        return [p.hf.format(i=i, e=e) for i in range(cfg.num_layers) for e in range(cfg.num_experts)]
    return [p.hf.format(i=i) for i in range(cfg.num_layers)] if p.per_layer else [p.hf]


def lead_dims(p: Param) -> int:
    """Stacked leading dims of a row's array: 0, 1 (layers) or 2 (layers, experts)."""
    return 2 if p.expert else (1 if p.per_layer else 0)


def hf_shape(p: Param, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The HF shape of one (layer's) part; for a fused tensor, of this part's rows."""
    if p.layout in ("same", "norm1"):
        return ours
    if p.layout == "bias":
        return (math.prod(ours),)
    return (math.prod(ours[p.in_dims:]), math.prod(ours[:p.in_dims]))


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config calls for, with its HF shape (a fused tensor whole)."""
    shapes = param_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for p in table(cfg):
        ours = shapes[p.path][lead_dims(p):]
        shape = hf_shape(p, ours)
        for n in hf_names(p, cfg):
            if p.rows is None:
                out[n] = shape
            else:  # fused: rows add up over the parts
                prev = out.get(n, (0,) + shape[1:])
                out[n] = (max(prev[0], p.rows[0] + p.rows[1]),) + shape[1:]
    return out


def gguf_to_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name, for every tensor of the table that GGUF files hold,
    MoE experts aside (gguf_expert_names)."""
    out = {}
    for p in table(cfg):
        if p.gguf is None or p.expert:
            continue
        if p.per_layer:
            for i in range(cfg.num_layers):
                out[p.gguf.format(i=i)] = p.hf.format(i=i)
        else:
            out[p.gguf] = p.hf
    return out


def gguf_expert_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """GGUF tensor name -> the HF tensors of its experts, in expert order: llama.cpp fuses a
    layer's experts into one 3-D tensor (ffn_gate_exps [E, F, D] ...), HF keeps one per expert."""
    return {p.gguf.format(i=i): [p.hf.format(i=i, e=e) for e in range(cfg.num_experts)]
            for p in table(cfg) if p.expert and p.gguf is not None for i in range(cfg.num_layers)}
