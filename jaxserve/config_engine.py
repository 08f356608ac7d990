"""The run-time configuration tree, declared once: what to load (`LoadConfig`), how the engine
runs it (`EngineConfig`, with the scheduler's limits nested as `SchedulerLimits`), and the
scheduler's own view (`SchedulerConfig` = those limits + the pool size and context length the
engine derives). The server's settings are jaxserve/server/config.py's `ServerConfig`.

Every field is declared with `option()` (config_base.py): its default, help text, allowed
values and, where vLLM has the same knob, vLLM's flag name as an alias. jaxserve/flags.py makes
every entry point's flags from these declarations, so nothing here is typed twice. Every check,
cross-field ones included, runs in `__post_init__`, i.e. when the flags are parsed, before any
model is loaded; each fails in one line naming the field.

The implementation names (ATTENTION_IMPLS, QUANT_IMPLS) are declared here as plain tuples so a
parser can offer them without importing jax; the backend tables in sharding/ must hold the same
names (tests/test_config_flags.py checks). Standard library only (import-linter contract).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxserve.config_base import ConfigError, is_int, option, require, require_positive_int

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig

DTYPES = ("float32", "bfloat16")
# --quantize (checkpoints/quantize.py does the work). "none" keeps float weights (a GGUF is
# dequantized to the model dtype); "as-shipped" keeps a GGUF's own Q8_0 / Q4_0 / Q4_1 blocks.
QUANTIZE_MODES = ("none", "int8", "int4", "as-shipped")
QUANTIZE_GROUP_SIZES = (128, 64, 32)  # offered group sizes, in preference order for int8's default
PER_CHANNEL = 0  # int8 group size meaning one scale per output row
QUANT_IMPLS = ("xla", "ref", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")
# sharding/float_matmul.py MATMUL_IMPLS (tests/test_backends.py holds them equal)
MATMUL_IMPLS = ("xla", "cpu_native", "cpu_native_packed")
ATTENTION_IMPLS = ("xla", "xla_reference", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret",
                   "pallas_gpu_interpret", "cpu_native")
KV_CACHE_DTYPES = ("auto", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
MAX_SPECULATIVE_TOKENS = 8  # each draft token widens every decode row's attention work
_INT8_SCALE_BYTES = 2  # pallas_kernels.kv_cache.SCALE_DTYPE is bf16 (a test keeps them in step)


def resolve_dtype(dtype: str, platform: str) -> str:
    """--dtype auto: bfloat16 on accelerators (their matmul units and HBM bandwidth are built
    for it, as vLLM and MaxText default), float32 on CPU (no fast bf16 there, and what the
    goldens compare against)."""
    if dtype != "auto":
        return dtype
    return "float32" if platform == "cpu" else "bfloat16"


# ---- parsers for flag values (they raise ValueError; argparse turns it into one line) -----

def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r:.80}") from None


def parse_tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, w = part.rpartition("=")
        try:
            out.append((name, float(w)))
        except ValueError:
            sep = ""
        if not sep or not name:
            raise ValueError(f"expected TENANT=WEIGHT[,...], got {part!r:.80}")
    return tuple(out)


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '4GiB', '1.5G' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgib")
    try:
        return int(float(num) * _UNITS[t[len(num):]])
    except (ValueError, KeyError):
        raise ValueError(f"expected a byte count such as 536870912, 512MiB or 4GiB, got {text!r:.80}") from None


def parse_optional_path(text: str) -> str | None:
    return None if text.strip().lower() in ("", "none") else text


# ---- what to load --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QuantizeSpec:
    """What `quantize` asked for. group_size: None = the default (int4: 32; int8: the largest
    of 128 / 64 / 32 dividing the model's input widths); 32 / 64 / 128; or, for int8,
    PER_CHANNEL."""

    mode: str = "none"
    group_size: int | None = None

    def __post_init__(self):
        require(self.mode in QUANTIZE_MODES, "quantize",
                f"{self.mode!r} is not supported; choose one of {QUANTIZE_MODES}")
        G = self.group_size
        if G is not None:
            require(self.mode not in ("none", "as-shipped"), "quantize_group_size",
                    f"a group size applies to int8/int4 only, not quantize={self.mode!r}")
            allowed = QUANTIZE_GROUP_SIZES + ((PER_CHANNEL,) if self.mode == "int8" else ())
            require(G in allowed, "quantize_group_size",
                    f"{self.mode} group size {G} not in {sorted(allowed)}"
                    + (" (0 = per channel)" if self.mode == "int8" else ""))


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """Which weights, in which dtype and format (jaxserve/loading.py)."""

    model: str | None = option(None, "HF checkpoint folder, .gguf file or Orbax folder from `jaxserve "
                               "convert --to orbax` (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = option("auto", "activations and float weights: auto = bfloat16 on TPU/GPU, float32 "
                        "on CPU", choices=("auto",) + DTYPES)
    quantize: str = option("none", "weight format: none = float in dtype (a GGUF is dequantized); int8 / "
                           "int4 = round to nearest at load; as-shipped = a GGUF's own Q8_0/Q4_0/Q4_1 "
                           "blocks, repacked (GGUF only)", choices=QUANTIZE_MODES, aliases=("--quantization",))
    quantize_group_size: int | None = option(
        None, f"inputs per scale for int8/int4: one of {list(QUANTIZE_GROUP_SIZES)}, or 0 for int8 per "
              f"channel (default: int4 32, int8 the largest dividing every input width)", metavar="G")
    quant_impl: str = option("auto", "quantized matmul implementation: auto (TPU pallas_tpu, GPU "
                             "pallas_gpu, CPU xla) or one of these", choices=("auto",) + QUANT_IMPLS)
    matmul_impl: str = option("auto", "float projections and untied LM head: auto (CPU with fp32 weights on "
                              "one device: cpu_native_packed, else xla), xla, cpu_native_packed (the C++ small-M "
                              "fp32 kernel with W packed at load, for steps of at most 64 rows), or cpu_native "
                              "(the same kernel on unpacked W: slower, kept to compare)",
                              choices=("auto",) + MATMUL_IMPLS)
    speculative_model: str | None = option(
        None, "a draft model for speculative decoding (a checkpoint as --model; it must share the target's "
              "tokenizer), with its own KV cache on the target's pages; with only --speculative-quantize, the "
              "target's own checkpoint", metavar="PATH")
    speculative_quantize: str = option("none", "the draft model's weight format, as --quantize (as-shipped: a "
                                       "GGUF's own 4/8-bit blocks)", choices=QUANTIZE_MODES)

    @property
    def wants_draft_model(self) -> bool:
        return self.speculative_model is not None or self.speculative_quantize != "none"

    def __post_init__(self):
        require(self.speculative_quantize in QUANTIZE_MODES, "speculative_quantize",
                f"{self.speculative_quantize!r} is not one of {QUANTIZE_MODES}")
        require(self.dtype in ("auto",) + DTYPES, "dtype",
                f"{self.dtype!r} is not supported; choose one of {('auto',) + DTYPES}")
        require(self.quant_impl in ("auto",) + QUANT_IMPLS, "quant_impl",
                f"{self.quant_impl!r} is not one of {('auto',) + QUANT_IMPLS}")
        require(self.matmul_impl in ("auto",) + MATMUL_IMPLS, "matmul_impl",
                f"{self.matmul_impl!r} is not one of {('auto',) + MATMUL_IMPLS}")
        self.spec  # noqa: B018 (checks quantize and its group size)

    @property
    def spec(self) -> QuantizeSpec:
        return QuantizeSpec(self.quantize, self.quantize_group_size)


# ---- the scheduler's limits ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerLimits:
    """The scheduler's knobs a user sets; nested in EngineConfig, extended by SchedulerConfig."""

    page_size: int = option(16, "tokens per KV page", aliases=("--block-size",))
    max_num_seqs: int = option(64, "sequences (samples) running at once: the decode batch")
    max_num_batched_tokens: int = option(512, "tokens per engine step (the prefill chunk budget); "
                                         "must be >= max_num_seqs")
    max_prompt_len: int | None = option(None, "longest prompt in tokens (default: max_model_len)")
    max_output_len: int | None = option(None, "largest max_tokens (default: max_model_len)")
    max_preemptions_per_request: int = option(4, "a request preempted this often fails instead of "
                                              "being preempted again")
    num_speculative_tokens: int = option(0, "speculative decoding: up to this many draft tokens per "
                                         "decode (0 = off); n-gram lookup unless speculative_layers is set")
    speculative_layers: int = option(0, "draft with the target's own first N layers (self-speculation: "
                                     "their KV is the target's) instead of n-gram lookup; 0 = n-gram",
                                     metavar="N")
    ngram_max: int = option(3, "longest n-gram matched for drafts")
    ngram_min: int = option(1, "shortest n-gram matched for drafts")
    adaptive_speculation: bool = option(True, "adapt each sequence's draft length to its recent acceptance")
    enable_prefix_caching: bool = option(True, "reuse the KV pages of prompt prefixes seen before (each "
                                         "tenant / cache_salt has its own namespace)")
    scheduling_policy: str = option("fcfs", "fcfs: arrival order (request priority ignored); priority: "
                                    "lower value first, preempting lower-priority running requests",
                                    choices=SCHEDULING_POLICIES)
    priority_aging_rate: float = option(0.0, "with scheduling_policy priority: priority levels a request "
                                        "gains per step it has waited", metavar="LEVELS_PER_STEP")
    fair_share: bool = option(False, "share step tokens fairly between tenants instead of arrival order")
    tenant_weights: tuple[tuple[str, float], ...] = option(
        (), "fair-share weights (tenant ids as the server logs them; others weigh 1)",
        parse=parse_tenant_weights, metavar="TENANT=W,...")

    def __post_init__(self):
        require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
                f"must be True or False, got {self.enable_prefix_caching!r}")
        _check_policy(self.scheduling_policy, self.priority_aging_rate, self.fair_share, self.tenant_weights)
        object.__setattr__(self, "tenant_weights", tuple(tuple(p) for p in self.tenant_weights))
        require_positive_int(self, "page_size", "max_num_seqs", "max_num_batched_tokens")
        # Every running decode needs one token of the step's budget; with fewer tokens than
        # sequence slots the lowest-priority decodes would stall behind the others.
        require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}")
        for name in ("max_prompt_len", "max_output_len"):
            v = getattr(self, name)
            require(v is None or (is_int(v) and v >= 1), name, f"must be a positive integer, got {v!r}")
        v = self.max_preemptions_per_request
        require(is_int(v) and v >= 0, "max_preemptions_per_request", f"must be a non-negative integer, got {v!r}")
        _check_speculation(self.num_speculative_tokens, self.ngram_max, self.ngram_min)
        v = self.speculative_layers
        require(is_int(v) and v >= 0, "speculative_layers", f"must be a non-negative integer, got {v!r}")
        require(v == 0 or self.num_speculative_tokens > 0, "speculative_layers",
                f"drafts up to num_speculative_tokens tokens: set it > 0 (got {self.num_speculative_tokens})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerLimits):
    """The limits plus what the engine derives from the model and the memory: `num_pages`
    counts every KV page including the reserved null page 0, so `num_pages - 1` pages can hold
    tokens. `max_prompt_len` / `max_output_len` default to `max_model_len`."""

    num_pages: int
    max_model_len: int
    # A second KV page group for the sliding layers of a model mixing full and sliding layers
    # (ModelConfig.kv_groups): its window and its own pool's pages (null page included); then
    # `num_pages` is the full layers' pool. None / 0: one group.
    sliding_window: int | None = None
    num_sliding_pages: int = 0
    # A draft model of its own (Engine(draft_model=...)) fills the draft slots in the step, so
    # the scheduler plans them as placeholders (speculation.plan_drafts).
    model_drafts: bool = False

    def __post_init__(self):
        super().__post_init__()
        require_positive_int(self, "num_pages", "max_model_len")
        require(self.num_pages >= 2, "num_pages",
                f"must be >= 2 (page 0 is the reserved null page), got {self.num_pages}")
        if self.sliding_window is None:
            require(self.num_sliding_pages == 0, "num_sliding_pages", "needs sliding_window")
        else:
            require_positive_int(self, "sliding_window")
            require(is_int(self.num_sliding_pages) and self.num_sliding_pages >= 2, "num_sliding_pages",
                    f"must be >= 2 (page 0 is the reserved null page), got {self.num_sliding_pages!r}")
        for name in ("max_prompt_len", "max_output_len"):
            v = getattr(self, name)
            if v is None:
                object.__setattr__(self, name, self.max_model_len)
                continue
            require(v <= self.max_model_len, name,
                    f"must be an integer in [1, max_model_len={self.max_model_len}], got {v!r}")

    @property
    def drafts_from_model(self) -> bool:
        """A draft model (self-speculation or one of its own) fills the draft slots in the step."""
        return bool(self.speculative_layers or self.model_drafts)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can hold tokens (all but the null page)."""
        return self.num_pages - 1


def _check_policy(policy, aging_rate, fair_share, tenant_weights) -> None:
    require(policy in SCHEDULING_POLICIES, "scheduling_policy",
            f"must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    require(isinstance(aging_rate, (int, float)) and not isinstance(aging_rate, bool)
            and 0 <= aging_rate < float("inf"), "priority_aging_rate",
            f"must be a finite number >= 0, got {aging_rate!r}")
    require(aging_rate == 0 or policy == "priority", "priority_aging_rate",
            f"needs scheduling_policy='priority' (got {policy!r})")
    require(isinstance(fair_share, bool), "fair_share", f"must be True or False, got {fair_share!r}")
    for pair in tenant_weights:
        ok = (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
              and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool) and 0 < pair[1] < float("inf"))
        require(ok, "tenant_weights", f"must be (tenant, weight > 0) pairs, got {pair!r:.80}")


def _check_speculation(num_speculative_tokens, ngram_max, ngram_min) -> None:
    v = num_speculative_tokens
    require(is_int(v) and 0 <= v <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
            f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {v!r}")
    for name, v in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
        require(is_int(v) and v >= 1, name, f"must be a positive integer, got {v!r}")
    require(ngram_min <= ngram_max, "ngram_min", f"must be <= ngram_max ({ngram_max}), got {ngram_min}")


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


# ---- the engine ------------------------------------------------------------------------------

LIMIT_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerLimits))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the paged engine needs besides the model. None = derived from the model or
    the device. The scheduler's limits are the nested `scheduler`; for vLLM-style flat use they
    are also accepted as keywords (EngineConfig(max_num_seqs=8)) and read as attributes
    (config.max_num_seqs), both meaning config.scheduler's."""

    max_model_len: int | None = option(None, "longest sequence, prompt + output (default: the model's "
                                       "context length)")
    num_pages: int | None = option(None, "KV pages incl. the null page (default: from kv_cache_bytes)")
    kv_cache_bytes: int | None = option(
        None, "KV pool size when num_pages is not given, e.g. 512MiB or 4GiB (default: on CPU 512MiB; on "
              "TPU/GPU gpu_memory_utilization of device memory minus weights and activations)",
        parse=parse_bytes, aliases=("--kv-cache-memory-bytes",), metavar="BYTES",
        unit_aliases=(("--kv-cache-mb", 2**20),))
    gpu_memory_utilization: float = option(
        0.9, "on TPU/GPU: the fraction of device memory the engine may use (weights, activations and "
             "the KV pool sized from what is left); ignored when kv_cache_bytes or num_pages is given")
    token_buckets: tuple[int, ...] | None = option(None, "tokens per step compiled, comma-separated "
                                                   "(default: powers of two and their 3/4 points)",
                                                   parse=parse_ints, metavar="1,8,64,512")
    kv_chunk_pages: int = option(16, "pages per step of the attention reference's KV loop")
    attention_impl: str = option("auto", "paged attention kernel: auto by backend, or one of these "
                                 "('*_interpret' runs a kernel on CPU)", choices=("auto",) + ATTENTION_IMPLS)
    kv_cache_dtype: str = option("auto", "auto = the model dtype; int8 = int8 values + bf16 scales",
                                 choices=KV_CACHE_DTYPES)
    host_huge_pages: bool = option(True, "on CPU: keep weights and KV cache on 4 KiB pages (default: ask Linux "
                                   "for 2 MiB pages, jaxserve/huge_pages.py)", flag="--no-host-huge-pages",
                                   negate=True)
    host_reuse_step_memory: bool = option(True, "on CPU: let glibc map each step's temporaries afresh (default: "
                                          "keep them mapped between steps, jaxserve/host_malloc.py)",
                                          flag="--no-host-reuse-step-memory", negate=True)
    seed: int | None = option(None, "base of the seeds of requests that bring none (default: random)")
    tp: int = option(1, "tensor-parallel degree: devices the model and KV cache are split over",
                     aliases=("--tensor-parallel-size",))
    compilation_cache_dir: str | None = option("~/.cache/jaxserve/xla", "persistent XLA compilation "
                                               "cache ('none' = off)", parse=parse_optional_path)
    aot_dir: str | None = option(None, "serve: load the step programs from this folder of executables "
                                 "`jaxserve compile --aot-dir` serialized for this machine, compiling only "
                                 "those it does not hold; compile: write them there "
                                 "(jaxserve/aot/executable_store.py)", parse=parse_optional_path)
    scheduler: SchedulerLimits = option(default_factory=SchedulerLimits)

    def __post_init__(self):
        require(isinstance(self.scheduler, SchedulerLimits), "scheduler",
                f"must be a SchedulerLimits, got {type(self.scheduler).__name__}")
        require_positive_int(self, "kv_chunk_pages", "tp")
        for name in ("host_huge_pages", "host_reuse_step_memory"):
            require(isinstance(getattr(self, name), bool), name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_pages", "kv_cache_bytes"):
            v = getattr(self, name)
            require(v is None or (is_int(v) and v > 0), name, f"must be a positive integer, got {v!r}")
        require(self.num_pages is None or self.num_pages >= 2, "num_pages",
                f"must be >= 2 (page 0 is the reserved null page), got {self.num_pages}")
        u = self.gpu_memory_utilization
        require(isinstance(u, (int, float)) and not isinstance(u, bool) and 0 < u <= 1,
                "gpu_memory_utilization", f"must be in (0, 1], got {u!r}")
        require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        require(self.attention_impl in ("auto",) + ATTENTION_IMPLS, "attention_impl",
                f"{self.attention_impl!r} is not one of {('auto',) + ATTENTION_IMPLS}")
        lim = self.scheduler
        if self.max_model_len is not None:
            for name in ("max_prompt_len", "max_output_len"):
                v = getattr(lim, name)
                require(v is None or v <= self.max_model_len, name,
                        f"must be <= max_model_len ({self.max_model_len}), got {v}")
        if self.token_buckets is not None:
            b = tuple(self.token_buckets)
            object.__setattr__(self, "token_buckets", b)
            require(len(b) > 0 and all(is_int(x) and x > 0 for x in b) and list(b) == sorted(set(b)),
                    "token_buckets", f"must be a sorted list of distinct positive integers, got {b}")
            require(b[-1] >= lim.max_num_batched_tokens, "token_buckets",
                    f"the largest bucket ({b[-1]}) must be >= max_num_batched_tokens "
                    f"({lim.max_num_batched_tokens})")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not EngineConfig's own: the nested limits, flat.
        if name in LIMIT_FIELDS:
            return getattr(self.__dict__["scheduler"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def buckets(self) -> tuple[int, ...]:
        return self.token_buckets or default_token_buckets(self.scheduler.max_num_batched_tokens)

    def kv_bytes_per_page(self, model: ModelConfig, itemsize: int, num_layers: int | None = None) -> int:
        """K and V bytes of one page over all layers (or `num_layers` of them: one KV group's);
        `itemsize` is the model dtype's. int8 pages hold 1 byte per element plus a bf16 scale
        per token and KV head (kv_cache.py)."""
        per_token_head = (model.head_dim + _INT8_SCALE_BYTES if self.kv_cache_dtype == "int8"
                          else model.head_dim * itemsize)
        layers = model.num_layers if num_layers is None else num_layers
        return 2 * layers * self.scheduler.page_size * model.num_kv_heads * per_token_head

    def scheduler_config(self, model: ModelConfig, itemsize: int) -> SchedulerConfig:
        """The limits plus the context length and the page count this model and pool give."""
        from jaxserve.kv_sizing import CPU_KV_CACHE_BYTES
        max_len = self.max_model_len or model.max_position_embeddings
        require(max_len <= model.max_position_embeddings, "max_model_len",
                f"{max_len} exceeds the model's context of {model.max_position_embeddings}")
        pool = self.kv_cache_bytes or CPU_KV_CACHE_BYTES
        pages = self.num_pages or max(2, pool // self.kv_bytes_per_page(model, itemsize))
        limits = {name: getattr(self.scheduler, name) for name in LIMIT_FIELDS}
        sched = SchedulerConfig(num_pages=pages, max_model_len=max_len, **limits)
        groups = model.kv_groups()
        if len(groups) == 1:
            return sched
        # Full and sliding layers in two pools (scheduler/window.py); the split: kv_sizing.py.
        from jaxserve.kv_sizing import split_kv_pool
        from jaxserve.scheduler.admission import peak_pages
        window = model.sliding_window
        if self.num_pages:  # as given, for each pool: every layer keeps that many pages
            full, sliding = pages, pages
        else:
            full, sliding = split_kv_pool(pool, self.kv_bytes_per_page(model, itemsize, len(groups[0])),
                                          self.kv_bytes_per_page(model, itemsize, len(groups[1])),
                                          sched.max_num_seqs * peak_pages(sched, max_len, window) + 1)
        return dataclasses.replace(sched, num_pages=full, sliding_window=window, num_sliding_pages=sliding)


def _engine_init(generated):
    def __init__(self, *args, scheduler: SchedulerLimits | None = None, **kw):
        limits = {k: kw.pop(k) for k in list(kw) if k in LIMIT_FIELDS}
        if scheduler is None:
            scheduler = SchedulerLimits(**limits)
        elif limits:
            scheduler = dataclasses.replace(scheduler, **limits)
        generated(self, *args, scheduler=scheduler, **kw)
    __init__.__doc__ = generated.__doc__
    return __init__


# Flat keywords (the scheduler's limits) accepted alongside EngineConfig's own: the many
# EngineConfig(max_num_seqs=..., page_size=...) call sites, and dataclasses.replace, keep working.
EngineConfig.__init__ = _engine_init(EngineConfig.__init__)  # type: ignore[method-assign]

__all__ = ["ATTENTION_IMPLS", "ConfigError", "DTYPES", "EngineConfig", "KV_CACHE_DTYPES", "LoadConfig",
           "MAX_SPECULATIVE_TOKENS", "PER_CHANNEL", "QUANTIZE_GROUP_SIZES", "QUANTIZE_MODES", "QUANT_IMPLS", "MATMUL_IMPLS",
           "QuantizeSpec", "SCHEDULING_POLICIES", "SchedulerConfig", "SchedulerLimits", "default_token_buckets",
           "resolve_dtype"]
