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

Scales on TPU are stored lane-dense instead (`init_cache(lane_dense_scales=True)`, what the
runner asks for when the TPU kernel reads the cache): [L, ceil(P / g), K', g * page] with g =
128 / page pages side by side in one 128-lane row (g = 1 for pages of 128 or more) and K' the
KV heads a device holds padded to 2, 4 or a multiple of 8. libtpu lays a bf16 array out
row-major only when its last dimension fills 128 lanes and its second-last is one of those
head counts; [L, P, K, page] at page 16 gets another layout, which the kernel (row-major by
Mosaic's rule) and the step's scatter do not take, so XLA:TPU copied the whole scale array
of every layer twice per layer and step (`jaxserve compile` found it: Qwen3-30B-A3B with int8
KV needed 32 GiB of temporaries on a 32 GiB v6e). The kernel DMAs a page's whole row (g
pages' scales: a DMA moves whole tiles) and rotates its page to lane 0. The paged layout is
the g = 1, K' = K case of the same geometry (`scale_geometry`): every function here takes
either, and the other attention paths take the paged one only.
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


def is_cache_side(x) -> bool:
    """A tree.map leaf test that stops at one side of a cache (K or V) in either format, so a
    QuantizedKV is handled whole (its values and scales have different page geometry)."""
    return is_quantized(x) or hasattr(x, "ndim")


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


SCALE_LANES = 128  # a TPU vreg's lanes: the lane-dense scale row's width


def padded_scale_heads(k: int) -> int:
    """The scale heads a device stores for its k KV heads in the lane-dense layout: 2, 4 or a
    multiple of 8, the second-last dims libtpu keeps row-major under a 128-lane last dim
    (1 and 3 it lays out transposed, which is the copy this layout exists to avoid)."""
    return 2 if k <= 2 else 4 if k <= 4 else -(-k // 8) * 8


def scale_shape(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, *,
                lane_dense: bool = False, shards: int = 1) -> tuple[int, int, int, int]:
    """The scales array of one side (K or V): paged [L, P, K, page], or lane-dense [L,
    ceil(P / g), shards * K', g * page] (module doc) with K' per shard of `shards` devices
    splitting the heads (tensor parallelism, sharding.rules.cache_spec's axis 2)."""
    if not lane_dense:
        return (num_layers, num_pages, num_kv_heads, page_size)
    if num_kv_heads % shards:
        raise ValueError(f"int8 KV scales: {num_kv_heads} KV heads do not split over {shards} devices")
    if page_size < SCALE_LANES and SCALE_LANES % page_size:
        raise ValueError(f"page_size {page_size}: the TPU int8 cache needs a page size dividing "
                         f"{SCALE_LANES} or a multiple of it")
    g = max(1, SCALE_LANES // page_size)
    return (num_layers, -(-num_pages // g), shards * padded_scale_heads(num_kv_heads // shards), g * page_size)


def scale_geometry(scales: jax.Array, page_size: int) -> tuple[int, int]:
    """(g, K'): pages per scale row and scale heads per row of a scales array (either layout;
    the paged one is g = 1, K' = K)."""
    return scales.shape[-1] // page_size, scales.shape[2]


def page_scales(scales: jax.Array, pages: jax.Array, page_size: int, num_kv_heads: int | None = None):
    """The scales of `pages` (int array, any shape) of every layer: [L, *pages.shape, K, page]
    from either layout; `num_kv_heads` drops a lane-dense array's padding heads (None: keep)."""
    g, _ = scale_geometry(scales, page_size)
    if g == 1:
        out = jnp.take(scales, pages, axis=1)
    else:
        rows = jnp.take(scales, pages // g, axis=1)  # [L, *pages, K', g * page]
        lanes = ((pages % g) * page_size)[..., None] + jnp.arange(page_size)  # [*pages, page]
        idx = jnp.broadcast_to(lanes[None, ..., None, :], rows.shape[:-1] + (page_size,))
        out = jnp.take_along_axis(rows, idx, axis=-1)
    return out if num_kv_heads is None else out[..., :num_kv_heads, :]


def to_lane_dense(scales: jax.Array, shards: int = 1) -> jax.Array:
    """Paged scales [L, P, K, page] in the lane-dense layout of scale_shape(lane_dense=True):
    the same values, padding pages and heads zero (tests and scripts build caches this way)."""
    L, P, K, ps = scales.shape
    _, R, Kp, W = scale_shape(L, P, ps, K, lane_dense=True, shards=shards)
    g, kp = W // ps, Kp // shards
    x = jnp.pad(scales, ((0, 0), (0, R * g - P), (0, 0), (0, 0)))
    x = x.reshape(L, R * g, shards, K // shards, ps)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, kp - K // shards), (0, 0))).reshape(L, R, g, Kp, ps)
    return jnp.swapaxes(x, 2, 3).reshape(L, R, Kp, W)


def check_paged_scales(k_cache, num_kv_heads: int, who: str) -> None:
    """Raise unless an int8 cache's scales are paged [L, P, K, page]: what every attention path
    but the TPU kernel reads (the lane-dense layout is made only for that kernel)."""
    if is_quantized(k_cache):
        ps = k_cache.values.shape[2]
        if scale_geometry(k_cache.scales, ps) != (1, num_kv_heads):
            raise ValueError(f"{who} reads int8 scales paged [L, P, K, page] = (.., {num_kv_heads}, {ps}); got "
                             f"{k_cache.scales.shape}, the TPU kernel's lane-dense layout")


def put_page_scales(scales: jax.Array, pages: jax.Array, data: jax.Array, page_size: int) -> jax.Array:
    """`scales` with `data` [L, n, K', page] (what page_scales(pages) returned, all heads)
    written into pages [n]; either layout."""
    g, _ = scale_geometry(scales, page_size)
    data = data.astype(scales.dtype)
    if g == 1:
        return scales.at[:, pages].set(data)
    rows = jnp.broadcast_to((pages // g)[:, None], (pages.shape[0], page_size))
    lanes = ((pages % g) * page_size)[:, None] + jnp.arange(page_size)
    # Advanced indices split by a slice put their [n, page] dims first: [n, page, L, K'].
    return scales.at[:, rows, :, lanes].set(jnp.transpose(data, (1, 3, 0, 2)))


def init_cache(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype, *, lane_dense_scales: bool = False, shards: int = 1) -> tuple:
    """(k_cache, v_cache), zero-filled, values stored [L, P, page, K * H] (heads side by side,
    the TPU kernel's layout: no relayout copy of the cache on any call; the other paths view
    it [L, P, page, K, H] through as_heads, free outside TPU). dtype "int8" builds QuantizedKV,
    its scales paged or, with `lane_dense_scales`, lane-dense over `shards` devices (module doc)."""
    shape = (num_layers, num_pages, page_size, num_kv_heads * head_dim)
    if isinstance(dtype, str) and dtype == "int8":
        sshape = scale_shape(num_layers, num_pages, page_size, num_kv_heads, lane_dense=lane_dense_scales,
                             shards=shards)
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
        g, kp = scale_geometry(cache.scales, ps)
        # Lane-dense scales: page p's token o is lane (p % g) * page + o of row p // g; the
        # padding heads get zeros (never read). Dropped rows point past the last row.
        row = jnp.where(valid, page // g, cache.scales.shape[1])
        lane = (page % g) * ps + off
        s = jnp.pad(s, ((0, 0), (0, kp - s.shape[1])))
        # Advanced indices split by a slice: the indexed view is [T, K'], matching s.
        return QuantizedKV(cache.values.at[layer, page, off].set(q, mode="drop"),
                           cache.scales.at[layer, row, :, lane].set(s, mode="drop"))

    return put(k_cache, k), put(v_cache, v)
