"""Stateless building blocks of the decoder: RMSNorm, RoPE, the gated MLP (SwiGLU / GeGLU).

Einsum legend, used across jaxserve/model and sharding/ops:
  B batch, T tokens (query), S KV length, D model width, N query heads, K KV heads,
  G query heads per KV head (N = K * G), H head dim, F MLP width, V vocabulary, L layers.

Norms, RoPE angles and softmax run in float32 whatever the activation dtype; results are cast
back to the activation dtype, as HF transformers does, so bf16 runs stay close to fp32 ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.model import quant_linear as ql
from sharding import grouped_matmul as gmm_seam


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D], weight [D]. Normalise in fp32, cast back, then scale (HF's order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
    """Inverse frequencies [H/2] in fp32, with Llama 3.1 / linear scaling applied."""
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    return _llama3_scale(inv_freq, rs)


def _llama3_scale(inv_freq: jnp.ndarray, rs: RopeScaling) -> jnp.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    # smoothly (Llama 3.1's published recipe, as in HF's _compute_llama3_parameters).
    low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] int -> cos, sin [..., H] in fp32 (rotate-half layout: halves repeated)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., T, heads, H]; cos/sin [..., T, H]. Rotate-half RoPE (HF Llama layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    return x * cos + rotated * sin


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, matmul=None,
               float_matmul=None) -> jax.Array:
    """x [B, T, D]; w_gate, w_up [D, F]; w_down [F, D] (float arrays or QuantizedWeights, which
    run `matmul`, the model's quantized matmul; float ones `float_matmul` where it takes them)."""
    mm = {"matmul": matmul, "float_matmul": float_matmul}
    gate, up = ql.einsums(("btd,df->btf", "btd,df->btf"), x, (w_gate, w_up), **mm)
    return ql.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w_down, **mm)


_ACTS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def gated_mlp(x: jax.Array, w_gate, w_up, w_down, act: str = "silu", *, matmul=None,
              float_matmul=None) -> jax.Array:
    """act(x w_gate) * (x w_up) -> w_down: SwiGLU ("silu", Llama) or GeGLU with tanh-approximated
    GELU ("gelu_tanh", Gemma; HF's gelu_pytorch_tanh)."""
    if act == "silu":
        return swiglu_mlp(x, w_gate, w_up, w_down, matmul=matmul, float_matmul=float_matmul)
    mm = {"matmul": matmul, "float_matmul": float_matmul}
    gate, up = ql.einsums(("btd,df->btf", "btd,df->btf"), x, (w_gate, w_up), **mm)
    return ql.einsum("btf,fd->btd", _ACTS[act](gate) * up, w_down, **mm)


def moe_mlp(x: jax.Array, w_router, w_gate, w_up, w_down, top_k: int, normalize: bool,
            act: str = "silu", *, grouped_matmul=None) -> jax.Array:
    """Sparse Mixture of Experts. x [B, T, D]; w_router [D, E]; w_gate, w_up [E, D, F];
    w_down [E, F, D]. Each token's router softmax (fp32) picks its top_k experts, weighted by
    their probabilities (renormalised to sum 1 when `normalize`). The M * top_k (token, expert)
    pairs are sorted by expert and run as one grouped matmul per projection
    (jax.lax.ragged_dot, group sizes counted on device): shapes depend only on M, so no step
    recompiles whatever the routing. Padding tokens are routed too and their rows ignored.
    `grouped_matmul`: what runs the three projections (sharding.grouped_matmul.GroupedMatmul:
    ragged_dot on CPU / GPU, the Pallas kernel on TPU); None: its "ragged_dot" row.

    Quantized experts (QuantizedWeight [E, N, .], one [D, F] / [F, D] matrix per expert) run
    through the grouped matmul's quantized path (`GroupedMatmul.quantized`), which reads the
    int8 / int4 blocks as stored: no float copy of the experts is made (the float MoE on the
    dequantized weights is its reference)."""
    B, T, D = x.shape
    E = w_router.shape[-1]
    xf = x.reshape(B * T, D)
    logits = jnp.einsum("md,de->me", xf, w_router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_e = jax.lax.top_k(probs, top_k)  # [M, k]
    if normalize:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)  # (token, slot) pairs grouped by expert
    tok = order // top_k
    sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = xf[tok]  # [M * k, D]
    gmm = grouped_matmul if grouped_matmul is not None else gmm_seam.resolve("ragged_dot")
    # split: how each weight's F axis lies over "tp" (gate / up: output columns, down: inputs)
    gate = _experts(gmm, xs, w_gate, sizes, split="n")
    up = _experts(gmm, xs, w_up, sizes, split="n")
    h = (_ACTS[act](gate) * up).astype(x.dtype)
    y = _experts(gmm, h, w_down, sizes, out_dtype=jnp.float32, split="k")  # [M * k, D]
    y = y * top_p.reshape(-1)[order][:, None]
    out = jnp.zeros((B * T, D), jnp.float32).at[tok].add(y)
    return out.reshape(B, T, D).astype(x.dtype)


def _experts(gmm, lhs, w, sizes, *, out_dtype=None, split: str):
    """lhs [M, K] rows sorted by expert times each expert's w ([E, K, N] float, or a
    QuantizedWeight of one [K, N] matrix per expert, stored [E, N, K']) -> [M, N]. A float
    weight's split is the one moe_mlp gives (its F axis over "tp"); a quantized weight carries
    its own (None when it was not split: one device, or replicated)."""
    if not ql.is_quantized(w):
        return gmm(lhs, w, sizes, out_dtype=out_dtype, split=split)
    if w.in_axes != (0,) or len(w.shape) != 2 or w.q.ndim != 3:
        raise ValueError(f"moe_mlp: quantized experts must be one [K, N] matrix per expert (in_axes (0,), "
                         f"q [E, N, K']), got shape {w.shape}, in_axes {w.in_axes}, q {w.q.shape}")
    return gmm.quantized(lhs, w.q, w.scale, w.zero, sizes, bits=w.bits, group_size=w.group_size,
                         out_dtype=out_dtype or lhs.dtype, split=w.split)
