"""Frozen, validated configuration dataclasses.

`ModelConfig` describes a decoder's architecture: the fields every family shares, plus the
switches a family turns on (q/k norms, sandwich norms, per-layer windows, soft-capping...).
It is built from an HF `config.json` dict (`from_hf_dict`) or from GGUF metadata
(checkpoints.gguf_loader) and can write itself back as an HF dict (`to_hf_dict`) for
`jaxserve convert`. Which architectures exist, and their config keys, is the family
registry's (jaxserve/model/family.py, one module per family in jaxserve/model/families/),
imported lazily here: it is pure Python too. Nothing here touches files or jax, so every
other package can import it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def _families():
    # Lazy: the registry's modules import this one (ModelConfig), and are pure Python.
    from jaxserve.model import family
    return family

DTYPES = ("float32", "bfloat16")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")
# --quantize (checkpoints/quantize.py does the work; here so parsers can list them without jax).
# "none" keeps float weights (a GGUF is dequantized to the model dtype); "as-shipped" keeps a
# GGUF's own Q8_0 / Q4_0 / Q4_1 blocks, repacked.
QUANTIZE_MODES = ("none", "int8", "int4", "as-shipped")
QUANTIZE_GROUP_SIZES = (128, 64, 32)  # offered group sizes, in preference order for int8's default


class ConfigError(ValueError):
    """A configuration value is missing or outside its allowed range."""


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


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


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the paged-KV continuous-batching scheduler (jaxserve.scheduler).

    `num_pages` counts every KV page including the reserved null page 0, so `num_pages - 1`
    pages can hold tokens. `max_prompt_len` / `max_output_len` default to `max_model_len`.
    """

    num_pages: int
    max_model_len: int
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    max_preemptions_per_request: int = 4
    # Speculative decoding by n-gram lookup (speculation.py): up to this many draft tokens per
    # greedy decode, found by matching the sequence's last `ngram_max` .. `ngram_min` tokens
    # against its earlier tokens. 0 = off.
    num_speculative_tokens: int = 0
    ngram_max: int = 3
    ngram_min: int = 1
    # Each sequence's draft length adapted to its recent acceptance (speculation.DraftControl):
    # drafts shrink, then pause, where they keep failing. False: always up to the full length.
    adaptive_speculation: bool = True
    # Automatic prefix caching (scheduler/prefix_cache.py): full KV pages are kept and matched
    # by content hash across requests. False: only a request's n samples share pages.
    enable_prefix_caching: bool = True
    # Scheduling policy (scheduler/policy.py): "fcfs" (arrival order; request priorities are
    # ignored) or "priority" (lower value first, as vLLM; a waiting request that cannot be
    # admitted preempts lower-priority running ones). `priority_aging_rate` (priority levels
    # per scheduler step a request has existed) bounds how long a low priority can wait.
    scheduling_policy: str = "fcfs"
    priority_aging_rate: float = 0.0
    # Tenant fair sharing: admission picks the active tenant that got the fewest step tokens
    # per unit of weight (tenant_weights: (tenant, weight) pairs; others weigh 1).
    fair_share: bool = False
    tenant_weights: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                 f"must be True or False, got {self.enable_prefix_caching!r}")
        _check_policy(self.scheduling_policy, self.priority_aging_rate, self.fair_share,
                      self.tenant_weights)
        object.__setattr__(self, "tenant_weights", tuple(tuple(p) for p in self.tenant_weights))
        for name in ("num_pages", "max_model_len", "page_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                     f"must be a positive integer, got {v!r}")
        _require(self.num_pages >= 2, "num_pages",
                 f"must be >= 2 (page 0 is the reserved null page), got {self.num_pages}")
        # Every running decode needs one token of the step's budget; with fewer tokens than
        # sequence slots the lowest-priority decodes would stall behind the others.
        _require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                 f"must be >= max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}")
        for name in ("max_prompt_len", "max_output_len"):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, self.max_model_len)
                continue
            _require(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= self.max_model_len,
                     name, f"must be an integer in [1, max_model_len={self.max_model_len}], got {v!r}")
        v = self.max_preemptions_per_request
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                 "max_preemptions_per_request", f"must be a non-negative integer, got {v!r}")
        _check_speculation(self.num_speculative_tokens, self.ngram_max, self.ngram_min)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can hold tokens (all but the null page)."""
        return self.num_pages - 1


SCHEDULING_POLICIES = ("fcfs", "priority")


def _check_policy(policy, aging_rate, fair_share, tenant_weights) -> None:
    _require(policy in SCHEDULING_POLICIES, "scheduling_policy",
             f"must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    _require(isinstance(aging_rate, (int, float)) and not isinstance(aging_rate, bool)
             and 0 <= aging_rate < float("inf"), "priority_aging_rate",
             f"must be a finite number >= 0, got {aging_rate!r}")
    _require(aging_rate == 0 or policy == "priority", "priority_aging_rate",
             f"needs scheduling_policy='priority' (got {policy!r})")
    _require(isinstance(fair_share, bool), "fair_share", f"must be True or False, got {fair_share!r}")
    for pair in tenant_weights:
        ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
              and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool) and 0 < pair[1] < float("inf"))
        _require(ok, "tenant_weights", f"must be (tenant, weight > 0) pairs, got {pair!r:.80}")


MAX_SPECULATIVE_TOKENS = 8  # each draft token widens every decode row's attention work


def _check_speculation(num_speculative_tokens, ngram_max, ngram_min) -> None:
    v = num_speculative_tokens
    _require(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_SPECULATIVE_TOKENS,
             "num_speculative_tokens", f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {v!r}")
    for name, v in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name,
                 f"must be a positive integer, got {v!r}")
    _require(ngram_min <= ngram_max, "ngram_min", f"must be <= ngram_max ({ngram_max}), got {ngram_min}")


KV_CACHE_DTYPES = ("auto", "int8")
_INT8_SCALE_BYTES = 2  # pallas_kernels.kv_cache.SCALE_DTYPE is bf16 (a test keeps them in step)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from 1, plus the 3/4 points from 24 on (a step of 300 tokens pads to 384,
    not 512), capped by and always including the step's token budget."""
    out, b = {max_num_batched_tokens}, 1
    while b // 2 < max_num_batched_tokens:
        out.add(b)
        if b >= 32:
            out.add(b * 3 // 4)
        b *= 2
    return tuple(sorted(x for x in out if x <= max_num_batched_tokens))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the paged engine needs besides the model. None = derived from the model."""

    max_model_len: int | None = None  # default: the model's context length
    page_size: int = 16
    num_pages: int | None = None  # KV pages incl. the null page; default: from kv_cache_bytes
    kv_cache_bytes: int = 512 * 2**20  # KV pool size when num_pages is not given
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    max_preemptions_per_request: int = 4
    token_buckets: tuple[int, ...] | None = None  # tokens per step; default_token_buckets()
    kv_chunk_pages: int = 16  # pages per step of the attention reference's KV loop
    attention_impl: str = "auto"  # sharding.ops.ATTENTION_IMPLS; "pallas_*_interpret" = kernels on CPU
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "int8" = int8 values + bf16 scales
    seed: int | None = None  # base of the seeds of requests that bring none; None = random
    tp: int = 1  # tensor-parallel degree: devices one engine's model and KV cache are split over
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"  # None = no persistent cache
    # Speculative decoding by n-gram (prompt) lookup, for greedy requests; see SchedulerConfig.
    num_speculative_tokens: int = 0
    ngram_max: int = 3
    ngram_min: int = 1
    adaptive_speculation: bool = True  # per-sequence draft length from recent acceptance
    # Automatic prefix caching: reuse the KV pages of prompt prefixes seen before (requests
    # with different cache_salt never share); False = recompute every prompt.
    enable_prefix_caching: bool = True
    # Scheduling policy, aging and tenant fair sharing; see SchedulerConfig.
    scheduling_policy: str = "fcfs"
    priority_aging_rate: float = 0.0
    fair_share: bool = False
    tenant_weights: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                 f"must be True or False, got {self.enable_prefix_caching!r}")
        _check_policy(self.scheduling_policy, self.priority_aging_rate, self.fair_share,
                      self.tenant_weights)
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes",
                     "kv_chunk_pages", "tp"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                     f"must be a positive integer, got {v!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.token_buckets is not None:
            b = tuple(self.token_buckets)
            object.__setattr__(self, "token_buckets", b)
            _require(len(b) > 0 and all(isinstance(x, int) and x > 0 for x in b) and list(b) == sorted(set(b)),
                     "token_buckets", f"must be a sorted list of distinct positive integers, got {b}")
            _require(b[-1] >= self.max_num_batched_tokens, "token_buckets",
                     f"the largest bucket ({b[-1]}) must be >= max_num_batched_tokens "
                     f"({self.max_num_batched_tokens})")
        _check_speculation(self.num_speculative_tokens, self.ngram_max, self.ngram_min)

    def buckets(self) -> tuple[int, ...]:
        return self.token_buckets or default_token_buckets(self.max_num_batched_tokens)

    def kv_bytes_per_page(self, model: ModelConfig, itemsize: int) -> int:
        """K and V bytes of one page over all layers; `itemsize` is the model dtype's. int8 pages
        hold 1 byte per element plus a bf16 scale per token and KV head (kv_cache.py)."""
        per_token_head = (model.head_dim + _INT8_SCALE_BYTES if self.kv_cache_dtype == "int8"
                          else model.head_dim * itemsize)
        return 2 * model.num_layers * self.page_size * model.num_kv_heads * per_token_head

    def scheduler_config(self, model: ModelConfig, itemsize: int) -> SchedulerConfig:
        max_len = self.max_model_len or model.max_position_embeddings
        _require(max_len <= model.max_position_embeddings, "max_model_len",
                 f"{max_len} exceeds the model's context of {model.max_position_embeddings}")
        pages = self.num_pages or max(2, self.kv_cache_bytes // self.kv_bytes_per_page(model, itemsize))
        return SchedulerConfig(
            num_pages=pages, max_model_len=max_len, page_size=self.page_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_prompt_len=self.max_prompt_len, max_output_len=self.max_output_len,
            max_preemptions_per_request=self.max_preemptions_per_request,
            num_speculative_tokens=self.num_speculative_tokens, ngram_max=self.ngram_max,
            ngram_min=self.ngram_min, adaptive_speculation=self.adaptive_speculation,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy, priority_aging_rate=self.priority_aging_rate,
            fair_share=self.fair_share, tenant_weights=self.tenant_weights)
