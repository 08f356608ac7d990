"""One call that loads what every entry point needs: the model, its config and its tokenizer.

Where the weights come from, in the order `load` checks:
  an Orbax folder (`jaxserve convert --to orbax`)  restored as stored, no conversion at all
  --quantize int8 | int4 | as-shipped              checkpoints.quantize.load_quantized_params
  an HF folder with a tensor-parallel mesh         each process reads its slices (sharded.py)
  otherwise                                        float weights in `dtype` (a GGUF dequantized)
The GGUF default stays `none` (dequantized to the model dtype, what the goldens and most tests
compare against); `as-shipped` keeps its 4-/8-bit blocks and is asked for explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import checkpoints
from jaxserve import host_memory
from jaxserve.config import ConfigError, ModelConfig, resolve_dtype
from jaxserve.model.llama import Llama, flat_params
from jaxserve.model.paged_attention import SLOW_16BIT_CPU_BEFORE
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger("jaxserve.loading")


@dataclasses.dataclass
class LoadedModel:
    model: Llama
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path
    format: str  # "hf", "gguf" or "orbax"
    load_s: float  # everything: reading, converting, building the model
    quantize: str = "none"  # the --quantize mode the weights are in (an Orbax folder's own)
    weights: str = ""  # bytes and formats of the weights (checkpoints.quantize.describe)
    load_memory: host_memory.PeakRSS | None = None  # peak resident host memory during the load

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from the config and the tokenizer together (chat models often end on both)."""
        return tuple(sorted(set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))


def load_tokenizer(loaded: checkpoints.LoadedParams) -> Tokenizer:
    if loaded.format == "gguf":
        return Tokenizer.from_gguf_metadata(loaded.gguf_metadata)
    return Tokenizer.from_hf_folder(loaded.source)


def load_tokenizer_of(model: str | Path | None = None) -> Tokenizer:
    """The tokenizer of `model` (a folder or a GGUF file; None = the embedded default), without
    its weights: what the router's HTTP door needs (disagg/router_http.py)."""
    path = checkpoints.resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    from checkpoints.gguf_loader import GGUFCheckpoint
    return Tokenizer.from_gguf_metadata(GGUFCheckpoint(path).metadata)


def load(model: str | Path | None = None, dtype: str = "auto", mesh=None, quantize: str = "none",
         quantize_group_size: int | None = None, quant_impl: str = "auto",
         progress: bool = False, matmul_impl: str = "auto") -> LoadedModel:
    """Loads, measuring (and logging) the peak host memory of the load: `lm.load_memory`. On
    CPU the "devices" are host memory too, so what they hold counts in it.

    With a tensor-parallel mesh, an HF folder in float (dense or MoE) is read shard by shard (each process
    reads only its devices' slices, checkpoints/sharded.py); a GGUF file, quantized weights and
    an Orbax folder are read whole on the host and split by the engine afterwards.

    quantize: "none" | "int8" | "int4" | "as-shipped" (GGUF only); quantize_group_size: None =
    the default (checkpoints.quantize.QuantizeSpec); quant_impl: the quantized matmul
    implementation (sharding/quantized_matmul.py), "auto" by backend; matmul_impl: what the
    float projections run (sharding/float_matmul.py; "auto": the packed native kernel for fp32
    weights on one CPU device, else "xla"). dtype "auto": bfloat16
    on TPU/GPU, float32 on CPU (config_engine.resolve_dtype). progress: a bar over the tensors
    read (GGUF dequantizing, quantize-on-load) when stderr is a terminal."""
    import jax
    dtype = resolve_dtype(dtype, jax.default_backend())
    from checkpoints import progress as load_progress
    with host_memory.peak_during() as mem, load_progress.bar("loading weights", progress):
        # A named matmul_impl is refused before anything is read; "auto" (which cannot be refused)
        # says its choice once the checkpoint is open, so a bad path's error stays one line.
        float_matmul = None if matmul_impl == "auto" else _float_matmul(matmul_impl, mesh, dtype)
        lm = _load(model, dtype, mesh, quantize, quantize_group_size, quant_impl)
        if matmul_impl == "auto":
            float_matmul = _float_matmul(matmul_impl, mesh, dtype)
        lm.model.float_matmul = float_matmul
        if float_matmul is not None and float_matmul.is_packed:
            pack_float_weights(lm.model)
        jax.block_until_ready(flat_params(lm.model, unpack=False))  # every read and copy inside the span
    lm.load_memory = mem
    log.info("loaded %s in %.1f s; %s", lm.source.name, lm.load_s, mem.describe())
    # After the load, so a refused dtype or a bad path stays a one-line error.
    packed = float_matmul is not None and float_matmul.is_packed
    if (why := cpu_bfloat16_warning(jax.default_backend(), dtype, lm.quantize, packed)) is not None:
        from sharding import backends
        backends.warn_once("jaxserve.loading", why)
    return lm


def cpu_bfloat16_warning(platform: str, dtype: str, quantize: str = "none", packed: bool = False,
                         jax_version: tuple | None = None) -> str | None:
    """Why bf16 float weights would be slow here, or None: on the CPU, jax 0.10's XLA has no fast
    16-bit float matmul, so bf16 weights that the native packed kernel does not take (it widens
    them in registers: matmul_impl auto or cpu_native_packed) run an order of magnitude slower
    than float32. Said once at load, for every entry point (the dense path has no KV warning)."""
    import jax
    version = tuple(jax.__version_info__ if jax_version is None else jax_version)
    if (platform != "cpu" or dtype != "bfloat16" or quantize != "none" or packed
            or version[:2] >= SLOW_16BIT_CPU_BEFORE):
        return None
    return (f"bfloat16 weights through XLA on the CPU decode an order of magnitude slower on jax "
            f"{'.'.join(map(str, version))} (`jaxserve generate` on SmolLM2, 2-core AMD EPYC Zen 4: 4.2 tok/s, "
            f"against 30-37 through the native packed kernel and 41 in float32): use --matmul-impl auto or "
            f"cpu_native_packed, --dtype float32, or jax >= 0.12")


def _load(model, dtype: str, mesh, quantize: str, quantize_group_size: int | None,
          quant_impl: str) -> LoadedModel:
    from checkpoints.orbax_io import is_orbax_checkpoint, load_orbax
    from checkpoints.quantize import QuantizeSpec, describe, load_quantized_params
    from jaxserve.config import DTYPES
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not supported; choose one of {DTYPES}")
    spec = QuantizeSpec(quantize, quantize_group_size)  # errors name the quantize fields
    path = checkpoints.resolve_model_path(model)
    if path.is_dir() and is_orbax_checkpoint(path):
        stored = load_orbax(path)
        if spec.mode not in ("none", stored.quantize) or spec.group_size is not None:
            raise checkpoints.CheckpointError(
                f"quantize: {spec.mode!r}, but {path} is an Orbax checkpoint written with quantize "
                f"{stored.quantize!r}, and loads as stored (leave quantize and its group size unset)")
        matmul = _quantized_matmul(stored.params, quant_impl)
        llama = Llama.from_arrays(stored.config, stored.params, dtype=_jnp_dtype(dtype), quantized_matmul=matmul)
        return LoadedModel(llama, stored.config, Tokenizer.from_hf_folder(path), path, "orbax",
                           time.perf_counter() - t0, stored.quantize, describe(flat_params(llama)))
    if spec.mode == "none" and mesh is not None and mesh.shape["tp"] > 1 and path.is_dir():
        _quantized_matmul({}, quant_impl)  # float weights: only "auto" is accepted
        from checkpoints.hf import read_hf_config
        from checkpoints.sharded import load_hf_sharded
        llama = load_hf_sharded(path, dtype, mesh)
        tokenizer = Tokenizer.from_hf_folder(path)
        return LoadedModel(llama, read_hf_config(path), tokenizer, path, "hf", time.perf_counter() - t0,
                           "none", f"{dtype}, read in shards")
    loaded = load_quantized_params(path, spec)  # spec "none": the plain float loaders
    matmul = _quantized_matmul(loaded.params, quant_impl)
    llama = Llama.from_arrays(loaded.config, loaded.params, dtype=_jnp_dtype(dtype), quantized_matmul=matmul)
    return LoadedModel(llama, loaded.config, load_tokenizer(loaded), loaded.source, loaded.format,
                       time.perf_counter() - t0, spec.mode, describe(flat_params(llama)))


def _jnp_dtype(dtype: str):
    import jax.numpy as jnp
    return jnp.dtype(dtype)


# The float projections packed for matmul_impl "cpu_native_packed": name -> how many leading
# (contracted) dims of one layer's matrix are K (wo is [N_heads, H, D]: two).
PACKED_PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def pack_float_weights(model) -> None:
    """Replace the model's float projection weights (stacked [L, K.., N..]) and its LM head (an
    untied lm_head, or a tied embedding) by their packed layout (quant_linear.PackedFloatWeight);
    the unpacked arrays are dropped. Quantized or non-fp32 weights stay as they are."""
    import jax.numpy as jnp

    from jaxserve.model import quant_linear as ql
    from pallas_kernels.small_matmul import cpu_native as smm_cpu

    def packable(w) -> bool:
        return w is not None and not ql.is_quantized(w) and jnp.dtype(w.dtype) in smm_cpu.PACKED_W_DTYPES

    for name, n_in in PACKED_PROJECTIONS.items():
        param = getattr(model.layers, name, None)
        w = None if param is None else param[...]
        if not packable(w):
            continue
        shape = tuple(w.shape[1:])
        k = math.prod(shape[:n_in])
        param.set_value(ql.PackedFloatWeight(smm_cpu.pack(w.reshape(w.shape[0], k, -1)), None, shape, n_in))
    if model.cfg.tie_word_embeddings:
        # The tied embedding [V, D] packed as the head's [D, V]: XLA:CPU's dot transposed the
        # whole table for every step of more than one row (SmolLM2's 113 MB: 8.9 ms for 8 rows
        # against 3.9 for one); the lookup reads its rows from the tiles (embedding_lookup).
        if packable(w := model.embed[...]):
            model.embed.set_value(ql.PackedFloatWeight(smm_cpu.pack(w.T), None, tuple(w.T.shape), 1, transposed=True))
    elif hasattr(model, "lm_head") and packable(w := model.lm_head[...]):
        model.lm_head.set_value(ql.PackedFloatWeight(smm_cpu.pack(w), None, tuple(w.shape), 1))


def _float_matmul(matmul_impl: str, mesh, dtype):
    """The model's FloatMatmul (None for "xla"); a refusal is a ConfigError naming matmul_impl."""
    from sharding import float_matmul
    try:
        return float_matmul.resolve(matmul_impl, tp=1 if mesh is None else mesh.shape["tp"], dtype=dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _quantized_matmul(params: dict, quant_impl: str):
    """The quantized matmul `quant_impl` names, resolved once for this backend (the model holds
    it; sharding/quantized_matmul.py); an implementation named for float weights is an error,
    not ignored."""
    from jaxserve.model import quant_linear as ql
    from sharding import quantized_matmul as qmm
    try:
        matmul = qmm.resolve(quant_impl)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if quant_impl != "auto" and not any(ql.is_quantized(v) for v in params.values()):
        raise ConfigError(f"quant_impl: {quant_impl!r} applies to quantized weights, and these are float "
                          f"(choose --quantize int8, int4 or as-shipped)")
    return matmul
