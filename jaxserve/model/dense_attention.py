"""Attention over a plain contiguous per-sequence KV cache: the dense reference path.

Cache layout: KVCache(k, v), each [L, B, S, K, H]; token (b, t) lives at cache[:, b, positions[b, t]].
Padding tokens carry position -1: their K/V writes are dropped and their outputs are garbage
that the caller ignores. This path is deliberately simple (gather nothing, mask everything):
the paged engine must match it token for token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.decoder import KVCache

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


def init_dense_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def attention_reference(q, k_all, v_all, q_pos, kv_pos, sliding_window=None, soft_cap=None):
    """Grouped-query attention with causal masking by absolute position.

    q [B, T, N, H]; k_all, v_all [B, S, K, H]; q_pos [B, T]; kv_pos [B, S] (-1 = empty slot).
    Key s is visible to query t iff 0 <= kv_pos[s] <= q_pos[t] (and within the sliding window).
    `soft_cap`: scaled scores pass through soft_cap * tanh(s / soft_cap) (Gemma 2).
    Returns [B, T, N, H] in q's dtype; scores and softmax in fp32.
    """
    B, T, N, H = q.shape
    K = k_all.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k_all, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(H)))
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    visible = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    if sliding_window is not None:
        visible &= q_pos[:, :, None] - kv_pos[:, None, :] < sliding_window
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_all.dtype), v_all,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, T, N, H).astype(q.dtype)


def make_dense_attend(cfg: ModelConfig):
    """Returns attend(layer, q, k, v, cache, positions) for Decoder.__call__ (meta = positions);
    a layer whose window differs from the config's (Gemma's global layers) passes its own
    `sliding_window`."""

    def attend(layer, q, k, v, cache: KVCache, positions, sliding_window=cfg.sliding_window):
        B, T = positions.shape
        S = cache.k.shape[2]
        # Padding (position -1) is sent out of range and dropped by the scatter.
        slot = jnp.where(positions >= 0, positions, S)
        b_idx = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
        k_cache = cache.k.at[layer, b_idx, slot].set(k.astype(cache.k.dtype), mode="drop")
        v_cache = cache.v.at[layer, b_idx, slot].set(v.astype(cache.v.dtype), mode="drop")
        # A slot is filled iff its index is at or below the highest position written so far
        # in this row; the causal mask (kv_pos <= q_pos) then hides everything not yet written.
        kv_pos = jnp.broadcast_to(jnp.arange(S)[None, :], (B, S))
        out = attention_reference(q, k_cache[layer], v_cache[layer], positions, kv_pos,
                                  sliding_window, cfg.attn_logit_softcap)
        return out, KVCache(k_cache, v_cache)

    return attend
