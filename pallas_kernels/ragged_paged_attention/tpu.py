"""Ragged paged attention for TPU (Pallas Mosaic): one kernel for a step that mixes prefill
chunks and decode tokens, reading only the pages each sequence owns.

Layout in and out is the seam's (see reference.py): q [T, N, H], caches
[L, P, page, K * H] as stored (or [L, P, page, K, H]; plain or int8 QuantizedKV), per-token positions / token_seq, and
block_tables [S, pages]. The wrapper derives per-sequence metadata (query start, query length,
first position, KV length) and, per query block, the range of sequences it touches; all of it
goes to SMEM as scalar prefetch, with the layer index and the block tables (flattened to 1-D).

Budgets (tpu_budget.py computes them; tests/test_tpu_budget.py checks them against v5e / v6e /
v5p for Llama-3-8B and 70B shapes at tp 1-8):
  SMEM = 4 bytes x (1 + 3 S + 2 query blocks + S x pages per sequence). Tables are 1-D because
    Mosaic pads 2-D SMEM arrays to (8, 128) tiles: [256, 8] tables (128-token sequences) would
    take 128 KiB for 8 KiB of data. 256 sequences x 32k tokens at page 16 is 2 MiB of tables
    even flat: over the 1 MiB SMEM, refused at start-up (page 64 or 128 sequences fit).
  VMEM per grid step, Llama-3-8B at tp 1 (K = 8, G = 4, H = 128), bf16, the table's large-step
    row (q_rows 256 -> bq = 64 tokens, R = 256 rows; kv_tokens 512 -> nb = 32 pages of 16):
    q + out 2 x 2 x 8 x 256 x 128 x 2 = 2 MiB; K/V pages 2 x 2 x 32 x 16 x 1024 x 2 = 4 MiB;
    m, l 2 x 8 x 256 x 128 x 4 = 2 MiB; acc 8 x 256 x 128 x 4 = 1 MiB; values (one head at a
    time: its scores / p / mask 4 x 256 x 512 x 4 and K, K^T, V tiles 3 x 512 x 128 x 2) =
    2.375 MiB: 11.375 MiB (libtpu's own count: 10.47), 14.2 MiB with 25% headroom, near v5e's
    16 MiB scoped default, so the kernel states its need as vmem_limit_bytes (the need + 25%
    rounded up to MiB, at least 16 MiB, at most 48 MiB = 3/4 of v5p's 64 MiB). 70B (G = 8) has
    the same R = 256 (bq = 32): the same 11.375 MiB; both fall with K / tp. Decode steps
    (T <= 64: R = 32) need ~5.4 MiB at tp 1. Head dim 256 (Gemma 2 9B, K = 8, G = 2) needs
    17.9 MiB at the large-step row; head dim 64 pads to 128 lanes in q, out and acc.
  HBM bytes a KV block brings: 2 x 32 pages x 16 x 8 x 128 x 2 = 2 MiB (bf16) per step at tp 1,
    K / tp of that at higher tp; int8 1 MiB + 128 KiB of scales (each page brings its whole
    lane-dense scale row, 8 pages' scales at page 16: 2 B x 128 lanes x 8 heads a page).

Grid: (T_pad / bq,) query blocks, "parallel" (no state crosses grid steps, so megacore chips
may split them). A block holds bq tokens x all N query heads, arranged by the wrapper as
[K, bq * G, H]: row r of KV head k is token r // G, query head k * G + r % G, so each KV head
meets its G query heads as one [bq * G, H] matrix (GQA / MQA without repeating K/V).

Inside a block, for each sequence that has tokens in it (in order), for each KV block of
`nb` pages that those tokens can see (causal, and the sliding window's lower bound):
  - DMA the pages that hold visible keys from HBM into VMEM, one contiguous [page, K * H]
    copy per page for K and one for V (the cache is stored [L, P, page, K * H], so no
    reshape), so each KV head is a static lane slice in VMEM; int8 caches also bring each
    page's lane-dense scale row [K', 128] (pallas_kernels/kv_cache.py), rotated in VMEM so the
    page's own lanes come first;
  - double-buffered: the next (sequence, KV block)'s copies start before this one's compute;
  - per KV head: scores = q @ k^T (MXU, fp32 accumulate), optional soft-cap, mask by
    (row belongs to the sequence, key position <= query position, inside the window), and the
    online-softmax update of m, l, acc kept in VMEM scratch. Rows of other sequences get
    p = 0 and an unchanged m, so they pass through untouched.
At the end of the block, out = acc / l (rows no sequence owns, i.e. padding, come out 0).

Masks avoid vector integer division: with r the row, x <= r // G  <=>  x * G <= r.

The step's new K/V are written by kv_cache.write_kv (an XLA scatter into the donated cache)
before this kernel runs.

Not run on TPU hardware (none was at hand): tests run it under the TPU interpret mode on CPU;
scripts/tpu_kernel_sweep.py compiles it with libtpu (Mosaic's passes and XLA:TPU, compile-only
devices) for v5e / v6e / v5p at Llama-3, Qwen3, Gemma 2 / 3 and Mixtral shapes, head dims 64 /
128 / 256, bf16 and int8 pages of 16 - 64. Block sizes come from block_sizes.TPU_TABLE.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import block_sizes
from pallas_kernels import interpret as interpret_mode
from pallas_kernels.ragged_paged_attention import tpu_budget
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention  # noqa: F401  (the ref_ twin)
from pallas_kernels.ragged_paged_attention.reference import seq_metadata
from pallas_kernels.ragged_paged_attention.reference import validate as rpa_validate

_MASKED = -1e30  # finite, as in the reference: exp(_MASKED - m) is 0, never NaN
_LANES = 128  # m and l are kept lane-replicated, [rows, 128], the layout TPU vregs like
_SUBLANES = 16  # row blocks are whole multiples of this (bf16 packs 16 rows per vreg tile)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = ("float32", "bfloat16")


def check_supported(*, head_dim: int, page_size: int, q_dtype, kv_dtype) -> None:
    """Start-up check of what this kernel can take; raises ValueError naming the shape."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"TPU ragged paged attention: head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"TPU ragged paged attention: page_size {page_size} not in {SUPPORTED_PAGE_SIZES}")
    if jnp.dtype(q_dtype).name not in SUPPORTED_DTYPES:
        raise ValueError(f"TPU ragged paged attention: query dtype {jnp.dtype(q_dtype).name} not in "
                         f"{SUPPORTED_DTYPES}")
    if not (kv_dtype == "int8" or jnp.dtype(kv_dtype).name in SUPPORTED_DTYPES):
        raise ValueError(f"TPU ragged paged attention: KV cache dtype {kv_dtype} not in "
                         f"{SUPPORTED_DTYPES + ('int8',)}")


def validate(q, k_cache, v_cache, positions, token_seq, block_tables) -> tuple[int, int, int, int, int]:
    """The shared shape checks (reference.validate), then what this kernel takes.
    Returns (T, N, H, page_size, K)."""
    T, N, H, ps, K = rpa_validate(q, k_cache, v_cache, positions, token_seq, block_tables)
    check_supported(head_dim=H, page_size=ps, q_dtype=q.dtype,
                    kv_dtype=kv_cache.storage_dtype(k_cache))
    return T, N, H, ps, K


def _blocks(T: int, G: int, page_size: int, head_dim: int) -> tuple[int, int]:
    """(tokens per query block, pages per KV block) from the table."""
    row = block_sizes.lookup(block_sizes.TPU_TABLE, tokens=T, page_size=page_size, head_dim=head_dim)
    step = _SUBLANES // math.gcd(_SUBLANES, G)  # tokens per block: bq * G a multiple of 16
    bq = max(step, row["q_rows"] // G // step * step)
    bq = min(bq, -(-T // step) * step)  # no bigger than the (rounded-up) step itself
    nb = max(1, row["kv_tokens"] // page_size)
    return bq, nb


def _kernel(layer_ref, q_start_ref, q_len_ref, first_pos_ref, blk_lo_ref, blk_hi_ref, tables_ref,
            q_ref, k_hbm, v_hbm, *rest, bq, G, K, nb, page_size, pages_per_seq, quantized,
            sm_scale, sliding_window, soft_cap, scale_g=1):
    if quantized:
        ks_hbm, vs_hbm, o_ref, kbuf, vbuf, ksbuf, vsbuf, sems, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref = rest
    R = bq * G
    H = q_ref.shape[-1]
    bkv = nb * page_size
    num_seqs = q_start_ref.shape[0]
    layer = layer_ref[0]
    i = pl.program_id(0)
    t0 = i * bq
    lo, hi = blk_lo_ref[i], blk_hi_ref[i]

    m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # A sequence's facts, read once from SMEM and carried: (q_start, q_len, first_pos).
    def seq_info(s):
        s = jnp.minimum(s, num_seqs - 1)  # s = hi may be one past the last row: never used
        return q_start_ref[s], q_len_ref[s], first_pos_ref[s]

    def ranges(info):
        """Tokens [a, b) of the sequence inside this block; key positions [lo, end) they see."""
        qs, ql, fp = info
        a, b = jnp.maximum(qs, t0), jnp.minimum(qs + ql, t0 + bq)
        end = fp + (b - qs)  # the last token's own position + 1
        lo = jnp.int32(0) if sliding_window is None else jnp.maximum(fp + (a - qs) - sliding_window + 1, 0)
        return a, b, lo, end

    def first_item(s):
        """(s', info, first KV block) of the first sequence s' >= s with tokens in this block;
        s' = hi if there is none."""
        def empty(c):
            a, b, _, _ = ranges(c[1])
            return (c[0] < hi) & (a >= b)
        s, info = lax.while_loop(empty, lambda c: (c[0] + 1, seq_info(c[0] + 1)), (s, seq_info(s)))
        return s, info, ranges(info)[2] // bkv

    def page_copies(s, info, j, slot, op):
        """Start (or wait for) the copies of block j's pages that hold visible keys: per page one
        [page, K * H] copy for K, one for V, and one per [K, page] scale run. Pages wholly
        outside [lo, end) are skipped (their buffer rows are masked in `compute`)."""
        _, _, lo, end = ranges(info)

        def page(p, carry):
            first = (j * nb + p) * page_size

            @pl.when((first < end) & (first + page_size > lo))
            def _():
                # A wait needs only the semaphore and the copy's size, not where it came from:
                # page 0 stands in, which saves the table read.
                pid = tables_ref[s * pages_per_seq + jnp.minimum(j * nb + p, pages_per_seq - 1)] \
                    if op == "start" else 0
                cps = [pltpu.make_async_copy(k_hbm.at[layer, pid], kbuf.at[slot, p], sems.at[slot]),
                       pltpu.make_async_copy(v_hbm.at[layer, pid], vbuf.at[slot, p], sems.at[slot])]
                if quantized:
                    # The scale row holding the page ([K', g * page]: g pages' scales, lane-dense,
                    # kv_cache's module doc) lands as one whole tile row of the slot: Mosaic takes
                    # DMAs whose last two dimensions are whole tiles or all of the buffer's, so a
                    # page's own `page` lanes of the row cannot be copied alone.
                    row = pid // scale_g
                    cps.append(pltpu.make_async_copy(ks_hbm.at[layer, row], ksbuf.at[slot, p], sems.at[slot]))
                    cps.append(pltpu.make_async_copy(vs_hbm.at[layer, row], vsbuf.at[slot, p], sems.at[slot]))
                for c in cps:
                    getattr(c, op)()
            return carry

        # Unrolled: the scalar core issues the block's copies straight-line, no loop overhead
        # between descriptors (nb is static; 32 pages at the table's large-step row).
        lax.fori_loop(0, nb, page, 0, unroll=True)

    def scale_shifts(s, j):
        """Per page of block j, the lane rotation that brings its scales to lane 0 of its
        lane-dense row (which of the row's g pages it is: the page id mod g, from the table);
        read once per KV block, for the K and the V scales alike."""
        lanes = scale_g * page_size
        pids = [tables_ref[s * pages_per_seq + jnp.minimum(j * nb + p, pages_per_seq - 1)] for p in range(nb)]
        return [(lanes - (pid % scale_g) * page_size) % lanes for pid in pids]

    def token_scales(sbuf, slot, shifts):
        """A slot's scales, one [K', g * page] row a page, turned once per KV block to
        [nb, page, K'] fp32: each page's `page` lanes rotated to lane 0 by `shifts` (none in
        the paged layout, g = 1), then transposed, so a token's scale lies on the sublane of
        its row in a head's [bkv, H] tile and head h's scales are lane h. Pages not fetched
        hold stale rows; their keys and values are masked."""
        x = sbuf[slot].astype(jnp.float32)  # [nb, K', g * page]
        if shifts is not None:
            x = jnp.stack([pltpu.roll(x[p], shifts[p], 1)[:, :page_size] for p in range(nb)])  # [nb, K', page]
        return jnp.swapaxes(x, 1, 2)

    def load_kv(buf, scales, slot, h):
        """KV head h's [bkv, H] tile of a slot, in the MXU dtype (int8 times its scales): a
        static lane slice loaded straight from the ref ([nb, page, K * H], heads side by side),
        never the whole slot as one value (which would spill all K heads' tiles)."""
        xh = buf[slot, :, :, h * H:(h + 1) * H]  # [nb, page, H]
        if quantized:
            xh = xh.astype(jnp.float32) * scales[:, :, h:h + 1]  # [nb, page, 1]
        return xh.reshape(bkv, H).astype(q_ref.dtype)

    def compute(s, info, j, slot):
        qs, _, fp = info
        a, b, lo, end = ranges(info)
        # Row r is token t0 + r // G at position c0 + r // G.
        c0 = fp + t0 - qs
        rows = lax.broadcasted_iota(jnp.int32, (R, bkv), 0)
        kv_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (R, bkv), 1)
        visible = ((a - t0) * G <= rows) & (rows < (b - t0) * G) & ((kv_pos - c0) * G <= rows)
        if sliding_window is not None:
            visible &= rows < (kv_pos - c0 + sliding_window) * G
        # Rows of pages that were not fetched hold stale VMEM (NaN in interpret mode); p is 0
        # there, but 0 * NaN is not, so V's rows are zeroed too.
        v_pos = j * bkv + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)
        fetched = (v_pos >= lo // page_size * page_size) & (v_pos < end)
        shifts = scale_shifts(s, j) if quantized and scale_g > 1 else None
        k_scales = token_scales(ksbuf, slot, shifts) if quantized else None
        v_scales = token_scales(vsbuf, slot, shifts) if quantized else None
        for h in range(K):  # each KV head with its G query heads, [R, H] x [bkv, H]; state per head in VMEM
            sc = lax.dot_general(q_ref[h], load_kv(kbuf, k_scales, slot, h),
                                 (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            sc = jnp.where(visible, sc, _MASKED)
            m_prev, l_prev = m_ref[h][:, :1], l_ref[h][:, :1]
            m_new = jnp.maximum(m_prev, sc.max(axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(sc - m_new), 0.0)
            corr = jnp.exp(m_prev - m_new)
            l_ref[h] = jnp.broadcast_to(corr * l_prev + p.sum(axis=1, keepdims=True), (R, _LANES))
            m_ref[h] = jnp.broadcast_to(m_new, (R, _LANES))
            v = jnp.where(fetched, load_kv(vbuf, v_scales, slot, h), 0)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = corr * acc_ref[h] + pv

    s0, info0, j0 = first_item(lo)

    @pl.when(s0 < hi)
    def _():
        page_copies(s0, info0, j0, 0, "start")

    def body(carry):
        s, info, j, slot = carry
        _, _, _, end = ranges(info)
        j_hi = (end - 1) // bkv + 1
        s_next, info_next, j_next = lax.cond(j + 1 < j_hi, lambda: (s, info, j + 1),
                                             lambda: first_item(s + 1))

        @pl.when(s_next < hi)
        def _():
            page_copies(s_next, info_next, j_next, 1 - slot, "start")

        page_copies(s, info, j, slot, "wait")
        compute(s, info, j, slot)
        return s_next, info_next, j_next, 1 - slot

    lax.while_loop(lambda c: c[0] < hi, body, (s0, info0, j0, jnp.int32(0)))

    l = l_ref[...][:, :, :1]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "interpret", "q_block",
                                             "kv_pages_per_block"))
def ragged_paged_attention_tpu(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: bool | str = False, q_block: int | None = None,
                               kv_pages_per_block: int | None = None):
    """Ragged paged attention on TPU; same contract as ref_ragged_paged_attention.

    q            [T, N, H]          queries (RoPE applied), fp32 or bf16
    every other argument as in ref_ragged_paged_attention (caches plain or int8 QuantizedKV)
    interpret    False, or run under the TPU interpret mode (CPU tests): True / "nan" / "zero",
                 the fill of uninitialised memory (pallas_kernels/interpret.py)
    q_block, kv_pages_per_block     override block_sizes.TPU_TABLE (tokens, pages)
    Tokens of one sequence must be one contiguous run at consecutive positions, runs in row
    order, padding last (the runner's layout). Returns [T, N, H] in q's dtype; padding rows 0.
    """
    T, N, H, ps, K = validate(q, k_cache, v_cache, positions, token_seq, block_tables)
    # The stored layout, [L, P, page, K * H]: as_flat is a no-op on it (5-D test caches reshape).
    k_cache, v_cache = kv_cache.as_flat(k_cache), kv_cache.as_flat(v_cache)
    kc = kv_cache.values_of(k_cache)
    G = N // K
    S, pages_per_seq = block_tables.shape
    quantized = kv_cache.is_quantized(k_cache)
    bq, nb = _blocks(T, G, ps, H)
    if q_block is not None:
        if (q_block * G) % _SUBLANES:
            raise ValueError(f"q_block {q_block} x G {G} must be a multiple of {_SUBLANES}")
        bq = q_block
    nb = kv_pages_per_block or nb
    n_blocks = -(-T // bq)
    T_pad = n_blocks * bq
    R = bq * G

    q_start, q_len, first_pos, _ = seq_metadata(positions, token_seq, S)
    q_end = q_start + q_len
    block_t0 = jnp.arange(n_blocks, dtype=jnp.int32) * bq
    blk_lo = jnp.searchsorted(q_end, block_t0, side="right").astype(jnp.int32)  # first seq ending after t0
    blk_hi = jnp.searchsorted(q_start, block_t0 + bq, side="left").astype(jnp.int32)  # first starting past

    qk = jnp.pad(q, ((0, T_pad - T), (0, 0), (0, 0))).reshape(T_pad, K, G, H)
    qk = qk.transpose(1, 0, 2, 3).reshape(K, T_pad * G, H)

    scale_g, scale_heads = kv_cache.scale_geometry(k_cache.scales, ps) if quantized else (1, K)
    kernel = functools.partial(
        _kernel, bq=bq, G=G, K=K, nb=nb, page_size=ps, pages_per_seq=pages_per_seq,
        quantized=quantized, sm_scale=1.0 / math.sqrt(H), sliding_window=sliding_window,
        soft_cap=soft_cap, scale_g=scale_g)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)  # caches stay in HBM; pages come by DMA
    q_spec = pl.BlockSpec((K, R, H), lambda i, *_: (0, i, 0))
    kv_dtype = kc.dtype
    scratch = [pltpu.VMEM((2, nb, ps, K * H), kv_dtype), pltpu.VMEM((2, nb, ps, K * H), kv_dtype)]
    # [L, P, page, K * H], as the cache is stored (kv_cache.init_cache): a page's heads are one
    # DMA and each head is a lane slice in VMEM, with no strided sublane loads, and the cache
    # reaches the kernel with no reshape (on TPU a reshape of the minor dims is a relayout copy
    # of the whole cache; tests/test_tpu_export.py checks there is none).
    caches = [kc, kv_cache.values_of(v_cache)]
    in_specs = [q_spec, any_spec, any_spec]
    if quantized:
        # A page's scale row [K', g * page] a tile (the paged layout: g = 1, K' = K).
        scratch += [pltpu.VMEM((2, nb, scale_heads, scale_g * ps), kv_cache.SCALE_DTYPE)] * 2
        caches += [k_cache.scales, v_cache.scales]
        in_specs += [any_spec, any_spec]
    scratch += [pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((K, R, _LANES), jnp.float32), pltpu.VMEM((K, R, _LANES), jnp.float32),
                pltpu.VMEM((K, R, H), jnp.float32)]
    # Block tables go to SMEM flattened: a 2-D SMEM array pads to (8, 128) tiles (tpu_budget.py).
    prefetch = (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), q_start, q_len, first_pos,
                blk_lo, blk_hi, block_tables.astype(jnp.int32).reshape(-1))
    budget = tpu_budget.attention_budget(
        num_kv_heads=K, q_per_kv=G, head_dim=H, page_size=ps, q_bytes=q.dtype.itemsize,
        kv_bytes=kc.dtype.itemsize, quantized=quantized, bq=bq, nb=nb, num_seqs=S,
        pages_per_seq=pages_per_seq, num_tokens=T)
    tpu_budget.check_attention_budget(budget)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(n_blocks,), in_specs=in_specs,
            out_specs=q_spec, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct((K, T_pad * G, H), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=budget.vmem_limit_bytes),
        interpret=interpret_mode.tpu_params(interpret),
        name="ragged_paged_attention_tpu",
    )(*prefetch, qk, *caches)
    out = out.reshape(K, T_pad, G, H).transpose(1, 0, 2, 3).reshape(T_pad, N, H)
    return out[:T]
