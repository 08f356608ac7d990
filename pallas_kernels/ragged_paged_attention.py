"""Ragged paged attention: the pure-jnp reference (`ref_ragged_paged_attention`) and the KV write.

One step's tokens form one flat ragged batch: decode tokens and prefill chunks of many
sequences, concatenated. Token t belongs to sequence `token_seq[t]`, sits at absolute position
`positions[t]` (-1 = padding), and attends to its sequence's keys at positions
0 .. positions[t] (and, with a sliding window W, only the last W of them). A sequence's keys
live in the pages listed in its row of `block_tables`; key position p is slot p % page_size of
page block_tables[s, p // page_size].

The reference walks the KV in chunks of `kv_chunk_pages` pages with an online softmax
(flash-decoding's recurrence), for as many chunks as the longest context in the step needs:
a dynamic trip count, so short batches read little and nothing depends on a context bucket.
Each token gathers its own sequence's pages, which is plain and obviously right; the Pallas
kernels (TPU/GPU) plug in beside it behind sharding.ops with the same signature.

Caches hold every layer, [L, P, page_size, K, H], and take the layer index as an argument:
slicing one layer out first would make XLA copy that layer's whole cache every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite: a fully masked chunk cannot produce NaN in the online softmax


def validate(q, k_cache, v_cache, positions, token_seq, block_tables, kv_chunk_pages: int) -> None:
    """Static shape checks; raises ValueError naming the shapes."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must both be [L, P, page, K, H], got {k_cache.shape} and {v_cache.shape}")
    T, N, H = q.shape
    K = k_cache.shape[3]
    if k_cache.shape[4] != H:
        raise ValueError(f"head dim of q ({H}) and cache ({k_cache.shape[4]}) differ")
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of KV heads {K}")
    if positions.shape != (T,) or token_seq.shape != (T,):
        raise ValueError(f"positions {positions.shape} and token_seq {token_seq.shape} must be ({T},)")
    if block_tables.ndim != 2 or block_tables.shape[1] % kv_chunk_pages:
        raise ValueError(f"block_tables must be [S, pages] with pages a multiple of kv_chunk_pages "
                         f"({kv_chunk_pages}), got {block_tables.shape}")


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Scatter the step's new K/V [T, K, H] into slot_mapping[t] = page * page_size + offset
    of layer `layer`; slot -1 (padding) is dropped. Returns the updated caches."""
    L, P, ps = k_cache.shape[:3]
    valid = slot_mapping >= 0
    page = jnp.where(valid, slot_mapping // ps, P)  # P is out of range -> dropped
    off = jnp.where(valid, slot_mapping % ps, 0)
    k_cache = k_cache.at[layer, page, off].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, page, off].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("sliding_window", "kv_chunk_pages"))
def ref_ragged_paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables,
                               *, sliding_window: int | None = None, kv_chunk_pages: int = 16):
    """Attention of a flat ragged token batch over a paged KV cache.

    q            [T, N, H]          queries (RoPE applied)
    k_cache      [L, P, page, K, H] keys of every layer (this step's keys already written)
    v_cache      [L, P, page, K, H]
    layer        int32 scalar       which layer of the caches
    positions    [T] int32          absolute position of each token, -1 for padding
    token_seq    [T] int32          row of block_tables each token belongs to
    block_tables [S, pages] int32   page ids per sequence (unused entries: any valid page)
    Returns [T, N, H] in q's dtype; padding rows are finite garbage. fp32 softmax.
    """
    validate(q, k_cache, v_cache, positions, token_seq, block_tables, kv_chunk_pages)
    T, N, H = q.shape
    ps, K = k_cache.shape[2], k_cache.shape[3]
    G = N // K
    chunk = kv_chunk_pages * ps
    qg = q.reshape(T, K, G, H).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(H)))
    tok_pages = block_tables[jnp.maximum(token_seq, 0)]  # [T, pages]
    n_chunks = (jnp.max(positions) + chunk) // chunk  # chunks covering positions 0..max

    def body(c, carry):
        m, l, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tok_pages, c * kv_chunk_pages, kv_chunk_pages, axis=1)
        k = k_cache[layer, pages].reshape(T, chunk, K, H).astype(jnp.float32)
        v = v_cache[layer, pages].reshape(T, chunk, K, H).astype(jnp.float32)
        kv_pos = c * chunk + jnp.arange(chunk)
        visible = kv_pos[None, :] <= positions[:, None]  # [T, C]
        if sliding_window is not None:
            visible &= positions[:, None] - kv_pos[None, :] < sliding_window
        s = jnp.einsum("tkgh,tckh->tkgc", qg, k)
        s = jnp.where(visible[:, None, None, :], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(axis=-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgc,tckh->tkgh", p, v)
        return m_new, l, acc

    init = (jnp.full((T, K, G), _MASKED, jnp.float32), jnp.zeros((T, K, G), jnp.float32),
            jnp.zeros((T, K, G, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(T, N, H).astype(q.dtype)
