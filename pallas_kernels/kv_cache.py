"""The paged KV cache's two storage formats, and the step's write into them.

Plain:  one array per K and V, [L, P, page, K * H] in the cache dtype (fp32 / bf16 / fp16).
int8:   `QuantizedKV(values, scales)` per K and V:
          values [L, P, page, K * H] int8  round(x / scale), in [-127, 127]
          scales [L, P, K, page]    bf16   one scale per token and KV head: absmax over H / 127
        Scales are per token and head, so writing a token never touches its page-mates (a
        per-page scale would have to requantize the page as it fills). They sit head-major
        inside a page, [K, page], so one head's scales for a page are one contiguous run: a
        single DMA / TMA box on TPU and GPU, and a lane vector that scales a block's score
        columns. bf16 scales keep the pool at (H + 2) bytes per token and head, against 2H for
        bf16 values: 1.94x the tokens at H = 64, 1.97x at H = 128 (fp32 scales would give only
        1.88x at H = 64). The write quantizes with the bf16-rounded scale itself, so the only
        error is int8 rounding (at most half a step, scale / 2, per element).

Values are stored [L, P, page, K * H], a token's KV heads side by side (head-major), because
that is what the TPU kernel reads: on TPU an HBM array is tiled over its last two dimensions, so
[.., K, H] and [.., page, K * H] are different byte layouts and converting one into the other
per call would copy every layer's cache (issue 22). The XLA, native CPU and GPU paths view the
same bytes [L, P, page, K, H] (as_heads): a reshape that moves nothing on CPU and GPU, whose
arrays are row-major and untiled. Every function here and every implementation also accepts
5-D values (tests build them so).

Both formats are pytrees of arrays, so the model threads either through its layer scan and the
runner donates either to the compiled step without knowing which it holds.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCALE_DTYPE = jnp.bfloat16
_QMAX = 127.0


class QuantizedKV(NamedTuple):
    values: jax.Array  # [L, P, page, K * H] int8 as stored ([L, P, page, K, H] also accepted)
    scales: jax.Array  # [L, P, K, page] bf16


def is_quantized(cache) -> bool:
    return isinstance(cache, QuantizedKV)


def storage_dtype(cache):
    """What the cache stores, as the kernels' checks name it: "int8" or the array's dtype."""
    return "int8" if is_quantized(cache) else cache.dtype


def values_of(cache) -> jax.Array:
    """The values array of either format: [L, P, page, K * H] as stored, or [L, P, page, K, H]."""
    return cache.values if is_quantized(cache) else cache


def _map_values(cache, f):
    return QuantizedKV(f(cache.values), cache.scales) if is_quantized(cache) else f(cache)


def as_heads(cache, head_dim: int):
    """The cache with values viewed [L, P, page, K, H] (what the XLA, CPU and GPU paths index).
    From the stored [L, P, page, K * H] this is a reshape that moves no byte on CPU and GPU
    (row-major, untiled); on TPU it would be a relayout, which is why the TPU kernel reads the
    stored layout (as_flat) instead."""
    def f(x):
        if x.ndim == 5:
            return x
        L, P, ps, KH = x.shape
        return x.reshape(L, P, ps, KH // head_dim, head_dim)
    return _map_values(cache, f)


def as_flat(cache):
    """The cache with values [L, P, page, K * H], the stored layout (a no-op on it): a page's
    heads side by side in lanes, what the TPU kernel DMAs (one copy per page, each head a lane
    slice). 5-D caches (tests) are reshaped."""
    def f(x):
        return x if x.ndim == 4 else x.reshape(*x.shape[:3], x.shape[3] * x.shape[4])
    return _map_values(cache, f)


def init_cache(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype) -> tuple:
    """(k_cache, v_cache), zero-filled, values stored [L, P, page, K * H] (heads side by side,
    the TPU kernel's layout: no relayout copy of the cache on any call; the other paths view
    it [L, P, page, K, H] through as_heads, free outside TPU). dtype "int8" builds QuantizedKV."""
    shape = (num_layers, num_pages, page_size, num_kv_heads * head_dim)
    if isinstance(dtype, str) and dtype == "int8":
        sshape = (num_layers, num_pages, num_kv_heads, page_size)
        return tuple(QuantizedKV(jnp.zeros(shape, jnp.int8), jnp.zeros(sshape, SCALE_DTYPE))
                     for _ in range(2))
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def bytes_per_token_head(head_dim: int, dtype) -> int:
    """Cache bytes one token of one KV head costs, for K or V (scales included)."""
    if isinstance(dtype, str) and dtype == "int8":
        return head_dim + jnp.dtype(SCALE_DTYPE).itemsize
    return head_dim * jnp.dtype(dtype).itemsize


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] float -> (int8 [..., H], bf16 scales [...]); x ~= int8 * scale."""
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    # A zero vector gets a tiny positive scale (and zeros), never a division by zero.
    scale = (jnp.maximum(absmax, 1e-30) / _QMAX).astype(SCALE_DTYPE)
    q = jnp.clip(jnp.round(xf / scale.astype(jnp.float32)[..., None]), -_QMAX, _QMAX)
    return q.astype(jnp.int8), scale


def dequantize_pages(values: jax.Array, scales: jax.Array) -> jax.Array:
    """values [..., page, K, H] int8, scales [..., K, page] -> fp32 [..., page, K, H]."""
    s = jnp.swapaxes(scales, -1, -2).astype(jnp.float32)  # [..., page, K]
    return values.astype(jnp.float32) * s[..., None]


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Scatter the step's new K/V [T, K, H] into slot_mapping[t] = page * page_size + offset
    of layer `layer`; slot -1 (padding) is dropped. Either cache format; returns both caches.
    Plain caches store k/v cast to their dtype; int8 caches store quantize(k/v)."""
    L, P, ps = values_of(k_cache).shape[:3]
    valid = slot_mapping >= 0
    page = jnp.where(valid, slot_mapping // ps, P)  # P is out of range -> dropped
    off = jnp.where(valid, slot_mapping % ps, 0)

    flat = values_of(k_cache).ndim == 4  # the stored layout: a token's heads are one row

    def put(cache, x):
        if not is_quantized(cache):
            x = x.reshape(x.shape[0], -1) if flat else x
            return cache.at[layer, page, off].set(x.astype(cache.dtype), mode="drop")
        q, s = quantize(x)  # [T, K, H], [T, K]
        q = q.reshape(q.shape[0], -1) if flat else q
        # Advanced indices split by a slice: the indexed view is [T, K], matching s.
        return QuantizedKV(cache.values.at[layer, page, off].set(q, mode="drop"),
                           cache.scales.at[layer, page, :, off].set(s, mode="drop"))

    return put(k_cache, k), put(v_cache, v)
