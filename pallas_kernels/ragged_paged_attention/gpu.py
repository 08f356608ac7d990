"""Ragged paged attention for NVIDIA Hopper GPUs (Pallas Mosaic GPU): decode tokens and prefill
chunks in one call, split-K over each sequence's pages (flash-decoding), WGMMA tensor cores.

Why Mosaic GPU and not Triton: JAX is retiring the Triton lowering, and this JAX carries a
Mosaic GPU interpret mode, so the kernel runs on CPU in tests; it also lowers for CUDA on a
CPU-only machine (the lowering, layout checks included, is Python), which the tests check too.

Work decomposition (the wrapper computes it with a few jnp ops from the seam's per-token arrays):
  a work item = one sequence's run of at most `qt` consecutive query tokens, qt = 64 // G, so
  its qt x G query rows fill one 64-row WGMMA tile (decode: one token, G rows). Work items are
  listed in a fixed-size table, [W] with W = ceil(T / qt) + S (a static bound); unused items
  (0 tokens) and splits with no KV block exit at once, writing nothing.
Grid: (W work items, K KV heads, kv_splits), one warpgroup per program. Program (w, h, sp):
  - TMA the work item's query tile [64, H] (pre-gathered by the wrapper, [W, K, 64, H]);
  - walk its share (1 / kv_splits) of the KV blocks the tile can see: blocks of `bkv` keys,
    from the sliding window's lower bound to the last token's own position. Each block's pages
    come by TMA straight from the cache, [page, H] boxes of head h at (layer, page id), the page
    ids read from the block table in GMEM; two slots, the next block's copies in flight while
    this one computes;
  - int8 or fp32 caches are converted in SMEM -> registers -> SMEM to the query dtype (int8 x
    its per-token scale) before the MMA; bf16 / fp16 caches feed WGMMA directly;
  - S = Q K^T (WGMMA, fp32 accumulate), scale, optional soft-cap, mask (causal by position,
    window, valid rows), online softmax in registers, O += P V (WGMMA);
  - write O / l [64, H] fp32 and the log-sum-exp [64] of its split.
The wrapper merges the splits that ran (it recomputes which from the same formula; unwritten
outputs hold stale bits on a device) by log-sum-exp weights and scatters tile rows back to
[T, N, H].

Masks avoid integer division: row r of a tile is token r // G, and x <= r // G <=> x * G <= r.

The step's new K/V are written by kv_cache.write_kv (an XLA scatter) before this kernel runs.

Verified here only in the Mosaic GPU interpret mode on CPU and by lowering for CUDA; not run
on a GPU (none was at hand). The interpreter knows no register layouts and its WGMMA takes no
transposed or register operand, so under interpret=True the layout hints are dropped and the
two matmuls are evaluated as jnp.dot; everything else (work items, TMA of pages, barriers,
double buffering, conversion, masks, softmax, split merge) runs as written.
scripts/bench_attention.py and scripts/check_gpu_kernels.sh are for an H200.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import block_sizes
from pallas_kernels import interpret as interpret_mode
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention  # noqa: F401  (the ref_ twin)
from pallas_kernels.ragged_paged_attention.reference import seq_metadata
from pallas_kernels.ragged_paged_attention.reference import validate as rpa_validate

_MASKED = -1e30  # finite: a tile row that sees no key in a block cannot make NaN
_TILE_ROWS = 64  # one WGMMA M tile per warpgroup
# jax 0.11 dropped plgpu.load's index argument (a ref is indexed with .at first); 0.10 needs it.
_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters
_MIN_COPY_BYTES = 128  # Mosaic GPU TMA copies move whole multiples of the warpgroup's 128 threads

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128, 256)
SUPPORTED_Q_DTYPES = ("bfloat16", "float16", "float32")  # fp32 queries run the MMA in bf16
SUPPORTED_KV_DTYPES = ("bfloat16", "float16", "float32", "int8")


def check_supported(*, head_dim: int, page_size: int, num_q_per_kv: int, q_dtype, kv_dtype) -> None:
    """Start-up check of what this kernel can take; raises ValueError naming the shape."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"GPU ragged paged attention: head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"GPU ragged paged attention: page_size {page_size} not in {SUPPORTED_PAGE_SIZES}")
    if not 1 <= num_q_per_kv <= _TILE_ROWS:
        raise ValueError(f"GPU ragged paged attention: {num_q_per_kv} query heads per KV head; "
                         f"at most {_TILE_ROWS} fit one tile")
    if jnp.dtype(q_dtype).name not in SUPPORTED_Q_DTYPES:
        raise ValueError(f"GPU ragged paged attention: query dtype {jnp.dtype(q_dtype).name} not in "
                         f"{SUPPORTED_Q_DTYPES}")
    kvn = "int8" if kv_dtype == "int8" else jnp.dtype(kv_dtype).name
    if kvn not in SUPPORTED_KV_DTYPES:
        raise ValueError(f"GPU ragged paged attention: KV cache dtype {kvn} not in {SUPPORTED_KV_DTYPES}")
    scale_bytes = page_size * jnp.dtype(kv_cache.SCALE_DTYPE).itemsize
    if kvn == "int8" and scale_bytes % _MIN_COPY_BYTES:
        # One head's scales for a page are one TMA copy, and Mosaic GPU copies whole
        # multiples of 128 bytes (one byte per thread of the warpgroup).
        raise ValueError(f"GPU ragged paged attention with an int8 cache: page_size {page_size} gives "
                         f"{scale_bytes}-byte scale runs; needs page_size >= "
                         f"{_MIN_COPY_BYTES // jnp.dtype(kv_cache.SCALE_DTYPE).itemsize}")


def validate(q, k_cache, v_cache, positions, token_seq, block_tables) -> tuple[int, int, int, int, int]:
    """The shared shape checks (reference.validate), then what this kernel takes.
    Returns (T, N, H, page_size, K)."""
    T, N, H, ps, K = rpa_validate(q, k_cache, v_cache, positions, token_seq, block_tables)
    check_supported(head_dim=H, page_size=ps, num_q_per_kv=N // K, q_dtype=q.dtype,
                    kv_dtype=kv_cache.storage_dtype(k_cache))
    return T, N, H, ps, K


def _smem_transforms(dtype, cols: int):
    """Tiling + swizzle of a WGMMA operand tile whose rows hold `cols` elements."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(cols * bits, "rhs")
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _work_items(q_start, q_len, first_pos, qt: int, W: int):
    """Split each sequence's query run into tiles of <= qt tokens.

    Returns int32 [W] arrays: seq, tok (first flat token index), ntok (0 = unused), pos0."""
    S = q_len.shape[0]
    tiles = -(-q_len // qt)
    tile_end = jnp.cumsum(tiles)
    w = jnp.arange(W, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, w, side="right").astype(jnp.int32)
    used = seq < S
    seq_c = jnp.minimum(seq, S - 1)
    k = w - (tile_end[seq_c] - tiles[seq_c])
    ntok = jnp.where(used, jnp.clip(q_len[seq_c] - k * qt, 0, qt), 0).astype(jnp.int32)
    tok = (q_start[seq_c] + k * qt).astype(jnp.int32)
    pos0 = (first_pos[seq_c] + k * qt).astype(jnp.int32)
    return seq_c, tok, ntok, pos0


def _split_blocks(ntok, pos0, sp, *, bkv: int, kv_splits: int, sliding_window: int | None):
    """(first KV block, number of KV blocks) of split `sp` of a work item: its share of the
    blocks [j_lo, j_hi) the item's tokens can see. Scalars in the kernel, arrays in the wrapper,
    which must know exactly which programs ran (n > 0): one formula for both."""
    j_hi = jnp.where(ntok > 0, (pos0 + ntok - 1) // bkv + 1, 0)
    j_lo = jnp.int32(0) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0) // bkv
    n_all = jnp.maximum(j_hi - j_lo, 0)
    per = (n_all + kv_splits - 1) // kv_splits
    b0 = j_lo + sp * per
    return b0, jnp.clip(j_lo + n_all - b0, 0, per)


def _kernel(layer_ref, wseq_ref, wntok_ref, wpos0_ref, tables_ref, q_ref, k_ref, v_ref, *refs,
            G, page_size, bkv, pages_per_seq, kv_splits, quantized, convert, mma_dtype, sm_scale,
            sliding_window, soft_cap, hints):
    if quantized:
        ks_ref, vs_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    H = q_ref.shape[-1]
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    # Register layouts are hints for the Mosaic GPU lowering, not semantics; the interpret
    # mode does not know them (hints=False there), so they go through these three helpers.
    def cast(x, layout):
        return plgpu.layout_cast(x, layout) if hints else x

    def load(ref, layout):
        if not hints:
            return ref[...]
        return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(ref, layout=layout)

    def iota(shape, dim):
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout if hints else None)

    # The two matmuls. On the GPU: WGMMA, fp32 accumulate, each into a fresh accumulator
    # (one register add for P V instead of WGMMA into `acc` via run_state). The interpret
    # mode's WGMMA takes neither a transposed operand nor one in registers, so there they are
    # the same products written as jnp.dot; the CUDA lowering test covers the WGMMA path.
    def mma_qk(q_tile, k_tile):  # [64, H] x [bkv, H] -> [64, bkv]
        if not hints:
            return lax.dot_general(q_tile[...], k_tile[...], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        def f(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
            return acc_ref[...]
        return pl.run_scoped(f, plgpu.ACC((_TILE_ROWS, bkv), jnp.float32))

    def mma_pv(p, v_tile):  # [64, bkv] (registers) x [bkv, H] -> [64, H]
        if not hints:
            return jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32)

        def f(acc_ref):
            plgpu.wgmma(acc_ref, p, v_tile)
            return acc_ref[...]
        return pl.run_scoped(f, plgpu.ACC((_TILE_ROWS, H), jnp.float32))

    w = lax.axis_index("w")
    h = lax.axis_index("k")
    sp = lax.axis_index("sp")
    layer = layer_ref[0]
    seq = wseq_ref[w]
    ntok = wntok_ref[w]
    pos0 = wpos0_ref[w]

    b0, n = _split_blocks(ntok, pos0, sp, bkv=bkv, kv_splits=kv_splits, sliding_window=sliding_window)

    copies_per_block = max(1, bkv // page_size)  # whole pages per block (or 1 part of a page)
    rows_per_copy = min(bkv, page_size)
    raw_dtype = k_ref.dtype

    def body(q_smem, kv_raw, kv_mma, kv_scales, o_smem, lse_smem, q_bar, kv_bar):
        # K and V share each allocation (index 0 = K, 1 = V): fewer allocations per program.
        k_raw, v_raw = kv_raw.at[0], kv_raw.at[1]
        k_mma, v_mma = (kv_mma.at[0], kv_mma.at[1]) if convert else (None, None)
        ks_smem, vs_smem = (kv_scales.at[0], kv_scales.at[1]) if quantized else (None, None)
        k_bar, v_bar = (lambda slot: kv_bar.at[slot]), (lambda slot: kv_bar.at[2 + slot])
        plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar.at[0])

        def issue(j, slot):
            for c in range(copies_per_block):
                tok0 = j * bkv + c * rows_per_copy
                pid = tables_ref[seq, jnp.minimum(tok0 // page_size, pages_per_seq - 1)]
                off = tok0 % page_size
                dst = pl.ds(c * rows_per_copy, rows_per_copy)
                src = (layer, pid, pl.ds(off, rows_per_copy), h)
                plgpu.copy_gmem_to_smem(k_ref.at[src], k_raw.at[slot, dst], k_bar(slot))
                plgpu.copy_gmem_to_smem(v_ref.at[src], v_raw.at[slot, dst], v_bar(slot))
                if quantized:
                    ssrc = (layer, pid, h, pl.ds(off, rows_per_copy))
                    plgpu.copy_gmem_to_smem(ks_ref.at[ssrc], ks_smem.at[slot, dst], k_bar(slot))
                    plgpu.copy_gmem_to_smem(vs_ref.at[ssrc], vs_smem.at[slot, dst], v_bar(slot))

        issue(b0, 0)  # n > 0 here

        plgpu.barrier_wait(q_bar.at[0])

        def to_mma(raw, scales, dst):
            """raw [bkv, H] (int8 x scale, or fp32) -> dst [bkv, H] in the MMA dtype."""
            x = load(raw, wgmma_layout).astype(jnp.float32)
            if scales is not None:
                sc = load(scales, row_layout).astype(jnp.float32)
                x = x * lax.broadcast_in_dim(sc, x.shape, [0])
            dst[...] = x.astype(mma_dtype)
            plgpu.commit_smem()  # generic-proxy stores, read next by WGMMA (async proxy)

        def kv_step(i, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(i, 2)
            j = b0 + i

            @pl.when(i + 1 < n)
            def _():
                issue(j + 1, 1 - slot)

            plgpu.barrier_wait(k_bar(slot))
            if convert:
                to_mma(k_raw.at[slot], ks_smem.at[slot] if quantized else None, k_mma)
                k_tile = k_mma
            else:
                k_tile = k_raw.at[slot]

            s = mma_qk(q_smem, k_tile) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            rows = iota(s.shape, 0)
            cols = iota(s.shape, 1)
            rel = j * bkv + cols - pos0  # key position - the tile's first query position
            visible = (rows < ntok * G) & (rel * G <= rows)
            if sliding_window is not None:
                visible = visible & (rows < (rel + sliding_window) * G)
            s = jnp.where(visible, s, _MASKED)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            corr = jnp.exp(m_i - m_new)
            p = jnp.where(visible, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            l_i = l_i * corr + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])

            plgpu.barrier_wait(v_bar(slot))
            if convert:
                to_mma(v_raw.at[slot], vs_smem.at[slot] if quantized else None, v_mma)
                v_tile = v_mma
            else:
                v_tile = v_raw.at[slot]

            acc = acc + mma_pv(p.astype(mma_dtype), v_tile)
            return acc, m_new, l_i

        acc = cast(jnp.zeros((_TILE_ROWS, H), jnp.float32), wgmma_layout)
        m_i = cast(jnp.full((_TILE_ROWS,), _MASKED, jnp.float32), row_layout)
        l_i = cast(jnp.zeros((_TILE_ROWS,), jnp.float32), row_layout)
        acc, m_i, l_i = lax.fori_loop(0, n, kv_step, (acc, m_i, l_i))

        safe_l = jnp.maximum(l_i, 1e-30)
        o_smem[...] = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
        # log-sum-exp of the split; -inf where the split saw nothing (weight 0 in the merge).
        lse_smem[...] = jnp.where(l_i > 0, m_i + jnp.log(safe_l), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[w, h, sp])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[w, h, sp])
        plgpu.wait_smem_to_gmem(0)

    mma_tf = _smem_transforms(mma_dtype, H)
    raw_tf = _smem_transforms(raw_dtype, H)
    scratch = [
        plgpu.SMEM((_TILE_ROWS, H), mma_dtype, transforms=mma_tf),  # q tile
        plgpu.SMEM((2, 2, bkv, H), raw_dtype, transforms=raw_tf),  # [K|V, slot] as cached
        plgpu.SMEM((2, bkv, H), mma_dtype, transforms=mma_tf) if convert else None,  # converted
        plgpu.SMEM((2, 2, bkv), kv_cache.SCALE_DTYPE) if quantized else None,  # [K|V, slot]
        plgpu.SMEM((_TILE_ROWS, H), jnp.float32, transforms=_smem_transforms(jnp.float32, H)),
        plgpu.SMEM((_TILE_ROWS,), jnp.float32),  # log-sum-exp
    ]
    arrivals = copies_per_block * (2 if quantized else 1)  # one arrival per TMA on a barrier

    # Programs with nothing to do write nothing: unused work items (the wrapper never reads
    # their rows) and splits past the end of a short context (the merge gives them weight 0,
    # knowing them by _split_blocks, not by their unwritten values).
    @pl.when((ntok > 0) & (n > 0))
    def _():
        pl.run_scoped(
            lambda scr, q_bar, kv_bar: body(*scr, q_bar, kv_bar),
            scratch,
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=arrivals, num_barriers=4),  # [K slot 0, K slot 1, V 0, V 1]
        )


def _gpu_blocks(T: int, head_dim: int, kv_dtype: str) -> tuple[int, int]:
    """(keys per KV block, KV splits) from the tables."""
    kv = block_sizes.lookup(block_sizes.GPU_KV_BLOCK, tokens=T, head_dim=head_dim, kv_dtype=kv_dtype)
    sp = block_sizes.lookup(block_sizes.GPU_SPLITS, tokens=T)
    return kv["kv_tokens"], sp["kv_splits"]


@functools.partial(jax.jit, static_argnames=("sliding_window", "soft_cap", "interpret", "kv_block",
                                             "kv_splits"))
def ragged_paged_attention_gpu(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               interpret: bool | str = False, kv_block: int | None = None,
                               kv_splits: int | None = None):
    """Ragged paged attention on Hopper GPUs; same contract as ref_ragged_paged_attention.

    q            [T, N, H]          queries (RoPE applied); bf16 / fp16, or fp32 (MMA in bf16)
    every other argument as in ref_ragged_paged_attention (caches plain or int8 QuantizedKV)
    interpret    False, or run under the Mosaic GPU interpret mode (CPU tests): True / "nan" /
                 "zero", the fill of uninitialised memory (pallas_kernels/interpret.py)
    kv_block, kv_splits             override block_sizes.GPU_TABLE (keys per block, splits)
    Tokens of one sequence must be one contiguous run at consecutive positions, runs in row
    order, padding last (the runner's layout). Returns [T, N, H] in q's dtype; padding rows 0.
    """
    T, N, H, ps, K = validate(q, k_cache, v_cache, positions, token_seq, block_tables)
    kv_cache.check_paged_scales(k_cache, K, "the GPU attention kernel")
    # [L, P, page, K, H] for the TMA boxes: a reshape of the stored [L, P, page, K * H] that
    # moves no byte on a GPU (row-major, untiled).
    k_cache, v_cache = kv_cache.as_heads(k_cache, H), kv_cache.as_heads(v_cache, H)
    kc = kv_cache.values_of(k_cache)
    G = N // K
    S, pages_per_seq = block_tables.shape
    quantized = kv_cache.is_quantized(k_cache)
    kv_name = "int8" if quantized else jnp.dtype(kc.dtype).name
    qt = _TILE_ROWS // G  # whole tokens per 64-row query tile
    bkv, splits = _gpu_blocks(T, H, kv_name)
    bkv = kv_block or bkv
    splits = kv_splits or splits
    if bkv % 64:
        raise ValueError(f"kv_block {bkv} must be a multiple of 64 (WGMMA N tile)")
    mma_dtype = jnp.float16 if q.dtype == jnp.float16 else jnp.bfloat16
    convert = quantized or kc.dtype != mma_dtype

    q_start, q_len, first_pos, _ = seq_metadata(positions, token_seq, S)
    W = -(-T // qt) + S
    wseq, wtok, wntok, wpos0 = _work_items(q_start, q_len, first_pos, qt, W)

    # Query tiles [W, K, 64, H]: row r = token wtok + r // G, query head k * G + r % G.
    r = jnp.arange(_TILE_ROWS, dtype=jnp.int32)
    row_ok = (r[None, :] < wntok[:, None] * G)  # [W, 64]
    tok = jnp.where(row_ok, wtok[:, None] + r[None, :] // G, 0)
    qg = q.reshape(T, K, G, H).astype(mma_dtype)
    tiles = qg[tok, :, (r % G)[None, :]]  # [W, 64, K, H]
    tiles = jnp.where(row_ok[:, :, None, None], tiles, 0).transpose(0, 2, 1, 3)

    kernel = functools.partial(
        _kernel, G=G, page_size=ps, bkv=bkv, pages_per_seq=pages_per_seq, kv_splits=splits,
        quantized=quantized, convert=convert, mma_dtype=mma_dtype, sm_scale=1.0 / math.sqrt(H),
        sliding_window=sliding_window, soft_cap=soft_cap, hints=interpret_mode.fill_of(interpret) is None)
    caches = [kc, kv_cache.values_of(v_cache)]
    if quantized:
        caches += [k_cache.scales, v_cache.scales]
    o, lse = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((W, K, splits, _TILE_ROWS, H), jnp.float32),
                  jax.ShapeDtypeStruct((W, K, splits, _TILE_ROWS), jnp.float32)),
        grid=(W, K, splits),
        grid_names=("w", "k", "sp"),
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret_mode.gpu_params(interpret),
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), wseq, wntok, wpos0,
      block_tables.astype(jnp.int32), tiles, *caches)

    # Merge the splits: weights exp(lse - max lse); a row no split saw stays 0. Programs that
    # were skipped (no tokens, or an empty share of KV blocks) left their outputs unwritten:
    # on a device that is stale, finite memory, so which programs ran is computed here from
    # the kernel's own formula, never guessed from the values (issue 22). A program that ran
    # writes -inf for rows that saw no key: those weigh 0 too.
    _, n_run = _split_blocks(wntok[:, None], wpos0[:, None], jnp.arange(splits, dtype=jnp.int32)[None, :],
                             bkv=bkv, kv_splits=splits, sliding_window=sliding_window)
    ran = ((wntok[:, None] > 0) & (n_run > 0))[:, None, :, None]  # [W, 1, splits, 1]
    lse = jnp.where(ran & jnp.isfinite(lse), lse, -jnp.inf)
    top = jnp.max(lse, axis=2, keepdims=True)
    wgt = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))
    o = jnp.where(wgt[..., None] > 0, o, 0.0)
    merged = (o * wgt[..., None]).sum(2) / jnp.maximum(wgt.sum(2), 1e-30)[..., None]  # [W, K, 64, H]

    # Scatter tile rows back to [T, N, H]; rows that are not tokens go out of range and drop.
    head = jnp.arange(K)[None, :, None] * G + (r % G)[None, None, :]  # [1, K, 64]
    dst_tok = jnp.where(row_ok, tok, T)[:, None, :]  # [W, 1, 64]
    out = jnp.zeros((T, N, H), jnp.float32)
    out = out.at[jnp.broadcast_to(dst_tok, (W, K, _TILE_ROWS)),
                 jnp.broadcast_to(head, (W, K, _TILE_ROWS))].set(merged, mode="drop")
    return out.astype(q.dtype)
