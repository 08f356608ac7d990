"""Ragged paged attention in plain XLA that reads each sequence's KV once per query block:
the CPU production path ("xla" behind sharding.ops).

Same contract as `reference.ref_ragged_paged_attention` (the per-token
reference, which stays the definition every implementation is tested against). The
reference gathers a token's whole KV chunk list for every token, so a 512-token prefill
chunk copies its sequence's KV 512 times and padding tokens gather too: on this CPU that
made a 512-token step take seconds against ~0.1 s of matmuls. Here the step splits in two:

  decode rows   sequences with one token this step, flash-decoding style: every (row, KV
                chunk of `decode_chunk_tokens`) pair the row can see is one work item; a loop
                takes `decode_items` items at a time, gathers their pages, computes each
                item's partial softmax (max, sum, weighted values) and folds the partials
                into their rows' running softmax. So the work is the KV the rows actually
                have, not the longest row's times the number of rows;
  query blocks  sequences with several tokens (prefill chunks): their run of queries is cut
                into blocks of `q_block` tokens; a loop over blocks (trip count = blocks in
                this step) gathers the block's sequence's pages once per KV chunk, for only
                the chunks its last query can see (and, with a sliding window, from the
                first chunk its first query can see).
Padding tokens are in neither: they come out as zeros. Everything is fp32 with an online
softmax (flash attention's recurrence), like the reference.

Layout, measured on the 2-core CPU (XLA:CPU), each choice against the alternatives:
- pages are read with one flat index into the cache seen as [L * P, page, K, H]: a gather
  indexed by (layer, page) was 3-6x slower for the same bytes;
- decode items multiply-and-sum over the gathered [B, C, K, H] layout (fused loops); the
  einsum "skgh,sckh->skgc", with the KV head in the middle, made XLA transpose each gathered
  chunk first (4-7 ms against 0.7 ms for a 48-row, 256-key product);
- query blocks transpose each gathered chunk to [K, C, H] (small) and run batch-leading
  matmuls over the KV heads ("kmh,kch->kmc"), one op for every head rather than one each,
  which also keeps compile time down.
Decode attention of 48 rows (workload contexts, SmolLM2's 30 layers) went from 1.05 s with
all rows looping to the longest row's chunks to ~0.2 s.

Both parts rely on the runner's layout (see `seq_metadata`): each sequence's tokens are one
contiguous run at consecutive positions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import reference as rpa

_MASKED = -1e30  # finite, as in the reference: a fully masked chunk cannot make NaN
# Decode items with at least this many query heads per KV head (speculative runs: tokens x G)
# multiply as batched matmuls; fewer multiply-and-sum in place. Measured on the 2-core CPU,
# 30 layers, 30 rows at the workload's contexts: 8-token runs (24 queries per KV head) took
# 602-669 ms multiply-and-sum against 408-423 ms as matmuls; 4-token runs (12) ~equal;
# plain decodes (3) are faster multiply-and-sum (see _decode_rows).
_MATMUL_MIN_QUERIES = 12


@functools.partial(jax.jit, static_argnames=("sliding_window", "kv_chunk_pages", "soft_cap", "q_block",
                                             "decode_chunk_tokens", "decode_items", "decode_queries"))
def blocked_ragged_paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables,
                                   *, sliding_window: int | None = None, kv_chunk_pages: int = 16,
                                   soft_cap: float | None = None, q_block: int = 128,
                                   decode_chunk_tokens: int = 32, decode_items: int = 64,
                                   decode_queries: int = 1):
    """q [T, N, H] over caches [L, P, page, K * H] or [L, P, page, K, H] (or int8 QuantizedKV); every argument as in
    ref_ragged_paged_attention. `q_block`: queries per block of a multi-token run;
    `decode_chunk_tokens` (rounded to whole pages dividing kv_chunk_pages) and
    `decode_items`: the decode work items' size and how many run at once;
    `decode_queries`: runs of up to this many tokens take the decode path (a speculative
    decoding step verifies 1 + draft tokens per row): runs of 2..decode_queries tokens in a
    second, wide pass that gives every row that many query slots; 1 = no wide pass.
    Returns [T, N, H] in q's dtype; padding rows are zeros."""
    K = rpa.validate(q, k_cache, v_cache, positions, token_seq, block_tables, kv_chunk_pages)[4]
    kv_cache.check_paged_scales(k_cache, K, "attention_impl 'xla'")
    T, N, H = q.shape
    k_cache, v_cache = kv_cache.as_heads(k_cache, H), kv_cache.as_heads(v_cache, H)  # free off TPU
    S = block_tables.shape[0]
    ps, K = kv_cache.values_of(k_cache).shape[2:4]
    G = N // K
    # [K, T, G, H]: each KV head's queries contiguous.
    qh = jnp.transpose(q.reshape(T, K, G, H), (1, 0, 2, 3)).astype(jnp.float32) * (1.0 / jnp.sqrt(jnp.float32(H)))
    q_start, q_len, first_pos, kv_len = rpa.seq_metadata(positions, token_seq, S)
    kw = dict(k_cache=k_cache, v_cache=v_cache, layer=layer, sliding_window=sliding_window,
              soft_cap=soft_cap)

    # Decode rows: sequences with 1 token this step; with decode_queries = Qd > 1 also a
    # second pass over sequences with 2..Qd tokens (a decode token and its drafts), each row's
    # queries stacked as Qd * G query heads per KV head. Two passes, because a row of the wide
    # pass multiplies Qd times the queries: plain decodes (every decode of a step that also
    # prefills) stay narrow. A pass with no rows runs no items.
    item_pages = math.gcd(kv_chunk_pages, max(1, decode_chunk_tokens // ps))
    qb = min(q_block, T)
    out = jnp.zeros((K, T + qb, G, H), jnp.float32)  # qb spare rows: a block's slice never runs off
    passes = [(1, 1)] + ([(2, decode_queries)] if decode_queries > 1 else [])
    for shortest, Qd in passes:
        j = jnp.arange(Qd)
        tok = q_start[:, None] + j  # [S, Qd]: slot j of row s is token q_start + j
        real = ((q_len >= shortest) & (q_len <= Qd))[:, None] & (j < q_len[:, None])
        q_rows = qh[:, jnp.clip(tok, 0, T - 1)]  # [K, S, Qd, G, H]
        q_rows = jnp.transpose(q_rows, (1, 0, 2, 3, 4)).reshape(S, K, Qd * G, H)
        slot_pos = jnp.where(real, first_pos[:, None] + j, -1)  # -1: this slot has no work
        # Small buckets take fewer items at a time: a batch of 64 items for one decode row
        # would gather and multiply 62 empty items per layer (batch-1 decode fell from 80% to
        # 50% of its bandwidth ceiling that way).
        decoded = _decode_rows(q_rows, slot_pos, block_tables, item_pages=item_pages,
                               batch=min(decode_items, 4 * S), **kw)  # [S, K, Qd * G, H]
        decoded = jnp.transpose(decoded.reshape(S, K, Qd, G, H), (1, 0, 2, 3, 4)).reshape(K, S * Qd, G, H)
        # Slots that are not this pass's tokens go to spare row T.
        out = out.at[:, jnp.where(real, tok, T).reshape(-1)].set(decoded)

    # Query blocks of the longer runs, written over the same output.
    nblk = jnp.where(q_len > decode_queries, (q_len + qb - 1) // qb, 0)
    blk_end = jnp.cumsum(nblk)
    blk_begin = blk_end - nblk
    q_pad = jnp.concatenate([qh, jnp.zeros((K, qb, G, H), jnp.float32)], axis=1)

    def one_block(b, out):
        s = jnp.searchsorted(blk_end, b, side="right", method="compare_all")
        off = (b - blk_begin[s]) * qb
        start = q_start[s] + off
        rows = off + jnp.arange(qb)
        valid = rows < q_len[s]
        pos = jnp.where(valid, first_pos[s] + rows, -1)
        res = _query_block(jax.lax.dynamic_slice_in_dim(q_pad, start, qb, axis=1), pos, block_tables[s],
                           kv_chunk_pages=kv_chunk_pages, **kw)
        old = jax.lax.dynamic_slice_in_dim(out, start, qb, axis=1)
        new = jnp.where(valid[None, :, None, None], res, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, axis=1)

    out = jax.lax.fori_loop(0, blk_end[-1], one_block, out)[:, :T]
    return jnp.transpose(out, (1, 0, 2, 3)).reshape(T, N, H).astype(q.dtype)


def _scores(s, visible, soft_cap):
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return jnp.where(visible, s, _MASKED)


def _visible(kv_pos, pos, sliding_window):
    """kv_pos [..., C], pos [...] -> [..., C]: the keys each query sees (causal, windowed)."""
    vis = kv_pos <= pos[..., None]
    if sliding_window is not None:
        vis &= pos[..., None] - kv_pos < sliding_window
    return vis


def _first_chunk(pos, chunk, sliding_window):
    """The first KV chunk a query at `pos` sees: 0, or where its sliding window starts."""
    if sliding_window is None:
        return jnp.zeros_like(pos)
    return jnp.maximum(pos - sliding_window + 1, 0) // chunk


def _decode_rows(q_rows, q_pos, block_tables, *, item_pages, batch, k_cache, v_cache, layer,
                 sliding_window, soft_cap):
    """q_rows [S, K, Qd * G, H]: row s's Qd query slots (G query heads per KV head each), at
    positions q_pos [S, Qd] (-1 = no query), over block_tables[s]. Returns [S, K, Qd * G, H]
    (slots without work: finite garbage; rows without work: zeros).

    Items are small ([batch, item_pages pages] per gather), so with few query heads per KV
    head the products are written as broadcast-multiply-and-sum over the gathered
    [B, C, K, H] layout: XLA fuses each into one loop over the keys, with no transposed copy
    (measured best of einsum / per-head forms); from _MATMUL_MIN_QUERIES on they run as
    batched matmuls. A row's items run from the chunk its earliest query's window starts in to the chunk of
    its latest query; an item a query cannot see gets weight exp(-1e30 - m) = 0 once any
    visible key is folded in, and every query sees at least its own key."""
    S, K, M, H = q_rows.shape
    Qd = q_pos.shape[1]
    C = item_pages * kv_cache.values_of(k_cache).shape[2]
    row_last = jnp.max(q_pos, axis=1)  # -1: the row has no work
    row_first = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
    first = jnp.where(row_last >= 0, _first_chunk(row_first, C, sliding_window), 0)
    n_items = jnp.where(row_last >= 0, row_last // C + 1 - first, 0)
    item_end = jnp.cumsum(n_items)
    item_begin = item_end - n_items

    def body(b, carry):
        idx = b * batch + jnp.arange(batch)
        row = jnp.minimum(jnp.searchsorted(item_end, idx, side="right", method="compare_all"), S - 1)
        real = idx < item_end[-1]
        seg = jnp.where(real, row, S)  # segment S: the dropped sink of unreal items
        chunk = first[row] + idx - item_begin[row]
        pages = block_tables[row[:, None], chunk[:, None] * item_pages + jnp.arange(item_pages)]  # [B, n]
        kv_pos = chunk[:, None] * C + jnp.arange(C)  # [B, C]
        vis = jnp.swapaxes(_visible(kv_pos[:, None, :], q_pos[row], sliding_window), 1, 2)  # [B, C, Qd]
        vis &= real[:, None, None]
        k = _read_pages(k_cache, layer, pages).reshape(batch, C, K, H)
        v = _read_pages(v_cache, layer, pages).reshape(batch, C, K, H)
        if M >= _MATMUL_MIN_QUERIES:
            s = jnp.einsum("bkmh,bckh->bckm", q_rows[row], k)
        else:
            s = _dot_last(k[:, :, :, None, :], q_rows[row][:, None])  # [B, C, K, M]
        s = _scores(s.reshape(batch, C, K, Qd, M // Qd), vis[:, :, None, :, None], soft_cap).reshape(batch, C, K, M)
        m_i = s.max(axis=1)  # [B, K, M]
        p = jnp.exp(s - m_i[:, None])
        l_i = p.sum(axis=1)
        if M >= _MATMUL_MIN_QUERIES:
            a_i = jnp.einsum("bckm,bckh->bkmh", p, v)
        else:
            a_i = (p[..., None] * v[:, :, :, None, :]).sum(axis=1)  # [B, K, M, H]
        # Fold this batch's partials into their rows (a row may own several items here).
        seg_max = jax.ops.segment_max(m_i, seg, S + 1)[:S]  # rows without items: -inf
        w = jnp.exp(m_i - seg_max[row])
        l_b = jax.ops.segment_sum(l_i * w, seg, S + 1)[:S]
        a_b = jax.ops.segment_sum(a_i * w[..., None], seg, S + 1)[:S]
        m_run, l_run, a_run = carry
        m_new = jnp.maximum(m_run, seg_max)
        c_run, c_b = jnp.exp(m_run - m_new), jnp.exp(seg_max - m_new)
        return m_new, l_run * c_run + l_b * c_b, a_run * c_run[..., None] + a_b * c_b[..., None]

    init = (jnp.full((S, K, M), _MASKED, jnp.float32), jnp.zeros((S, K, M), jnp.float32),
            jnp.zeros((S, K, M, H), jnp.float32))
    n_batches = (item_end[-1] + batch - 1) // batch
    _, l, acc = jax.lax.fori_loop(0, n_batches, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _dot_last(a, b):
    """sum(a * b, axis=-1), in pieces of at most 32 along that axis. XLA:CPU rewrites a longer
    sum into a reduce-window over 32-wide windows plus a second reduce, which cannot fuse the
    multiply: the whole [B, C, K, G, H] product was written out and read back. Two sums of 32
    keep it one fused loop; decode attention of 48 rows (30 layers) measured ~225 -> ~185 ms
    (medians of three A/B pairs)."""
    H = a.shape[-1]
    if H <= 32 or H % 32:
        return (a * b).sum(axis=-1)
    split = lambda x: x.reshape(x.shape[:-1] + (H // 32, 32))  # noqa: E731
    return (split(a) * split(b)).sum(axis=-1).sum(axis=-1)


def _query_block(qblk, pos, table, *, kv_chunk_pages, k_cache, v_cache, layer, sliding_window,
                 soft_cap):
    """qblk [K, Q, G, H] of one sequence at positions pos [Q] (-1 = not a query), over that
    sequence's block table row `table` [pages]: only the chunks these queries can see.
    Returns [K, Q, G, H]."""
    K, Q, G, H = qblk.shape
    C = kv_chunk_pages * kv_cache.values_of(k_cache).shape[2]
    hi = jnp.max(pos)
    lo = jnp.min(jnp.where(pos >= 0, pos, hi))
    qm = qblk.reshape(K, Q * G, H)
    pos_m = jnp.repeat(pos, G)  # [Q*G]: row q*G + g is query q

    def body(c, carry):
        m, l, acc = carry  # [K, M], [K, M], [K, M, H]
        pages = jax.lax.dynamic_slice_in_dim(table, c * kv_chunk_pages, kv_chunk_pages)
        vis = _visible(c * C + jnp.arange(C), pos_m, sliding_window)  # [M, C]
        # One small transpose per chunk ([C, K, H] -> [K, C, H]) so both products are
        # batch-leading matmuls over the KV heads.
        k = jnp.swapaxes(_read_pages(k_cache, layer, pages).reshape(C, K, H), 0, 1)
        v = jnp.swapaxes(_read_pages(v_cache, layer, pages).reshape(C, K, H), 0, 1)
        s = _scores(jnp.einsum("kmh,kch->kmc", qm, k), vis[None], soft_cap)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + jnp.einsum("kmc,kch->kmh", p, v)

    init = (jnp.full((K, Q * G), _MASKED, jnp.float32), jnp.zeros((K, Q * G), jnp.float32),
            jnp.zeros((K, Q * G, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(_first_chunk(lo, C, sliding_window), (hi + C) // C, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(K, Q, G, H)


def _read_pages(cache, layer, pages):
    """pages [..., n] -> fp32 [..., n, page, K, H] of layer `layer` (dequantized if int8).
    Indexes the cache as [L * P, page, K, H] with one flat page index: XLA:CPU's gather with a
    (layer, page) index pair measured 3-6x slower than this single-axis take."""
    vals = cache.values if kv_cache.is_quantized(cache) else cache
    L, P = vals.shape[:2]
    flat = layer * P + pages
    # mode="clip": page ids are valid by construction, and "fill" adds masking code to every
    # gather (slower to compile and to run).
    out = jnp.take(vals.reshape(L * P, *vals.shape[2:]), flat, axis=0, mode="clip").astype(jnp.float32)
    if kv_cache.is_quantized(cache):
        scales = jnp.take(cache.scales.reshape(L * P, *cache.scales.shape[2:]), flat, axis=0, mode="clip")  # [..., n, K, page]
        out = out * jnp.swapaxes(scales, -1, -2)[..., None].astype(jnp.float32)
    return out
