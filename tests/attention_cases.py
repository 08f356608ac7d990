"""Ragged paged-attention cases checked against the dense attention reference, shared by the
tests of every implementation behind the attention seam."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.dense_attention import attention_reference


def ragged_case(impl, rng, seqs, page_size, K, G, H, num_pages, pages_per_seq, window=None,
                dtype=jnp.float32, fill=0.0):
    """seqs: list of (context_len_before_step, new_tokens). Builds caches, a shuffled page
    assignment and the flat batch (3 padding tokens at the end), runs `impl` on them, and
    returns (its output for the real tokens, the dense reference's), both fp32 numpy. `fill`:
    the value of every cache slot no sequence wrote (NaN stands for uninitialised memory)."""
    L, layer = 2, 1
    N = K * G
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 stays unused (null page)
    k_cache = np.full((L, num_pages, page_size, K, H), fill, np.float32)
    v_cache = np.full_like(k_cache, fill)
    block_tables = np.zeros((len(seqs), pages_per_seq), np.int32)
    q_all, pos_all, seq_all, kv_all = [], [], [], []
    next_page = 0
    for s, (ctx, new) in enumerate(seqs):
        total = ctx + new
        n_pages = -(-total // page_size)
        pages = perm[next_page:next_page + n_pages]
        next_page += n_pages
        block_tables[s, :n_pages] = pages
        keys = rng.normal(size=(total, K, H)).astype(np.float32)
        vals = rng.normal(size=(total, K, H)).astype(np.float32)
        for p in range(total):
            k_cache[layer, pages[p // page_size], p % page_size] = keys[p]
            v_cache[layer, pages[p // page_size], p % page_size] = vals[p]
        q = rng.normal(size=(new, N, H)).astype(np.float32)
        qpos = np.arange(ctx, total)
        q_all.append(q), pos_all.append(qpos), seq_all.append(np.full(new, s)), kv_all.append((keys, vals))
    want = _dense_reference(q_all, pos_all, kv_all, window, dtype)
    pad = 3  # padding tokens at the end of the flat batch
    q = np.concatenate(q_all + [np.zeros((pad, N, H), np.float32)])
    positions = np.concatenate(pos_all + [np.full(pad, -1)]).astype(np.int32)
    token_seq = np.concatenate(seq_all + [np.zeros(pad)]).astype(np.int32)
    out = impl(
        jnp.asarray(q, dtype), jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype), layer,
        jnp.asarray(positions), jnp.asarray(token_seq), jnp.asarray(block_tables),
        sliding_window=window, kv_chunk_pages=2)
    n_real = len(q) - pad
    return np.asarray(out[:n_real], np.float32), want


def _dense_reference(q_all, pos_all, kv_all, window, dtype):
    """Every sequence through the dense reference in one batch, padded to the longest (keys
    at position -1 are empty slots, padded queries are dropped): one compile per case, where
    one eager call per sequence compiled each op for every sequence's shapes (seconds a case)."""
    B, T = len(q_all), max(len(q) for q in q_all)
    S = max(len(k) for k, _ in kv_all)
    _, N, H = q_all[0].shape
    K = kv_all[0][0].shape[1]
    q = np.zeros((B, T, N, H), np.float32)
    q_pos = np.zeros((B, T), np.int32)
    k = np.zeros((B, S, K, H), np.float32)
    v = np.zeros((B, S, K, H), np.float32)
    kv_pos = np.full((B, S), -1, np.int32)
    for b, (qb, pb, (kb, vb)) in enumerate(zip(q_all, pos_all, kv_all)):
        q[b, :len(qb)], q_pos[b, :len(pb)] = qb, pb
        k[b, :len(kb)], v[b, :len(vb)], kv_pos[b, :len(kb)] = kb, vb, np.arange(len(kb))
    out = jax.jit(attention_reference, static_argnums=5)(
        *(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(q_pos), jnp.asarray(kv_pos), window)
    out = np.asarray(out, np.float32)
    return np.concatenate([out[b, :len(qb)] for b, qb in enumerate(q_all)])
