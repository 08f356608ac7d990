"""Flax NNX decoder for the Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, SmolLM, TinyLlama).

Data flow of one forward pass:
  tokens [B, T] -> embed -> L x (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual)
  -> RMSNorm -> LM head -> logits [B, T, V] (fp32).

The per-layer weights are stacked along a leading layer axis [L, ...] and the layers run under
`jax.lax.scan`, so compile time does not grow with depth. Attention is not written here: the
caller passes an `attend` function (the dense contiguous-cache path in dense_attention.py, or
the paged seam in sharding/ops.py), so the dense reference and the paged engine share every
other line of the model. The KV cache is threaded through the scan as a carry and written in
place by `attend` (with buffer donation at the jit boundary, nothing copies it).

Every projection (q, k, v, o, gate, up, down, the LM head) is `quant_linear.einsum` and the
embedding `quant_linear.embedding_lookup`: a float weight runs jnp.einsum / jnp.take exactly as
before, a QuantizedWeight runs the quantized matmul seam, so the same code serves float and
int8 / int4 models with no branch per layer (the choice is the pytree's, made at load).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import layers
from jaxserve.model import quant_linear as ql


class KVCache(NamedTuple):
    """Keys and values of every layer. Dense: [L, B, S, K, H]; paged: [L, P, page, K * H] (pallas_kernels/kv_cache.py)."""

    k: jax.Array
    v: jax.Array


# attend(layer_idx, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], cache, meta) -> (out [B,T,N,H], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, KVCache, Any],
                    tuple[jax.Array, KVCache]]

# Parameter paths (as in `param_shapes`) that are stacked per layer.
LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_PARAMS = ("bq", "bk", "bv")

# Parameters that may be a QuantizedWeight, with the axes of their per-matrix float shape that
# the model contracts (QuantizedWeight.in_axes): every projection, the LM head, and the
# embedding, whose [V, D] table is read row-wise by the lookup and as the tied head.
QUANTIZABLE = {"embed": (1,), "layers.wq": (0,), "layers.wk": (0,), "layers.wv": (0,),
               "layers.wo": (0, 1), "layers.w_gate": (0,), "layers.w_up": (0,),
               "layers.w_down": (0,), "lm_head": (0,)}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by its flat path. The checkpoint loaders map onto these paths."""
    L, D, F, N, K, H, V = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    shapes = {
        "embed": (V, D),
        "layers.attn_norm": (L, D),
        "layers.wq": (L, D, N, H),
        "layers.wk": (L, D, K, H),
        "layers.wv": (L, D, K, H),
        "layers.wo": (L, N, H, D),
        "layers.mlp_norm": (L, D),
        "layers.w_gate": (L, D, F),
        "layers.w_up": (L, D, F),
        "layers.w_down": (L, F, D),
        "final_norm": (D,),
    }
    if cfg.attention_bias:
        shapes.update({"layers.bq": (L, N, H), "layers.bk": (L, K, H), "layers.bv": (L, K, H)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def param_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of every parameter, by path; sharding/rules.py maps them to mesh axes."""
    axes = {
        "embed": ("vocab", "embed"),
        "layers.attn_norm": ("layers", "embed"),
        "layers.wq": ("layers", "embed", "heads", "head_dim"),
        "layers.wk": ("layers", "embed", "kv_heads", "head_dim"),
        "layers.wv": ("layers", "embed", "kv_heads", "head_dim"),
        "layers.wo": ("layers", "heads", "head_dim", "embed"),
        "layers.mlp_norm": ("layers", "embed"),
        "layers.w_gate": ("layers", "embed", "mlp"),
        "layers.w_up": ("layers", "embed", "mlp"),
        "layers.w_down": ("layers", "mlp", "embed"),
        "final_norm": ("embed",),
        "layers.bq": ("layers", "heads", "head_dim"),
        "layers.bk": ("layers", "kv_heads", "head_dim"),
        "layers.bv": ("layers", "kv_heads", "head_dim"),
        "lm_head": ("embed", "vocab"),
    }
    return {k: axes[k] for k in param_shapes(cfg)}


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading layer axis."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        shapes = param_shapes(cfg)
        for name in LAYER_PARAMS + (BIAS_PARAMS if cfg.attention_bias else ()):
            shape = shapes["layers." + name]
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name.startswith("b"):
                value = jnp.zeros(shape, dtype)
            else:
                value = (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)
            setattr(self, name, nnx.Param(value))


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Param((0.02 * jax.random.normal(rngs.params(), (V, D))).astype(dtype))
        self.layers = DecoderLayers(cfg, dtype, rngs)
        self.final_norm = nnx.Param(jnp.ones((D,), dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param((0.02 * jax.random.normal(rngs.params(), (D, V))).astype(dtype))

    @classmethod
    def from_arrays(cls, cfg: ModelConfig, arrays: dict[str, Any], dtype=jnp.float32) -> "Llama":
        """Build the model from host arrays keyed by `param_shapes` paths, casting floats to
        `dtype`. A QuantizedWeight (for the paths in QUANTIZABLE) is kept as stored, never cast:
        its full_shape must equal the float shape and its in_axes the axes the model contracts.

        The module is created abstractly first, so no random weights are ever materialised.
        """
        model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        expected = param_shapes(cfg)
        missing = sorted(set(expected) - set(arrays))
        unexpected = sorted(set(arrays) - set(expected))
        if missing or unexpected:
            raise ValueError(f"parameter set mismatch: missing {missing}, unexpected {unexpected}")
        for path, shape in expected.items():
            value = arrays[path]
            if ql.is_quantized(value):
                value = _checked_quantized(path, value, shape)
            elif tuple(value.shape) != shape:
                raise ValueError(f"parameter {path}: shape {tuple(value.shape)}, expected {shape}")
            else:
                value = jnp.asarray(value, dtype=dtype)
            owner = model
            *parents, leaf = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            getattr(owner, leaf).set_value(value)
        return model

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
                 attend: AttendFn, meta: Any, logit_index: jax.Array | None = None
                 ) -> tuple[jax.Array, KVCache]:
        """tokens, positions [B, T] int32 -> logits [B, R, V] fp32 and the updated cache.

        `logit_index` [B, R] picks the R token positions whose logits are wanted (decode and
        sampling need only the last one; projecting every prompt token onto a 49k vocabulary
        would cost more than the rest of a small model). None = every position (R = T).
        """
        x, cache = self.hidden(tokens, positions, cache, attend, meta, logit_index)
        return self.head(x), cache

    def hidden(self, tokens: jax.Array, positions: jax.Array, cache: KVCache,
               attend: AttendFn, meta: Any, logit_index: jax.Array | None = None
               ) -> tuple[jax.Array, KVCache]:
        """As __call__, but stops before the LM head: final-normed hidden states [B, R, D]
        (so a caller can project only the rows it needs, `head`)."""
        cfg = self.cfg
        x = ql.embedding_lookup(self.embed[...], tokens, self.dtype)  # [B, T, D]
        cos, sin = layers.rope_cos_sin(positions, layers.rope_inv_freq(cfg))
        stacked = {name: getattr(self.layers, name)[...]
                   for name in LAYER_PARAMS + (BIAS_PARAMS if cfg.attention_bias else ())}

        def layer(carry, xs):
            x, cache = carry
            w, idx = xs
            h = layers.rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
            q = ql.einsum("btd,dnh->btnh", h, w["wq"])
            k = ql.einsum("btd,dkh->btkh", h, w["wk"])
            v = ql.einsum("btd,dkh->btkh", h, w["wv"])
            if cfg.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = layers.apply_rope(q, cos, sin)
            k = layers.apply_rope(k, cos, sin)
            attn, cache = attend(idx, q, k, v, cache, meta)
            x = x + ql.einsum("btnh,nhd->btd", attn, w["wo"])
            h = layers.rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
            x = x + layers.swiglu_mlp(h, w["w_gate"], w["w_up"], w["w_down"])
            return (x, cache), None

        idxs = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(layer, (x, cache), (stacked, idxs))
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, :, None], axis=1)  # [B, R, D]
        return layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), cache

    def head(self, x: jax.Array) -> jax.Array:
        """Final-normed hidden states [B, R, D] -> logits [B, R, V] fp32."""
        if self.cfg.tie_word_embeddings:
            # Contract against the [V, D] embedding as stored: a transposed copy would cost a
            # full read and write of the largest matrix every step.
            return ql.einsum("btd,vd->btv", x, self.embed[...], preferred_element_type=jnp.float32)
        return ql.einsum("btd,dv->btv", x, self.lm_head[...], preferred_element_type=jnp.float32)


def _checked_quantized(path: str, w: "ql.QuantizedWeight", shape: tuple[int, ...]) -> "ql.QuantizedWeight":
    if path not in QUANTIZABLE:
        raise ValueError(f"parameter {path}: cannot be quantized (only {sorted(QUANTIZABLE)} can); "
                         f"got a QuantizedWeight of shape {w.full_shape}")
    if w.full_shape != shape:
        raise ValueError(f"parameter {path}: quantized weight of full shape {w.full_shape}, expected {shape}")
    if w.in_axes != QUANTIZABLE[path]:
        raise ValueError(f"parameter {path}: quantized along axes {w.in_axes} of {w.shape}, but the model "
                         f"contracts axes {QUANTIZABLE[path]}")
    return jax.tree.map(jnp.asarray, w)


def flat_params(model: Llama) -> dict[str, Any]:
    """The model's parameters (arrays, or QuantizedWeight values) by `param_shapes` path."""
    out = {}
    for path in param_shapes(model.cfg):
        owner = model
        *parents, leaf = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        out[path] = getattr(owner, leaf)[...]
    return out


def replicate_kv_heads(model: Llama, copies: int) -> Llama:
    """The same model with every KV head repeated `copies` times (head j of the result is head
    j // copies of the original), for tensor parallelism over more devices than KV heads: query
    head n then reads KV head n // (N / (K * copies)), the copy of the one it read before, so
    outputs are unchanged while each device can hold the KV head its query heads need.
    Quantized k/v weights repeat their stored rows (KV heads are output rows), bit for bit."""
    if copies == 1:
        return model
    cfg = dataclasses.replace(model.cfg, num_kv_heads=model.cfg.num_kv_heads * copies)
    arrays = flat_params(model)
    for name, axis in (("layers.wk", 2), ("layers.wv", 2), ("layers.bk", 1), ("layers.bv", 1)):
        if name in arrays:
            arrays[name] = ql.repeat(arrays[name], copies, axis=axis)
    return Llama.from_arrays(cfg, arrays, dtype=model.dtype)
