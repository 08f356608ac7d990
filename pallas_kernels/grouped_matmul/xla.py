"""The quantized grouped matmul in plain XLA (CPU and GPU): lhs [M, K] rows sorted by group,
times each group's int8 / int4 weight (reference.py's quantized layout), with no float copy
of the experts.

How. The experts' output rows N are walked in chunks of C rows (a lax.scan; one step when
they fit): each step dequantizes rows [c, c + C) of every expert, [G, C, K] in fp32, small
enough to stay in cache (CPU_CHUNK_BYTES, the dense quantized path's 4 MB), multiplies all M
rows by them as one plain [M, K] x [K, G*C] dot, and keeps for each row the C columns of its
own group (a select over G, so another group's products never leak in, not even as NaN). The
weights are read once per call, in their stored int8 / int4 bytes; the largest float
temporary is the chunk (G * C * K * 4 bytes <= 4 MB) and the [M, G*C] product.

What it costs. Every row is multiplied by every expert's chunk, G times the FLOPs of an ideal
grouped matmul. That is also what XLA:CPU's jax.lax.ragged_dot does with float experts (it
lowers to a dense dot over a [G, M, K] copy of lhs masked per group, jax/_src/lax/lax.py
_ragged_dot_general_impl), so the float path pays it too; here lhs is not copied G times.
Decode steps (M = batch x top_k rows) are bound by reading the weights, which this reads
once and in their stored width; a long prefill is bound by the G-fold FLOPs. A work list of
(row tile, expert) visits (tpu.py's) would cut the FLOPs to about (M + (G - 1) * tile) rows;
not written for XLA yet. The measurements behind the choice are in docs/quantization.md.

int4 as the dense CPU path (pallas_kernels/quantized_matmul/reference.py): a group's low and
high nibbles face two contiguous halves of its inputs, so lhs is split into those halves once
and each nibble plane is one dot. Equal to ref_quantized_grouped_matmul up to fp32 summation
order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.reference import validate_quantized
from pallas_kernels.quantized_matmul.reference import CPU_CHUNK_BYTES


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
    """out [M, N]: rows of group g times dequantize(q[g], scale[g], zero[g])^T, fp32 sums.

    lhs [M, K] fp32 / bf16 rows sorted by group; q int8 [G, N, K] or uint8 [G, N, K/2] (int4);
    scale (and int4 zero) [G, N, K/gs]; group_sizes [G] int (rows past their sum: zeros).
    Returns out_dtype (default lhs's dtype)."""
    validate_quantized(lhs, q, scale, zero, group_sizes, bits=bits, group_size=group_size)
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
    C = chunk_rows(G, N, K)
    if C >= N:
        y = rows(q, scale, zero)
    else:
        n_full = N // C * C

        def step(_, i):
            take = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(a, i * C, C, 1)  # noqa: E731
            return None, rows(take(q), take(scale), take(zero))

        _, ys = jax.lax.scan(step, None, jnp.arange(N // C))  # [N/C, M, C]
        y = jnp.moveaxis(ys, 0, 1).reshape(M, n_full)
        if n_full < N:
            tail = lambda a: None if a is None else a[:, n_full:]  # noqa: E731
            y = jnp.concatenate([y, rows(tail(q), tail(scale), tail(zero))], axis=1)
    return y.astype(out_dtype or lhs.dtype)
