"""Frozen, validated configuration dataclasses.

`ModelConfig` describes a decoder's architecture: the fields every family shares, plus the
switches a family turns on (q/k norms, sandwich norms, per-layer windows, soft-capping...).
It is built from an HF `config.json` dict (`from_hf_dict`) or from GGUF metadata
(checkpoints.gguf_loader) and can write itself back as an HF dict (`to_hf_dict`) for
`jaxserve convert`. Which architectures exist, and their config keys, is the family
registry's (jaxserve/model/family.py, one module per family in jaxserve/model/families/),
imported lazily here: it is pure Python too. Nothing here touches files or jax, so every
other package can import it. The run-time configuration (LoadConfig, EngineConfig,
SchedulerConfig) is config_engine.py's, re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.config_base import ConfigError, require
# The run-time tree (what to load, the engine, the scheduler's limits) lives in config_engine.py;
# its names are re-exported so `from jaxserve.config import EngineConfig` keeps working.
from jaxserve.config_engine import (ATTENTION_IMPLS, DTYPES, KV_CACHE_DTYPES,  # noqa: F401
                                    MATMUL_IMPLS, MAX_SPECULATIVE_TOKENS, PER_CHANNEL, QUANT_IMPLS,
                                    QUANTIZE_GROUP_SIZES, QUANTIZE_MODES, SCHEDULING_POLICIES,
                                    EngineConfig, LoadConfig, QuantizeSpec, SchedulerConfig,
                                    SchedulerLimits, default_token_buckets, resolve_dtype)


def _families():
    # Lazy: the registry's modules import this one (ModelConfig), and are pure Python.
    from jaxserve.model import family
    return family

HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")

_require = require  # the name this module's checks use


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency-dependent RoPE scaling (`rope_type: "llama3"`) or linear scaling."""

    rope_type: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _require(self.rope_type in ("llama3", "linear"), "rope_scaling.rope_type",
                 f"unsupported type {self.rope_type!r}; supported: 'llama3', 'linear'")
        _require(self.factor > 0, "rope_scaling.factor", f"must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            _require(self.high_freq_factor > self.low_freq_factor, "rope_scaling.high_freq_factor",
                     "must be greater than low_freq_factor")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a registered family's name (jaxserve.model.family)
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    sliding_window: int | None = None  # Mistral; None = full causal attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Switches some families turn on (their modules in jaxserve/model/families/ set them):
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # RMSNorm on the attention and MLP outputs too (Gemma 2/3)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # Per layer "sliding_attention" (window `sliding_window`) or "full_attention"; None = every
    # layer alike (windowed iff sliding_window is set).
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None = rope_theta
    # Mixture of Experts: every layer's MLP is num_experts gated MLPs of width intermediate_size;
    # each token runs the top num_experts_per_tok by router softmax, weighted by their
    # probabilities (renormalised over the top k when moe_norm_topk: Mixtral, Qwen3-MoE's
    # norm_topk_prob). 0 = a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_norm_topk: bool = True

    def __post_init__(self):
        _require(self.architecture in _families().families(), "architecture",
                 f"unknown architecture {self.architecture!r}; supported: {sorted(_families().families())}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, name, f"must be a positive integer, got {v!r}")
        _require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                 f"{self.num_kv_heads} does not divide num_heads {self.num_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps), "rms_norm_eps",
                 f"must be a positive finite number, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None:
            _require(self.sliding_window > 0, "sliding_window", f"must be > 0, got {self.sliding_window}")
        for t in self.eos_token_ids:
            _require(0 <= t < self.vocab_size, "eos_token_ids", f"{t} outside [0, {self.vocab_size})")
        _require(self.hidden_act in HIDDEN_ACTS, "hidden_act",
                 f"unsupported activation {self.hidden_act!r}; supported: {HIDDEN_ACTS}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            v = getattr(self, name)
            _require(v is None or (v > 0 and math.isfinite(v)), name, f"must be a positive number, got {v!r}")
        if self.num_experts:
            _require(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                     f"must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
        if self.layer_types is not None:
            lt = tuple(self.layer_types)
            object.__setattr__(self, "layer_types", lt)
            _require(len(lt) == self.num_layers, "layer_types",
                     f"has {len(lt)} entries, num_layers is {self.num_layers}")
            bad = sorted(set(lt) - set(LAYER_TYPES))
            _require(not bad, "layer_types", f"unknown layer type {bad[0] if bad else ''!r}; supported: {LAYER_TYPES}")
            _require("sliding_attention" not in lt or self.sliding_window is not None, "sliding_window",
                     "layer_types has sliding layers, so sliding_window must be set")

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None = full causal attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    def kv_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV page group: one group of every layer, or, for a model mixing
        full and sliding layers (Gemma 2 / 3), its full layers then its sliding ones, each group
        with its own cache array, page pool and block tables (scheduler/window.py)."""
        w = self.layer_windows()
        full = tuple(i for i, x in enumerate(w) if x is None)
        if not full or len(full) == len(w):
            return (tuple(range(self.num_layers)),)
        return full, tuple(i for i, x in enumerate(w) if x is not None)

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (1 = MHA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in _families().param_shapes(self).values())

    # ---- HF config.json ----------------------------------------------------------------------
    # The keys every family shares are read here; the family's `from_hf` hook reads its own.

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        fam = _families().by_hf(archs, model_type)
        if fam is None:
            raise ConfigError(
                f"architecture: unsupported model (architectures={archs}, model_type={model_type!r}); "
                f"supported: {sorted(f.hf_class for f in _families().families().values())}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ConfigError(f"{key}: missing from config.json")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rs = d.get("rope_scaling") or None
        # transformers 5 folds rope_theta into rope_parameters; accept both spellings.
        rp = d.get("rope_parameters") or {}
        if "full_attention" in rp and isinstance(rp["full_attention"], dict):
            rp = rp["full_attention"]  # per-layer-type RoPE (Gemma 3): the family reads the rest
        if rs is None and rp.get("rope_type", "default") not in ("default", None):
            rs = rp
        rope_theta = d.get("rope_theta", rp.get("rope_theta", 10000.0))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        extra = fam.from_hf(d)  # first: a family refuses what it cannot run in its own words
        kw = dict(
            architecture=fam.name,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=extra.pop("rope_scaling", None) or rope_scaling_from_hf(rs),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        kw.update(extra)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        fam = _families().get(self.architecture)
        d: dict[str, Any] = {
            "architectures": [fam.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            d["rope_scaling"] = {"rope_type": rs.rope_type, "factor": rs.factor}
            if rs.rope_type == "llama3":
                d["rope_scaling"].update(
                    low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        d.update(fam.to_hf(self))
        return d


def rope_scaling_from_hf(rs: dict | None) -> RopeScaling | None:
    """config.json's rope_scaling (or rope_parameters) -> RopeScaling; None or "default" = none.
    Types this decoder does not implement (su / longrope, yarn, dynamic) are a ConfigError."""
    if not rs:
        return None
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype in (None, "default"):
        return None
    _require(rtype in ("llama3", "linear"), "rope_scaling.rope_type",
             f"unsupported type {rtype!r}; supported: 'llama3', 'linear'")
    return RopeScaling(
        rope_type=rtype, factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
