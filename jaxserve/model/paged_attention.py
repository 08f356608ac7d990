"""Attention over the paged KV cache, for the engine: the model's `attend` on the paged path.

The step is one flat ragged batch, so the model runs with B = 1 and T = every token of the step.
`PagedMeta` carries what the seam needs besides q/k/v; every field is an array argument of the
compiled step, never a Python value, so one executable serves every step of its bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxserve.config import ModelConfig
from jaxserve.model.llama import KVCache
from sharding import ops


class PagedMeta(NamedTuple):
    positions: jax.Array  # [T] int32, -1 = padding
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset; -1 = padding
    token_seq: jax.Array  # [T] int32, row of block_tables of each token
    block_tables: jax.Array  # [S, pages_per_seq] int32


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVCache:
    import jax.numpy as jnp
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def make_paged_attend(cfg: ModelConfig, kv_chunk_pages: int, impl: str = "xla"):
    impl = ops.check_impl(impl)

    def attend(layer, q, k, v, cache: KVCache, meta: PagedMeta):
        # B = 1: the flat batch. Write first so the step's tokens see each other (causally).
        k_cache, v_cache = ops.write_kv(cache.k, cache.v, layer, k[0], v[0], meta.slot_mapping)
        out = ops.paged_attention(q[0], k_cache, v_cache, layer, meta.positions, meta.token_seq,
                                  meta.block_tables, sliding_window=cfg.sliding_window,
                                  kv_chunk_pages=kv_chunk_pages, impl=impl)
        return out[None], KVCache(k_cache, v_cache)

    return attend
