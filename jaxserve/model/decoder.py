"""Flax NNX decoder for every registered family (jaxserve/model/family.py): Llama 2/3/3.x,
Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE, SmolLM, TinyLlama.

Data flow of one forward pass:
  tokens [B, T] -> embed (x sqrt(D) for Gemma) -> L x (RMSNorm -> attention -> [RMSNorm] ->
  residual, RMSNorm -> gated MLP or MoE -> [RMSNorm] -> residual) -> RMSNorm -> LM head -> logits
  [B, T, V] (fp32, soft-capped for Gemma 2). [...] are the sandwich norms of Gemma 2/3.

The parameters are the family's table (family.param_shapes), so the module has exactly the
attributes the checkpoint loaders fill. The per-layer weights are stacked along a leading
layer axis [L, ...] and the layers run under `jax.lax.scan`, so compile time does not grow
with depth. Layers that differ (Gemma's sliding and global layers: another window, another
RoPE base) repeat with a period P: the scan runs over groups of P layers with the group's
P layers unrolled in its body, each with its own static settings (L % P leftover layers run
unrolled after it). Attention is not written here: the caller passes an `attend` function
(the dense contiguous-cache path in dense_attention.py, or the paged seam in sharding/ops.py),
so the dense reference and the paged engine share every other line of the model. A layer
whose window differs from the config's default passes `sliding_window=` to attend.

Every projection (q, k, v, o, gate, up, down, the LM head) is `quant_linear.einsum` and the
embedding `quant_linear.embedding_lookup`: a float weight runs jnp.einsum / jnp.take exactly as
before, a QuantizedWeight runs `self.quantized_matmul` (the quantized-matmul backend resolved
once at load, sharding/quantized_matmul.py), so the same code serves float and int8 / int4
models with no branch per layer (the choice is the pytree's, made at load).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import family, layers
from jaxserve.model import quant_linear as ql
from jaxserve.model.family import param_axes, param_shapes  # noqa: F401  (re-exported)
from sharding import grouped_matmul as gmm
from sharding import quantized_matmul as qmm


class KVCache(NamedTuple):
    """Keys and values of every layer. Dense: [L, B, S, K, H]; paged: [L, P, page, K * H] (pallas_kernels/kv_cache.py)."""

    k: jax.Array
    v: jax.Array


# attend(layer_idx, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], cache, meta) -> (out [B,T,N,H], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, KVCache, Any],
                    tuple[jax.Array, KVCache]]


def layer_period(kinds: tuple) -> int:
    """The smallest P such that layer i's settings are layer (i mod P)'s."""
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return len(kinds)


def layer_kinds(cfg: ModelConfig) -> tuple:
    """Each layer's static settings: (window, whether it takes the local RoPE)."""
    return tuple((w, w is not None and cfg.rope_local_theta is not None) for w in cfg.layer_windows())


def scan_trips(cfg: ModelConfig) -> tuple[int, int]:
    """(iterations of the decoder's layer scan, layers per iteration): the period P of the
    layers' settings and L // P groups (L % P leftover layers run unrolled after the scan)."""
    period = layer_period(layer_kinds(cfg))
    return cfg.num_layers // period, period


def _init(kind: str, shape, dtype, rngs: nnx.Rngs):
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading layer axis."""


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.layers = DecoderLayers()
        shapes = param_shapes(cfg)
        for p in family.table(cfg):
            owner = self.layers if p.per_layer else self
            name = p.path.split(".")[-1]
            if not hasattr(owner, name):
                setattr(owner, name, nnx.Param(_init(p.init, shapes[p.path], dtype, rngs)))
        self.layer_names = tuple(p.path.split(".", 1)[1] for p in family.table(cfg) if p.per_layer)
        self.layer_names = tuple(dict.fromkeys(self.layer_names))
        # What every quantized projection runs (sharding.quantized_matmul.QuantizedMatmul),
        # resolved once when quantized weights are loaded, like `attend` is for attention;
        # None while every weight is float.
        self.quantized_matmul = None
        # What float projections and an untied LM head run where it takes them
        # (sharding.float_matmul.FloatMatmul, from matmul_impl at load); None: jnp.einsum.
        self.float_matmul = None
        # What the MoE expert projections run (sharding.grouped_matmul.GroupedMatmul): ragged_dot
        # on CPU / GPU, the Pallas kernel on TPU; tests may set another row.
        self.grouped_matmul = gmm.resolve("auto") if cfg.num_experts else None

    @classmethod
    def from_arrays(cls, cfg: ModelConfig, arrays: dict[str, Any], dtype=jnp.float32,
                    quantized_matmul=None) -> "Decoder":
        """Build the model from host arrays keyed by `param_shapes` paths, casting floats to
        `dtype`. A QuantizedWeight (for the paths family.quantizable lists) is kept as stored,
        never cast: its full_shape must equal the float shape and its in_axes the axes the
        model contracts. `quantized_matmul`: what those weights run (a
        sharding.quantized_matmul.QuantizedMatmul, resolved from quant_impl by the loader);
        None with quantized weights resolves "auto" here, once.

        The module is created abstractly first, so no random weights are ever materialised.
        """
        model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        expected = param_shapes(cfg)
        missing = sorted(set(expected) - set(arrays))
        unexpected = sorted(set(arrays) - set(expected))
        if missing or unexpected:
            raise ValueError(f"parameter set mismatch: missing {missing}, unexpected {unexpected}")
        quantizable = family.quantizable(cfg)
        for path, shape in expected.items():
            value = arrays[path]
            if ql.is_quantized(value):
                value = _checked_quantized(path, value, shape, quantizable)
            elif tuple(value.shape) != shape:
                raise ValueError(f"parameter {path}: shape {tuple(value.shape)}, expected {shape}")
            else:
                value = jnp.asarray(value, dtype=dtype)
            _variable(model, path).set_value(value)
        if any(ql.is_quantized(v) for v in arrays.values()):
            model.quantized_matmul = quantized_matmul or qmm.resolve("auto")
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
               attend: AttendFn, meta: Any, logit_index: jax.Array | None = None,
               live_tokens: jax.Array | None = None, num_layers: int | None = None) -> tuple[jax.Array, KVCache]:
        """As __call__, but stops before the LM head: final-normed hidden states [B, R, D]
        (so a caller can project only the rows it needs, `head`). `live_tokens` (int32 scalar,
        B = 1 only): the first live_tokens tokens are real and the rest bucket padding, whose
        hidden states are then don't-cares (the packed native matmul skips them).
        `num_layers`: run only the first num_layers layers, then the final norm (a
        self-speculative draft, engine/self_draft.py); their KV goes to the same cache layers."""
        cfg = self.cfg
        fm = self._float_matmul_for(live_tokens, tokens.shape[0])
        x = ql.embedding_lookup(self.embed[...], tokens, self.dtype)  # [B, T, D]
        if cfg.embed_scale:
            # Gemma scales by sqrt(D) rounded to the activation dtype (as HF does).
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), self.dtype)
        rope_global = layers.rope_cos_sin(positions, layers.rope_inv_freq(cfg))
        rope_local = rope_global
        if cfg.rope_local_theta is not None:
            local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
            rope_local = layers.rope_cos_sin(positions, layers.rope_inv_freq(local))
        # Static settings per layer: (window, local rope). Only windows other than the
        # config's single one are passed to attend, so one-window models call it as before.
        kinds = layer_kinds(cfg)
        period = layer_period(kinds)
        stacked = {name: getattr(self.layers, name)[...] for name in self.layer_names}
        # Packed float weights (matmul_impl cpu_native_packed) stay whole: each layer hands the
        # kernel the stack and its index, so the scan copies no per-layer slice of them.
        packed = {n: a for n, a in stacked.items() if isinstance(a, ql.PackedFloatWeight)}
        stacked = {n: a for n, a in stacked.items() if n not in packed}

        def one(x, cache, w, idx, kind):
            w = {**w, **{n: dataclasses.replace(a, layer=idx) for n, a in packed.items()}}
            window, local = kind
            kw = {} if cfg.layer_types is None else {"sliding_window": window}
            return self._layer(x, cache, w, idx, rope_local if local else rope_global,
                               lambda i, q, k, v, c: attend(i, q, k, v, c, meta, **kw), fm)

        L = cfg.num_layers if num_layers is None else num_layers
        groups, rest = divmod(L, period)
        if L < cfg.num_layers and period == 1:  # the scan walks the first L layers' slices
            stacked = jax.tree.map(lambda a: a[:L], stacked)

        def group(carry, xs):
            x, cache = carry
            w, base = xs
            for j in range(period):
                # A period of P layers reads each one's slice of the whole stack in place: a
                # stack cut to groups * P layers and reshaped to [groups, P, ...] was a copy of
                # (nearly) every weight whenever L % P != 0 (Gemma-3-27B's 62 = 10 x 6 + 2:
                # 13.5 GB of temporaries per chip at tp 4, found by the TPU compiler).
                wj = w if period == 1 else jax.tree.map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, base + j, 0, keepdims=False), stacked)
                x, cache = one(x, cache, wj, base + j, kinds[j])
            return (x, cache), None

        if period == 1:
            xs = (stacked, jnp.arange(L, dtype=jnp.int32))
        else:
            xs = (None, jnp.arange(0, groups * period, period, dtype=jnp.int32))
        (x, cache), _ = jax.lax.scan(group, (x, cache), xs)
        for j in range(rest):
            i = groups * period + j
            x, cache = one(x, cache, jax.tree.map(lambda a: a[i], stacked), jnp.int32(i), kinds[j])
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, :, None], axis=1)  # [B, R, D]
        return layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps), cache

    def _float_matmul_for(self, live, batch: int):
        """The float matmul for products over B x T rows of which the first `live` are real."""
        if live is None or self.float_matmul is None:
            return self.float_matmul
        if batch != 1:
            raise ValueError(f"live rows are the first tokens of one flat batch (B = 1); B is {batch}")
        return self.float_matmul.live(live)

    def _layer(self, x, cache, w, idx, rope, attend, fm):
        cfg = self.cfg
        cos, sin = rope
        eps = cfg.rms_norm_eps
        h = layers.rms_norm(x, w["attn_norm"], eps)
        mm = self.quantized_matmul
        q, k, v = ql.einsums(("btd,dnh->btnh", "btd,dkh->btkh", "btd,dkh->btkh"), h, (w["wq"], w["wk"], w["wv"]),
                             matmul=mm, float_matmul=fm)
        if cfg.attention_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        if cfg.qk_norm:
            q = layers.rms_norm(q, w["q_norm"], eps)
            k = layers.rms_norm(k, w["k_norm"], eps)
        q = layers.apply_rope(q, cos, sin)
        k = layers.apply_rope(k, cos, sin)
        if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
            # Every attention implementation scales scores by head_dim^-1/2; Gemma's scale is
            # query_pre_attn_scalar^-1/2, so q carries the ratio.
            q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)
        attn, cache = attend(idx, q, k, v, cache)
        o = ql.einsum("btnh,nhd->btd", attn, w["wo"], matmul=mm, float_matmul=fm)
        if cfg.sandwich_norms:
            o = layers.rms_norm(o, w["post_attn_norm"], eps)
        x = x + o
        h = layers.rms_norm(x, w["mlp_norm"], eps)
        if cfg.num_experts:
            m = layers.moe_mlp(h, w["w_router"], w["we_gate"], w["we_up"], w["we_down"],
                               cfg.num_experts_per_tok, cfg.moe_norm_topk, cfg.hidden_act,
                               grouped_matmul=self.grouped_matmul)
        else:
            m = layers.gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], cfg.hidden_act, matmul=mm,
                                 float_matmul=fm)
        if cfg.sandwich_norms:
            m = layers.rms_norm(m, w["post_mlp_norm"], eps)
        return x + m, cache

    def head(self, x: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, R, D] -> logits [B, R, V] fp32. `live_rows` (int32
        scalar, B = 1 only): the first live_rows rows are real, the rest padding whose logits are
        don't-cares."""
        tied = self.cfg.tie_word_embeddings
        w = self.embed[...] if tied else self.lm_head[...]
        if tied and not isinstance(w, ql.PackedFloatWeight):
            # Contract against the [V, D] embedding as stored: a transposed copy would cost a
            # full read and write of the largest matrix every step.
            logits = ql.einsum("btd,vd->btv", x, w, matmul=self.quantized_matmul,
                               preferred_element_type=jnp.float32)
        else:  # an lm_head [D, V], or a tied embedding packed at load as one (pack_float_weights)
            logits = ql.einsum("btd,dv->btv", x, w, matmul=self.quantized_matmul,
                               preferred_element_type=jnp.float32,
                               float_matmul=self._float_matmul_for(live_rows, x.shape[0]))
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)


def _variable(model: Decoder, path: str):
    owner = model
    *parents, leaf = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return getattr(owner, leaf)


def _checked_quantized(path: str, w: "ql.QuantizedWeight", shape: tuple[int, ...],
                       quantizable: dict) -> "ql.QuantizedWeight":
    if path not in quantizable:
        raise ValueError(f"parameter {path}: cannot be quantized (only {sorted(quantizable)} can); "
                         f"got a QuantizedWeight of shape {w.full_shape}")
    if w.full_shape != shape:
        raise ValueError(f"parameter {path}: quantized weight of full shape {w.full_shape}, expected {shape}")
    if w.in_axes != quantizable[path]:
        raise ValueError(f"parameter {path}: quantized along axes {w.in_axes} of {w.shape}, but the model "
                         f"contracts axes {quantizable[path]}")
    return jax.tree.map(jnp.asarray, w)


def flat_params(model: Decoder, unpack: bool = True) -> dict[str, Any]:
    """The model's parameters (arrays, or QuantizedWeight values) by `param_shapes` path, each in
    its param_shapes shape: a weight packed for the native CPU matmul (quant_linear.
    PackedFloatWeight) comes back unpacked, a copy, unless `unpack` is False (as stored)."""
    out = {path: _variable(model, path)[...] for path in param_shapes(model.cfg)}
    if unpack:
        out = {k: v.unpack() if isinstance(v, ql.PackedFloatWeight) else v for k, v in out.items()}
    return out


def unpack_float_weights(model: Decoder) -> None:
    """Put every packed float weight back in its param_shapes layout, in place, and drop the
    native float matmul: for a model going onto a mesh (the packed kernel runs on one device)."""
    for path in param_shapes(model.cfg):
        var = _variable(model, path)
        if isinstance(w := var.get_value(), ql.PackedFloatWeight):
            var.set_value(w.unpack())
    model.float_matmul = None


# Parameters holding KV heads, with their KV-head axis (stacked layer axis included).
_KV_HEAD_AXES = {"layers.wk": 2, "layers.wv": 2, "layers.bk": 1, "layers.bv": 1}


def replicate_kv_heads(model: Decoder, copies: int) -> Decoder:
    """The same model with every KV head repeated `copies` times (head j of the result is head
    j // copies of the original), for tensor parallelism over more devices than KV heads: query
    head n then reads KV head n // (N / (K * copies)), the copy of the one it read before, so
    outputs are unchanged while each device can hold the KV head its query heads need.
    Quantized k/v weights repeat their stored rows (KV heads are output rows), bit for bit."""
    if copies == 1:
        return model
    cfg = dataclasses.replace(model.cfg, num_kv_heads=model.cfg.num_kv_heads * copies)
    arrays = flat_params(model)
    for name, axis in _KV_HEAD_AXES.items():
        if name in arrays:
            arrays[name] = ql.repeat(arrays[name], copies, axis=axis)
    out = Decoder.from_arrays(cfg, arrays, dtype=model.dtype, quantized_matmul=model.quantized_matmul)
    out.grouped_matmul = model.grouped_matmul  # the row the caller chose, not "auto" again
    return out
