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
slicing one layer out first would make XLA copy that layer's whole cache every step. A cache
is either a plain array or an int8 `kv_cache.QuantizedKV` (values + per-token, per-head scales);
the reference dequantizes each chunk to fp32 as it reads it.

Per-sequence metadata for the kernels (`seq_metadata`) is derived here from the per-token
arrays, so every implementation behind the seam takes the same arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache
from pallas_kernels.kv_cache import write_kv  # noqa: F401  (re-exported: the seam's KV write)

_MASKED = -1e30  # finite: a fully masked chunk cannot produce NaN in the online softmax


def validate(q, k_cache, v_cache, positions, token_seq, block_tables,
             kv_chunk_pages: int | None = None) -> tuple[int, int, int, int, int]:
    """Static shape checks every implementation shares; raises ValueError naming the shapes.
    With `kv_chunk_pages`, block_tables' width must be a multiple of it (the chunked loops).
    Returns (T, N, H, page_size, K)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    validate_cache(k_cache, v_cache)
    T, N, H = q.shape
    kc = kv_cache.values_of(k_cache)
    if kc.ndim == 4 and kc.shape[3] % H:
        raise ValueError(f"cache [L, P, page, K * H] {kc.shape}: last dim not a multiple of q's head dim {H}")
    kc = kv_cache.values_of(kv_cache.as_heads(k_cache, H))
    _, _, ps, K, Hc = kc.shape
    if Hc != H:
        raise ValueError(f"head dim of q ({H}) and cache ({Hc}) differ: q {q.shape}, cache {kc.shape}")
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of KV heads {K}: q {q.shape}, cache {kc.shape}")
    if kv_cache.is_quantized(k_cache) and k_cache.scales.shape[2] < K:
        raise ValueError(f"int8 cache: scales {k_cache.scales.shape} hold fewer than the cache's {K} KV heads")
    if positions.shape != (T,) or token_seq.shape != (T,):
        raise ValueError(f"positions {positions.shape} and token_seq {token_seq.shape} must be ({T},)")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, pages], got {block_tables.shape}")
    if kv_chunk_pages is not None and block_tables.shape[1] % kv_chunk_pages:
        raise ValueError(f"block_tables must be [S, pages] with pages a multiple of kv_chunk_pages "
                         f"({kv_chunk_pages}), got {block_tables.shape}")
    return T, N, H, ps, K


def validate_cache(k_cache, v_cache) -> None:
    """Both caches in one format: [L, P, page, K * H] (as stored) or [L, P, page, K, H] arrays,
    or QuantizedKV with int8 values of either shape and scales [L, P, K, page]."""
    if kv_cache.is_quantized(k_cache) != kv_cache.is_quantized(v_cache):
        raise ValueError("k and v caches must both be int8 QuantizedKV or both plain arrays")
    kc, vc = kv_cache.values_of(k_cache), kv_cache.values_of(v_cache)
    if kc.ndim not in (4, 5) or kc.shape != vc.shape:
        raise ValueError(f"k/v caches must both be [L, P, page, K * H] or [L, P, page, K, H], "
                         f"got {kc.shape} and {vc.shape}")
    if kv_cache.is_quantized(k_cache):
        L, P, ps = kc.shape[:3]
        for c in (k_cache, v_cache):
            sc = c.scales
            g = sc.shape[-1] // ps if sc.ndim == 4 and sc.shape[-1] % ps == 0 else 0
            # Paged [L, P, K, page] (g = 1) or lane-dense [L, ceil(P / g), K', g * page]
            # (kv_cache's module doc); validate() checks the heads against q's head dim.
            if c.values.dtype != jnp.int8 or not g or sc.shape[:2] != (L, -(-P // g)):
                raise ValueError(f"int8 cache: values {c.values.shape} {c.values.dtype} need int8 and "
                                 f"scales [L, P, K, page] = {(L, P, 'K', ps)} (or lane-dense [L, P / g, K', "
                                 f"g * page]), got {sc.shape}")
        if k_cache.scales.shape != v_cache.scales.shape:
            raise ValueError(f"k and v scales differ: {k_cache.scales.shape} and {v_cache.scales.shape}")


def seq_metadata(positions, token_seq, num_seqs: int):
    """Per-sequence view of the flat batch, for the kernels.

    Assumes the runner's layout: each sequence's tokens are one contiguous run at consecutive
    positions, runs in row order, padding (position -1) after the last run.
    Returns int32 arrays [num_seqs]: q_start (first flat index), q_len (tokens this step, 0 if
    none), first_pos (position of the first token), kv_len (last position + 1, 0 if none).
    """
    valid = positions >= 0
    seq = jnp.where(valid, token_seq, num_seqs)  # padding -> an extra, dropped segment
    q_len = jax.ops.segment_sum(valid.astype(jnp.int32), seq, num_seqs + 1)[:num_seqs]
    q_start = jnp.cumsum(q_len) - q_len
    kv_len = jax.ops.segment_max(jnp.where(valid, positions + 1, 0), seq, num_seqs + 1)[:num_seqs]
    kv_len = jnp.maximum(kv_len, 0)  # segment_max of an empty segment is the dtype's minimum
    first_pos = jnp.where(q_len > 0, kv_len - q_len, 0)
    return (q_start.astype(jnp.int32), q_len.astype(jnp.int32), first_pos.astype(jnp.int32),
            kv_len.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("sliding_window", "kv_chunk_pages", "soft_cap"))
def ref_ragged_paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables,
                               *, sliding_window: int | None = None, kv_chunk_pages: int = 16,
                               soft_cap: float | None = None):
    """Attention of a flat ragged token batch over a paged KV cache.

    q            [T, N, H]          queries (RoPE applied)
    k_cache      [L, P, page, K * H] keys of every layer (this step's keys already written), as
                 stored, or [L, P, page, K, H]; or QuantizedKV(values int8 of either shape,
                 scales [L, P, K, page])
    v_cache      as k_cache
    layer        int32 scalar       which layer of the caches
    positions    [T] int32          absolute position of each token, -1 for padding
    token_seq    [T] int32          row of block_tables each token belongs to
    block_tables [S, pages] int32   page ids per sequence (unused entries: any valid page)
    sliding_window  keys more than W - 1 positions back are hidden (None = all visible)
    soft_cap        scores pass through soft_cap * tanh(s / soft_cap) before masking (None = off)
    Returns [T, N, H] in q's dtype; padding rows are finite garbage. fp32 softmax.
    """
    validate(q, k_cache, v_cache, positions, token_seq, block_tables, kv_chunk_pages)
    T, N, H = q.shape
    k_cache, v_cache = kv_cache.as_heads(k_cache, H), kv_cache.as_heads(v_cache, H)
    ps, K = kv_cache.values_of(k_cache).shape[2:4]
    G = N // K
    chunk = kv_chunk_pages * ps
    qg = q.reshape(T, K, G, H).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(H)))
    tok_pages = block_tables[jnp.maximum(token_seq, 0)]  # [T, pages]
    n_chunks = (jnp.max(positions) + chunk) // chunk  # chunks covering positions 0..max

    def body(c, carry):
        m, l, acc = carry  # [T, K, G], [T, K, G], [T, K, G, H]
        pages = jax.lax.dynamic_slice_in_dim(tok_pages, c * kv_chunk_pages, kv_chunk_pages, axis=1)
        k = _read_chunk(k_cache, layer, pages).reshape(T, chunk, K, H)
        v = _read_chunk(v_cache, layer, pages).reshape(T, chunk, K, H)
        kv_pos = c * chunk + jnp.arange(chunk)
        visible = kv_pos[None, :] <= positions[:, None]  # [T, C]
        if sliding_window is not None:
            visible &= positions[:, None] - kv_pos[None, :] < sliding_window
        s = jnp.einsum("tkgh,tckh->tkgc", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
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


def _read_chunk(cache, layer, pages):
    """pages [T, n] -> fp32 [T, n, page, K, H] of layer `layer` (dequantized if int8)."""
    if kv_cache.is_quantized(cache):
        ps, K = cache.values.shape[2:4]
        scales = kv_cache.page_scales(cache.scales[layer][None], pages, ps, K)[0]  # [T, n, K, page]
        return kv_cache.dequantize_pages(cache.values[layer, pages], scales)
    return cache[layer, pages].astype(jnp.float32)
