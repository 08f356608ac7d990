"""Weight-quantized matmul: the layouts, their validation, the pure-jnp `ref_` twin, and the
XLA path that CPUs run.

y [M, N] = x [M, K] @ W^T, where W [N, K] (out-major, like HF's and GGUF's weights) is stored
quantized along its input axis K in groups of G consecutive inputs:

  int8   q      int8  [N, K]         W[n, k] = scale[n, k // G] * q[n, k]       (symmetric)
         scale  f16/bf16/f32 [N, K/G]
         G = K is per-output-channel (scale [N, 1]); G = 32 is GGUF Q8_0's block.
  int4   packed uint8 [N, K/2]        W[n, k] = scale[n, k // G] * u[n, k] + zero[n, k // G]
         scale  f16/bf16/f32 [N, K/G]  u in 0..15 (unsigned), asymmetric; `zero` is the
         zero   same as scale          float offset (GGUF Q4_1's min m; Q4_0 is zero = -8 d)
         Packing: group g's bytes are packed[n, g*G/2 + j], j < G/2; the low nibble holds input
         g*G + j and the high nibble input g*G + G/2 + j. For G = 32 these bytes are exactly
         GGUF Q4_0 / Q4_1's `qs` of that block, so GGUF loads by copying bytes.

Why scales are [N, K/G] (row-major, GGUF's order): a row's scales sit next to each other, so
a dequantizing loop over a row of W reads them contiguously (XLA:CPU fuses the dequantize into
its matrix-vector loop, where [K/G, N] scales made every weight a strided gather: ~1.6x slower
end to end, measured), and GGUF blocks repack without a transpose. The kernels broadcast a
group's scale column [bn, 1] over the group's inputs. Why the split-half nibble order: a
group's low nibbles and its high nibbles each face one contiguous half of the group's inputs,
so unpacking needs no interleave.

Every path accumulates in fp32. `ref_quantized_matmul` is the definition (dequantize to fp32,
one dot at HIGHEST precision). `xla_quantized_matmul` is what runs on CPU: the formulation
measured fastest there (see docs/quantization.md) and equal to the reference up to fp32
summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

BITS = (8, 4)
INT4_GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = ("float16", "bfloat16", "float32")
ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")


def validate(x, q, scale, zero, *, bits: int, group_size: int) -> None:
    """Static checks of one call's operands; raises ValueError naming the shapes."""
    if bits not in BITS:
        raise ValueError(f"quantized matmul: bits must be one of {BITS}, got {bits}")
    if x.ndim != 2:
        raise ValueError(f"quantized matmul: x must be [M, K], got shape {x.shape}")
    if str(x.dtype) not in ACTIVATION_DTYPES:
        raise ValueError(f"quantized matmul: x dtype {x.dtype} not in {ACTIVATION_DTYPES}")
    M, K = x.shape
    G = group_size
    if G <= 0 or K % G:
        raise ValueError(f"quantized matmul: group size {G} does not divide K={K} (x {x.shape})")
    if q.ndim != 2:
        raise ValueError(f"quantized matmul: weights must be 2-D [N, K'], got shape {q.shape}")
    N = q.shape[0]
    if bits == 8:
        if q.dtype != jnp.int8 or q.shape != (N, K):
            raise ValueError(f"quantized matmul int8: q must be int8 [N, K] = [{N}, {K}] for x {x.shape}, "
                             f"got {q.dtype} {q.shape}")
        if zero is not None:
            raise ValueError(f"quantized matmul int8 is symmetric: zero must be None, got shape {zero.shape}")
    else:
        if G not in INT4_GROUP_SIZES:
            raise ValueError(f"quantized matmul int4: group size {G} not in {INT4_GROUP_SIZES}")
        if q.dtype != jnp.uint8 or q.shape != (N, K // 2):
            raise ValueError(f"quantized matmul int4: packed must be uint8 [N, K/2] = [{N}, {K // 2}] "
                             f"for x {x.shape}, got {q.dtype} {q.shape}")
        if zero is None or zero.shape != (N, K // G) or zero.dtype != scale.dtype:
            raise ValueError(f"quantized matmul int4: zero must be {scale.dtype} [N, K/G] = [{N}, {K // G}], "
                             f"got {None if zero is None else (zero.dtype, zero.shape)}")
    if scale.shape != (N, K // G):
        raise ValueError(f"quantized matmul: scale must be [N, K/G] = [{N}, {K // G}] for x {x.shape}, "
                         f"weights {q.shape}, group size {G}; got {scale.shape}")
    if str(scale.dtype) not in SCALE_DTYPES:
        raise ValueError(f"quantized matmul: scale dtype {scale.dtype} not in {SCALE_DTYPES}")


def unpack_int4(packed: jax.Array, group_size: int) -> jax.Array:
    """packed uint8 [..., N, K/2] -> u [..., N, K] int32 in 0..15 (layout in the module doc)."""
    *lead, N, Kh = packed.shape
    G = group_size
    p = packed.reshape(*lead, N, Kh * 2 // G, G // 2).astype(jnp.int32)
    u = jnp.concatenate([p & 15, p >> 4], axis=-1)  # [..., N, K/G, G]
    return u.reshape(*lead, N, Kh * 2)


def dequantize(q, scale, zero, *, bits: int, group_size: int, dtype=jnp.float32) -> jax.Array:
    """The float weights W [..., N, K] a quantized weight stands for (leading dims allowed)."""
    G = group_size
    u = q.astype(jnp.int32) if bits == 8 else unpack_int4(q, G)
    *lead, N, K = u.shape
    w = u.reshape(*lead, N, K // G, G).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    if bits == 4:
        w = w + zero.astype(jnp.float32)[..., None]
    return w.reshape(*lead, N, K).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype"))
def ref_quantized_matmul(x, q, scale, zero=None, *, bits: int, group_size: int, out_dtype=None):
    """The definition: x [M, K] @ dequantize(q, scale, zero)^T [K, N] in fp32 -> [M, N] out_dtype
    (default x's dtype). Shapes and layouts as in the module docstring."""
    validate(x, q, scale, zero, bits=bits, group_size=group_size)
    w = dequantize(q, scale, zero, bits=bits, group_size=group_size)
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


# Rows of W dequantized per step of the CPU path's loop over N: their fp32 copy (C x K x 4 bytes)
# must stay in cache, or writing and re-reading it costs more than the fp32 weights would
# (measured: the 49152 x 576 tied head took 180 ms unchunked, 11 ms in 4 MB chunks).
CPU_CHUNK_BYTES = 4 << 20


def _cpu_rows(x_lo, x_hi, q, scale, zero, *, bits: int, group_size: int):
    """[M, C] = x @ W[rows]^T for one block of rows: q [C, K'], scale / zero [C, K/G]."""
    C, G = q.shape[0], group_size
    s = scale.astype(jnp.float32)[:, :, None]  # [C, K/G, 1]
    if bits == 8:
        K = q.shape[1]
        if G == K:  # per channel: scale the [M, C] product, not every weight
            return jnp.dot(x_lo, q.astype(jnp.float32).T) * scale.astype(jnp.float32).T
        w = (q.reshape(C, K // G, G).astype(jnp.float32) * s).reshape(C, K)
        return jnp.dot(x_lo, w.T)
    # int4: the low nibbles of a row are its inputs (g, j < G/2) in order, the high nibbles
    # (g, j >= G/2): two plain [C, K/2] matrices facing x's two halves (x_lo, x_hi).
    Kh = q.shape[1]
    z = zero.astype(jnp.float32)[:, :, None]
    p = q.reshape(C, Kh * 2 // G, G // 2)
    lo = ((p & 15).astype(jnp.float32) * s + z).reshape(C, Kh)
    y = jnp.dot(x_lo, lo.T)
    # The barrier keeps XLA from fusing the two unpacks of `p` into one multi-output loop,
    # which it vectorizes badly: 17 ms against 6 ms for SmolLM2's 30 gate matrices (measured).
    y, p = jax.lax.optimization_barrier((y, p))
    hi = ((p >> 4).astype(jnp.float32) * s + z).reshape(C, Kh)
    return y + jnp.dot(x_hi, hi.T)


def in_column_chunks(rows, q, scale, zero, *, n: int, chunk: int, axis: int):
    """y [M, n] = rows(q, scale, zero), computed `chunk` output columns at a time (a scan over
    the weight arrays' `axis`, which holds the n output columns, plus one call for the tail) so
    each chunk's fp32 dequantized copy stays in cache; one call when chunk >= n. `zero` may be
    None. Shared by the dense and the grouped (experts) CPU paths."""
    if chunk >= n:
        return rows(q, scale, zero)
    n_full = n // chunk * chunk

    def step(_, i):
        take = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis)  # noqa: E731
        return None, rows(take(q), take(scale), take(zero))

    _, ys = jax.lax.scan(step, None, jnp.arange(n // chunk))  # [n/chunk, M, chunk]
    y = jnp.moveaxis(ys, 0, 1).reshape(ys.shape[1], n_full)
    if n_full < n:
        tail = lambda a: None if a is None else jax.lax.slice_in_dim(a, n_full, n, axis=axis)  # noqa: E731
        y = jnp.concatenate([y, rows(tail(q), tail(scale), tail(zero))], axis=1)
    return y


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype"))
def xla_quantized_matmul(x, q, scale, zero=None, *, bits: int, group_size: int, out_dtype=None):
    """The CPU path: dequantize rows to fp32 and dot them with x in fp32, a block of rows at a
    time (a scan over N) when the fp32 copy of W would not stay in cache. At M = 1 XLA:CPU fuses
    the dequantize into its matrix-vector loop, so no fp32 copy is made at all; at larger M it
    materialises one. bf16 dots are several times slower than fp32 on XLA:CPU, so everything
    runs in fp32 here. The fastest of the forms measured (docs/quantization.md); equal to the
    reference up to fp32 summation order.

    x [M, K] fp32/bf16; int8: q int8 [N, K]; int4: q uint8 [N, K/2], zero [N, K/G];
    scale [N, K/G]. Returns [M, N] in out_dtype (default x's dtype).
    """
    validate(x, q, scale, zero, bits=bits, group_size=group_size)
    M, K = x.shape
    N, G = q.shape[0], group_size
    x32 = x.astype(jnp.float32)
    if bits == 4:
        xg = x32.reshape(M, K // G, 2, G // 2)
        x_lo, x_hi = xg[:, :, 0].reshape(M, K // 2), xg[:, :, 1].reshape(M, K // 2)
    else:
        x_lo, x_hi = x32, None
    rows = functools.partial(_cpu_rows, x_lo, x_hi, bits=bits, group_size=G)
    y = in_column_chunks(rows, q, scale, zero, n=N, chunk=_chunk_rows(N, K), axis=0)
    return y.astype(out_dtype or x.dtype)


def _chunk_rows(N: int, K: int) -> int:
    """Rows per step of the CPU loop: all of N when its fp32 copy fits CPU_CHUNK_BYTES twice
    over, else the largest multiple of 8 rows within CPU_CHUNK_BYTES (the rest: one tail step)."""
    if N * K * 4 <= 2 * CPU_CHUNK_BYTES:
        return N
    return max(8, CPU_CHUNK_BYTES // (K * 4) // 8 * 8)
