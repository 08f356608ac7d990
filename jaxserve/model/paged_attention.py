"""Attention over the paged KV cache, for the engine: the model's `attend` on the paged path.

The step is one flat ragged batch, so the model runs with B = 1 and T = every token of the step.
`PagedMeta` carries what the seam needs besides q/k/v; every field is an array argument of the
compiled step, never a Python value, so one executable serves every step of its bucket.

The cache is KVCache(k, v) with each side either a [L, P, page, K * H] array in the model dtype
(kv_cache_dtype "auto") or, with kv_cache_dtype "int8", a QuantizedKV: int8 values of the same
shape plus bf16 scales [L, P, K, page], one per token and KV head (pallas_kernels/kv_cache.py).
The write quantizes, the attention implementations dequantize as they read.

A model mixing full and sliding layers (Gemma 2 / 3: ModelConfig.kv_groups) keeps two such
caches, `GroupedKV`: the full layers' [L_full, P, ...] and the sliding layers' [L_sliding,
P_sliding, ...], each with its own pages, slot mapping and block tables (the scheduler frees
the sliding group's pages behind the window, scheduler/window.py). `attend` picks a layer's
group from its static window and its index inside the group from a constant table; the
kernels are unchanged (one layer's cache, one block table). A one-group model's cache and
step are exactly what they were.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import KV_CACHE_DTYPES, ModelConfig
from jaxserve.model.decoder import KVCache
from sharding import backends, ops
from sharding.ops import kv_cache


# XLA:CPU before jax 0.12 computes 16-bit floats in fp32 and, for a gather from or a scatter into
# a bf16 / fp16 array, widened the whole array: the step's one-token write into the KV cache and
# each read of its pages converted every layer's cache to fp32 and back, per layer. Measured on
# SmolLM2 (2-core Xeon, 512 MiB KV pool, batch-1 decode step): with jax 0.10.2 --dtype bfloat16
# 5.0 s against 0.02 s in float32, --kv-cache-dtype int8 (bf16 scales) 0.14 s; with jax 0.12.0.1
# 0.05 s and 0.03 s. tests/test_kv_widening.py checks that this warning is said exactly where the
# compiled step widens the cache. jaxserve/loading.py's bf16-weights warning takes the same
# version: jax 0.10's 16-bit dots on the CPU are as slow.
SLOW_16BIT_CPU_BEFORE = (0, 12)


def kv_widening_warning(platform: str, kv_dtype, jax_version: tuple = jax.__version_info__) -> str | None:
    """Why a KV cache of `kv_dtype` ("int8": its bf16 scales) would be slow on this platform and
    jax, or None. Said once at start-up by make_paged_attend."""
    if platform != "cpu" or tuple(jax_version[:2]) >= SLOW_16BIT_CPU_BEFORE:
        return None
    int8 = isinstance(kv_dtype, str) and kv_dtype == "int8"
    if not int8 and jnp.dtype(kv_dtype).itemsize != 2:
        return None
    what = "int8 KV cache's bf16 scales are" if int8 else f"{jnp.dtype(kv_dtype).name} KV cache is"
    return (f"this {what} widened to float32 whole, every layer of every step, by jax "
            f"{'.'.join(map(str, jax_version))}'s XLA:CPU (jax >= 0.12 does not; a SmolLM2 decode step measured "
            f"{'0.14' if int8 else '5'} s against 0.02 s in float32): on this jax use --dtype float32 and "
            f"--kv-cache-dtype auto, or run jax >= 0.12 (Python >= 3.12, `make test-jax-current`'s pins)")


class PagedMeta(NamedTuple):
    positions: jax.Array  # [T] int32, -1 = padding
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset; -1 = padding
    token_seq: jax.Array  # [T] int32, row of block_tables of each token
    block_tables: jax.Array  # [S, pages_per_seq] int32
    # Two KV groups only (GroupedKV): the sliding layers' slots and block tables, as above.
    sliding_slot_mapping: jax.Array | None = None  # [T] int32
    sliding_block_tables: jax.Array | None = None  # [S, pages_per_seq] int32


class GroupedKV(NamedTuple):
    """The KV of a two-group model (module doc): each group a KVCache over its own layers (in
    ModelConfig.kv_groups order) and its own pages."""

    full: KVCache
    sliding: KVCache


def cache_dtype(kv_cache_dtype: str, model_dtype):
    """What the cache stores: the model dtype ("auto") or "int8"."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} not in {KV_CACHE_DTYPES}")
    return model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype,
                     kv_cache_dtype: str = "auto", num_sliding_pages: int = 0, *,
                     lane_dense_scales: bool = False, shards: int = 1) -> KVCache | GroupedKV:
    """Zero pages for every layer; `dtype` is the model's, `kv_cache_dtype` "int8" quantizes.
    `num_sliding_pages` > 0 (a two-group model): a GroupedKV, `num_pages` for the full layers.
    `lane_dense_scales`: int8 scales in the TPU kernel's layout, heads split over `shards`
    devices (pallas_kernels/kv_cache.py; `lane_dense_scales(impl)` says which backends read it)."""
    def cache(num_layers, pages):
        return KVCache(*kv_cache.init_cache(num_layers, pages, page_size, cfg.num_kv_heads,
                                            cfg.head_dim, cache_dtype(kv_cache_dtype, dtype),
                                            lane_dense_scales=lane_dense_scales, shards=shards))
    if not num_sliding_pages:
        return cache(cfg.num_layers, num_pages)
    groups = cfg.kv_groups()
    if len(groups) != 2:
        raise ValueError(f"num_sliding_pages={num_sliding_pages}: the model's layers form one KV group "
                         f"(layer windows {cfg.layer_windows()})")
    return GroupedKV(cache(len(groups[0]), num_pages), cache(len(groups[1]), num_sliding_pages))


def index_in_group(cfg: ModelConfig) -> np.ndarray:
    """[L] int32: each layer's index inside its KV group's cache (ModelConfig.kv_groups)."""
    out = np.zeros(cfg.num_layers, np.int32)
    for group in cfg.kv_groups():
        out[list(group)] = np.arange(len(group))
    return out


def lane_dense_scales(impl_name: str) -> bool:
    """Whether the attention backend `impl_name` (a resolved name) reads int8 scales lane-dense:
    the TPU kernel (and its interpret mode); every other backend reads them paged."""
    return impl_name in ("pallas_tpu", "pallas_tpu_interpret")


def make_paged_attend(cfg: ModelConfig, kv_chunk_pages: int, impl: str = "xla", *,
                      page_size: int | None = None, dtype=None, kv_cache_dtype: str = "auto",
                      max_decode_run: int = 1):
    """The model's attend on the paged cache: the attention backend `impl` resolved here, once
    (sharding/ops.py's table), and its callable closed over. With `page_size` and the model
    `dtype` given, the backend's support for this model is checked here too, at start-up.
    `max_decode_run`: 1 + the speculative draft length (see ops.paged_attention)."""
    kv_dtype = None if dtype is None else cache_dtype(kv_cache_dtype, dtype)
    check = {}
    if page_size is not None and kv_dtype is not None:
        check = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     page_size=page_size, q_dtype=dtype, kv_dtype=kv_dtype)
    backend = ops.resolve(impl, **check)
    if kv_dtype is not None:
        why = kv_widening_warning(backends.target_platform(), kv_dtype)
        if why is not None:
            backends.warn_once("jaxserve.attention", why)
    kernel = backend.fn
    in_group = index_in_group(cfg)

    def one_group(layer, q, k, v, cache: KVCache, slots, tables, meta: PagedMeta, sliding_window):
        # B = 1: the flat batch. Write first so the step's tokens see each other (causally).
        k_cache, v_cache = ops.write_kv(cache.k, cache.v, layer, k[0], v[0], slots)
        out = kernel(q[0], k_cache, v_cache, layer, meta.positions, meta.token_seq, tables,
                     sliding_window=sliding_window, soft_cap=cfg.attn_logit_softcap,
                     kv_chunk_pages=kv_chunk_pages, max_decode_run=max_decode_run)
        return out[None], KVCache(k_cache, v_cache)

    def attend(layer, q, k, v, cache: KVCache | GroupedKV, meta: PagedMeta, sliding_window=cfg.sliding_window):
        # `sliding_window`: a layer's own (Gemma's global layers pass None); static, so with
        # two groups it also picks the layer's group at trace time.
        if not isinstance(cache, GroupedKV):
            return one_group(layer, q, k, v, cache, meta.slot_mapping, meta.block_tables, meta, sliding_window)
        idx = jnp.asarray(in_group)[layer]  # `layer` may be traced (the decoder's scan)
        if sliding_window is None:
            out, full = one_group(idx, q, k, v, cache.full, meta.slot_mapping, meta.block_tables, meta, None)
            return out, cache._replace(full=full)
        out, sliding = one_group(idx, q, k, v, cache.sliding, meta.sliding_slot_mapping,
                                 meta.sliding_block_tables, meta, sliding_window)
        return out, cache._replace(sliding=sliding)

    attend.lane_dense_scales = lane_dense_scales(backend.name)  # the cache layout this attend reads
    return attend
