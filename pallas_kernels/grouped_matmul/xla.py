"""The quantized grouped matmul in plain XLA (CPU and GPU): lhs [M, K] rows sorted by group,
times each group's int8 / int4 weight (reference.py's quantized layout), with no float copy
of the experts. Two forms, picked by M (static; measured, docs/quantization.md):

All experts at once (M <= ALL_EXPERTS_MAX_ROWS: decode steps). The experts' output rows N are
walked in chunks of C rows (a lax.scan; one step when they fit): each step dequantizes rows
[c, c + C) of every expert, [G, C, K] in fp32, small enough to stay in cache
(CPU_CHUNK_BYTES, the dense quantized path's 4 MB), multiplies all M rows by them as one
plain [M, K] x [K, G*C] dot, and keeps for each row the C columns of its own group (a select
over G, so another group's products never leak in, not even as NaN). Every weight is
dequantized once; the cost is G-fold FLOPs (every row against every expert), which is also
what XLA:CPU's jax.lax.ragged_dot does with float experts (a dense dot over a [G, M, K]
masked copy of lhs, jax/_src/lax/lax.py _ragged_dot_general_impl). With few rows the weights'
reading dominates and this form is the fastest measured.

Work list (larger M: prefill). tpu.py's schedule in a lax.scan: rows cut into tiles of
WORK_LIST_TILE, each tile visited once per expert it overlaps (work_list.py, built on device
from the group sizes), each visit one dense quantized matmul of the tile against that expert
(quantized_matmul's CPU path, which dequantizes cache-sized row blocks of the one expert) whose
rows of that expert are added into the output tile. FLOPs drop to (M + (G - 1) * tile) rows
times one expert, at the price of dequantizing an expert once per visit (about M / tile + G
visits): 2-9x faster than the all-experts form at M = 64-1024 here, 3x slower at 16 rows.

Either way the largest float temporary is a cached chunk of dequantized rows, never the
[G, K, N] experts. int4 as the dense CPU path (pallas_kernels/quantized_matmul/reference.py):
a group's low and high nibbles face two contiguous halves of its inputs, so lhs is split into
those halves and each nibble plane is one dot. Equal to ref_quantized_grouped_matmul up to
fp32 summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.reference import validate_quantized
from pallas_kernels.grouped_matmul.work_list import work_list
from pallas_kernels.quantized_matmul.reference import CPU_CHUNK_BYTES, in_column_chunks, xla_quantized_matmul

# Rows up to which all experts run at once (the form measured fastest for decode steps), and
# the row tile of the work list above it (docs/quantization.md has the measurements).
ALL_EXPERTS_MAX_ROWS = 32
WORK_LIST_TILE = 64


def chunk_rows(G: int, N: int, K: int) -> int:
    """Output rows per scan step: all of N when the [G, N, K] fp32 dequantized chunk fits
    CPU_CHUNK_BYTES twice over, else the largest multiple of 8 rows within CPU_CHUNK_BYTES
    (at least 8; the remainder runs as one tail step)."""
    if G * N * K * 4 <= 2 * CPU_CHUNK_BYTES:
        return N
    return min(N, max(8, CPU_CHUNK_BYTES // (G * K * 4) // 8 * 8))


def _rows(x_lo, x_hi, own, q, scale, zero, *, bits: int, group_size: int):
    """[M, C]: each row times its own group's rows [C] of W; q [G, C, K'], scale / zero
    [G, C, K/gs]; own [M, G] bool, True at the row's group (all False past the groups)."""
    G, C = q.shape[:2]
    gs = group_size
    s = scale.astype(jnp.float32)[..., None]  # [G, C, K/gs, 1]
    if bits == 8:
        K = q.shape[2]
        w = (q.reshape(G, C, K // gs, gs).astype(jnp.float32) * s).reshape(G * C, K)
        p = jnp.dot(x_lo, w.T)
    else:
        Kh = q.shape[2]
        z = zero.astype(jnp.float32)[..., None]
        pk = q.reshape(G, C, Kh * 2 // gs, gs // 2)
        lo = ((pk & 15).astype(jnp.float32) * s + z).reshape(G * C, Kh)
        p = jnp.dot(x_lo, lo.T)
        # As in the dense CPU path: keep XLA from merging the two unpacks into one loop.
        p, pk = jax.lax.optimization_barrier((p, pk))
        hi = ((pk >> 4).astype(jnp.float32) * s + z).reshape(G * C, Kh)
        p = p + jnp.dot(x_hi, hi.T)
    p = p.reshape(p.shape[0], G, C)
    return jnp.sum(jnp.where(own[:, :, None], p, 0.0), axis=1)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype"))
def xla_quantized_grouped_matmul(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int,
                                 out_dtype=None):
    """out [M, N]: rows of group g times dequantize(q[g], scale[g], zero[g])^T, fp32 sums; all
    experts at once up to ALL_EXPERTS_MAX_ROWS rows, the work list above (module docstring).

    lhs [M, K] fp32 / bf16 rows sorted by group; q int8 [G, N, K] or uint8 [G, N, K/2] (int4);
    scale (and int4 zero) [G, N, K/gs]; group_sizes [G] int (rows past their sum: zeros).
    Returns out_dtype (default lhs's dtype)."""
    validate_quantized(lhs, q, scale, zero, group_sizes, bits=bits, group_size=group_size)
    if lhs.shape[0] > ALL_EXPERTS_MAX_ROWS:
        return work_list_form(lhs, q, scale, zero, group_sizes, bits=bits, group_size=group_size,
                               tm=WORK_LIST_TILE).astype(out_dtype or lhs.dtype)
    return all_experts_form(lhs, q, scale, zero, group_sizes, bits=bits,
                             group_size=group_size).astype(out_dtype or lhs.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def all_experts_form(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int):
    """[M, N] fp32: every row against every expert's cached row chunks (module docstring)."""
    M, K = lhs.shape
    G, N = q.shape[:2]
    gs = group_size
    x32 = lhs.astype(jnp.float32)
    if bits == 4:
        xg = x32.reshape(M, K // gs, 2, gs // 2)
        x_lo, x_hi = xg[:, :, 0].reshape(M, K // 2), xg[:, :, 1].reshape(M, K // 2)
    else:
        x_lo, x_hi = x32, None
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row = jnp.arange(M, dtype=jnp.int32)[:, None]
    own = (row >= (ends - group_sizes.astype(jnp.int32))[None, :]) & (row < ends[None, :])  # [M, G]
    rows = functools.partial(_rows, x_lo, x_hi, own, bits=bits, group_size=gs)
    return in_column_chunks(rows, q, scale, zero, n=N, chunk=chunk_rows(G, N, K), axis=1)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "tm"))
def work_list_form(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int, tm: int):
    """[M, N] fp32: each (row tile, expert) visit one dense quantized matmul (module docstring)."""
    M, _ = lhs.shape
    N = q.shape[1]
    m = -(-M // tm) * tm
    x = lhs if m == M else jnp.pad(lhs, ((0, m - M), (0, 0)))
    visits = work_list(group_sizes, m, tm)

    def visit(out, v):
        tile, g, lo, hi = v
        rows = jax.lax.dynamic_slice_in_dim(x, tile * tm, tm, 0)
        pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, g, 0, keepdims=False)  # noqa: E731
        y = xla_quantized_matmul(rows, pick(q), pick(scale), pick(zero), bits=bits, group_size=group_size,
                                 out_dtype=jnp.float32)
        r = tile * tm + jnp.arange(tm, dtype=jnp.int32)
        keep = ((r >= lo) & (r < hi))[:, None]  # a select: other experts' rows must not leak in
        acc = jax.lax.dynamic_slice_in_dim(out, tile * tm, tm, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, acc + jnp.where(keep, y, 0.0), tile * tm, 0), None

    out, _ = jax.lax.scan(visit, jnp.zeros((m, N), jnp.float32), visits)
    return out[:M]
