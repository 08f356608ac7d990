"""The attention seam: every paged-attention call of the model goes through here.

`paged_attention` picks the implementation by `impl`:
  "xla"  the pure-jnp reference in pallas_kernels.ragged_paged_attention (runs everywhere;
         the CPU path of development and CI).
Pallas kernels (TPU Mosaic, GPU) will plug in here under their own names. There is no silent
fallback: asking for an implementation that does not exist is an error at start-up, naming it.
Sharding of these calls over a device mesh (shard_map) also belongs here.
"""

from __future__ import annotations

from pallas_kernels import ragged_paged_attention as rpa

ATTENTION_IMPLS = ("xla",)


def check_impl(impl: str) -> str:
    if impl == "auto":
        return "xla"
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl {impl!r} is not available; choose one of {ATTENTION_IMPLS} or 'auto'")
    return impl


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Write the step's new K/V [T, K, H] into the paged caches at slot_mapping [T] (-1 = skip)."""
    return rpa.write_kv(k_cache, v_cache, layer, k, v, slot_mapping)


def paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                    sliding_window=None, kv_chunk_pages=16, impl="xla"):
    """q [T, N, H] over caches [L, P, page, K, H]; see ref_ragged_paged_attention for shapes."""
    impl = check_impl(impl)
    return rpa.ref_ragged_paged_attention(q, k_cache, v_cache, layer, positions, token_seq,
                                          block_tables, sliding_window=sliding_window,
                                          kv_chunk_pages=kv_chunk_pages)
