"""A model with no weights: every parameter a jax.ShapeDtypeStruct, built from a config alone.

`jaxserve compile` (jaxserve/aot/) compiles the engine's step programs for a machine this
process is not on, from a folder that may hold only a `config.json`: what a program needs of
the weights is their shapes, dtypes and shardings, which come from the family's parameter table
(jaxserve/model/family.py) exactly as the checkpoint loaders' do. Quantized weights take the
layouts quantize-on-load writes (checkpoints/quantize.py: int8 q [.., N, K] with fp16 group
scales or fp32 per-channel ones, int4 packed uint8 [.., N, K/2] with fp16 scales and zeros);
tests/test_aot_abstract.py holds them equal to the real quantizer's on a tiny model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from checkpoints.quantize import group_size_for, quantized_entries
from jaxserve.config import ModelConfig
from jaxserve.config_engine import QuantizeSpec
from jaxserve.model import family
from jaxserve.model import quant_linear as ql
from jaxserve.model.llama import Llama
from sharding import quantized_matmul as qmm


def abstract_quantized(full_shape: tuple[int, ...], n_lead: int, in_axes: tuple[int, ...], bits: int,
                       group_size: int | None) -> ql.QuantizedWeight:
    """The QuantizedWeight quantize-on-load makes of a float weight of `full_shape` (n_lead
    stacked dims, then one matrix contracted over `in_axes`), as shapes only."""
    lead, shape = tuple(full_shape[:n_lead]), tuple(full_shape[n_lead:])
    K = math.prod(shape[a] for a in in_axes)
    N = math.prod(shape) // K
    G = K if group_size is None else group_size
    if K % G:
        raise ValueError(f"int{bits} group size {G} does not divide the input width {K} of a weight of shape {shape}")
    sds = jax.ShapeDtypeStruct
    if bits == 8:
        scale_dtype = jnp.float16 if G < K else jnp.float32
        q, zero = sds(lead + (N, K), jnp.int8), None
    else:
        scale_dtype = jnp.float16
        q, zero = sds(lead + (N, K // 2), jnp.uint8), sds(lead + (N, K // G), jnp.float16)
    return ql.QuantizedWeight(q=q, scale=sds(lead + (N, K // G), scale_dtype), zero=zero, bits=bits,
                              group_size=G, shape=shape, in_axes=in_axes)


def abstract_model(cfg: ModelConfig, dtype, quantize: QuantizeSpec | None = None,
                   quant_impl: str = "auto") -> Llama:
    """The Llama-family model of `cfg` with abstract weights in `dtype` (float) or quantized as
    `quantize` asks (int8 / int4; as-shipped needs the GGUF's own blocks, so it is refused).
    Backends (quantized matmul, grouped matmul) resolve for the platform being targeted
    (sharding.backends.targeting)."""
    quantize = quantize or QuantizeSpec()
    if quantize.mode not in ("none", "int8", "int4"):
        raise ValueError(f"quantize: {quantize.mode!r} needs the checkpoint's own blocks; compiling from a "
                         f"config alone takes none, int8 or int4")
    model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    if quantize.mode == "none":
        return model
    bits = 8 if quantize.mode == "int8" else 4
    G = group_size_for(cfg, quantize)
    shapes = family.param_shapes(cfg)
    leads = {p.path: family.lead_dims(p) for p in family.table(cfg)}
    leads.setdefault("embed", 0)
    for path, in_axes in quantized_entries(cfg).items():
        owner = model
        *parents, leaf = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        getattr(owner, leaf).set_value(abstract_quantized(shapes[path], leads[path], in_axes, bits, G))
    model.quantized_matmul = qmm.resolve(quant_impl)
    return model

