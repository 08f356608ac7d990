"""Weight-quantized matmul for NVIDIA GPUs (Pallas, Triton lowering): x [M, K] times int8 or
packed-int4 weights [N, K'] with group scales, dequantized in registers, fp32 accumulation.

Layouts are reference.py's. Grid: (M / bm, N / bn, splits), one program per output tile
[bm, bn] and K split, all parallel. Split-K (choose_splits) fills the GPU at decode: 4096 ->
1024 at M = 1 has 16 output tiles of bn = 64 for 132 SMs, so its K is cut into 16 splits whose
fp32 partials [splits, M, N] the wrapper sums (16 x 1024 x 4 bytes, against 4 MiB of weights).
A program walks its split of K one group at a time (per-channel int8: chunks of the largest power
of two up to 128 dividing K), in a fori_loop, dequantizing in registers:
  int8: w = q[tile, group] * s[tile, g]                     acc += x[:, group] . w^T
  int4: lo, hi = the group's low / high nibbles (its two contiguous input halves),
        each * s[tile, g] + zero[tile, g]                   acc += x_lo . lo^T + x_hi . hi^T
with the scale / zero column [bn, 1] broadcast over the group's inputs, the weights cast to
x's dtype for the tensor cores and fp32 accumulation.

Loads and stores are masked at the M and N edges, so no shape needs padding; every block
dimension is a power of two (Triton's rule) and at least 16 (its dot's minimum).

Why Triton and not Mosaic GPU (which the paged-attention kernel uses): this kernel is a
dequantize-and-dot loop with no TMA pipeline or warp specialisation to express, which the
Triton lowering handles in a screenful; if JAX drops the Triton lowering, this is the file
to port. Not run on a GPU (none was at hand): tests run it in Pallas's interpret mode on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.quantized_matmul import block_sizes
from pallas_kernels.quantized_matmul.reference import ref_quantized_matmul  # noqa: F401  (the ref_ twin)
from pallas_kernels.quantized_matmul.reference import validate

_MIN_DOT = 16  # Triton's tl.dot needs every dimension >= 16


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def choose_blocks(M: int, N: int, K: int, *, bits: int, group_size: int,
                  bm: int | None = None, bn: int | None = None) -> tuple[int, int, int]:
    """(bm, bn, chunk): tile sizes from block_sizes.GPU_TABLE and the K step."""
    row = block_sizes.lookup(block_sizes.GPU_TABLE, m=M, bits=bits)
    bm = bm or row["bm"]
    bn = bn or row["bn"]
    G = group_size
    if bits == 8 and G == K:
        chunk = max((c for c in (128, 64, 32, 16) if K % c == 0), default=0)
    else:
        chunk = G
    return bm, bn, chunk


_TARGET_CTAS = 264  # two per SM of an H100 / H200 (132 SMs): what split-K aims to fill


def choose_splits(M: int, N: int, K: int, bm: int, bn: int, chunk: int) -> int:
    """K splits (split-K) so a decode matmul fills the GPU: the largest power of two up to
    _TARGET_CTAS / (output tiles) that divides the K steps and leaves each split >= 2 of them.
    4096 -> 1024 at M = 1 (16 tiles of bn = 64): 16 splits of 2 groups of 128; 4096 -> 14336
    (224 tiles): 1."""
    steps = K // chunk
    tiles = -(-M // bm) * -(-N // bn)
    splits = 1
    while (splits * 2 * tiles <= _TARGET_CTAS and steps % (splits * 2) == 0
           and steps // (splits * 2) >= 2):
        splits *= 2
    return splits


def _check_blocks(K, bm, bn, chunk, *, bits, group_size) -> None:
    for name, v in (("bm", bm), ("bn", bn)):
        if not _pow2(v) or v < _MIN_DOT:
            raise ValueError(f"GPU quantized matmul: {name}={v} must be a power of two >= {_MIN_DOT}")
    step = chunk // 2 if bits == 4 else chunk
    if not _pow2(step) or step < _MIN_DOT:
        what = "per-channel K" if bits == 8 and group_size == K else f"group size {group_size}"
        raise ValueError(f"GPU quantized matmul int{bits}: {what} (K={K}) gives a dot depth of {step}; "
                         f"it must be a power of two >= {_MIN_DOT}")


def _kernel(x_ref, q_ref, s_ref, *rest, bits: int, group_size: int, chunk: int, per_channel: bool,
            M: int, N: int, K: int, bm: int, bn: int, splits: int):
    if bits == 4:
        z_ref, o_ref = rest
    else:
        z_ref, (o_ref,) = None, rest
    i, j = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bm, bm)
    cols = pl.ds(j * bn, bn)
    rmask = (i * bm + jnp.arange(bm)) < M  # [bm]
    cmask = (j * bn + jnp.arange(bn)) < N  # [bn]
    cdt = x_ref.dtype
    G = group_size

    def load_x(k0, width):
        return pltriton.load(x_ref.at[rows, pl.ds(k0, width)], mask=rmask[:, None], other=0)

    def load_w(k0, width):
        return pltriton.load(q_ref.at[cols, pl.ds(k0, width)], mask=cmask[:, None], other=0)

    def load_col(ref, g):  # [bn, 1]: scale (or zero) column g of the tile's rows
        return pltriton.load(ref.at[cols, pl.ds(g, 1)], mask=cmask[:, None], other=0).astype(jnp.float32)

    def dot_nt(a, b):
        return jnp.dot(a, b.T, preferred_element_type=jnp.float32)

    def body(t, acc):
        k0 = t * chunk
        g = 0 if per_channel else t
        s = load_col(s_ref, g)
        if bits == 8:
            w = (load_w(k0, chunk).astype(jnp.float32) * s).astype(cdt)
            return acc + dot_nt(load_x(k0, chunk), w)
        h = G // 2
        z = load_col(z_ref, g)
        p = load_w(t * h, h).astype(jnp.int32)  # [bn, G/2]: the group's bytes
        lo = ((p & 15).astype(jnp.float32) * s + z).astype(cdt)
        hi = (jax.lax.shift_right_logical(p, 4).astype(jnp.float32) * s + z).astype(cdt)
        return acc + dot_nt(load_x(k0, h), lo) + dot_nt(load_x(k0 + h, h), hi)

    per = K // chunk // splits  # this program's K steps: split sp of them
    t0 = pl.program_id(2) * per
    acc = jax.lax.fori_loop(t0, t0 + per, body, jnp.zeros((bm, bn), jnp.float32))
    mask = rmask[:, None] & cmask[None, :]
    if splits == 1:
        pltriton.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=mask)
    else:  # split-K: [splits, M, N] fp32 partials, this split's plane
        pltriton.store(o_ref.at[pl.ds(pl.program_id(2), 1), rows, cols], acc[None], mask=mask[None])


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype", "interpret",
                                             "bm", "bn", "splits", "num_warps", "num_stages"))
def quantized_matmul_gpu(x, q, scale, zero=None, *, bits: int, group_size: int, out_dtype=None,
                         interpret: bool | str = False, bm: int | None = None, bn: int | None = None,
                         splits: int | None = None, num_warps: int = 4, num_stages: int = 3):
    """y = x @ dequantize(q, scale, zero)^T on an NVIDIA GPU.

    Operands and result as reference.ref_quantized_matmul (layouts in its module docstring):
    x [M, K] activations, q / scale / zero the stored weight, [M, N] out; fp32 accumulation.
    bm, bn override block_sizes.GPU_TABLE (tests); interpret=True / "nan" / "zero" runs Pallas's
    generic interpret mode with that fill of uninitialised memory (pallas_kernels/interpret.py).
    """
    validate(x, q, scale, zero, bits=bits, group_size=group_size)
    M, K = x.shape
    N = q.shape[0]
    bm, bn, chunk = choose_blocks(M, N, K, bits=bits, group_size=group_size, bm=bm, bn=bn)
    _check_blocks(K, bm, bn, chunk, bits=bits, group_size=group_size)
    splits = splits or choose_splits(M, N, K, bm, bn, chunk)
    if (K // chunk) % splits:
        raise ValueError(f"GPU quantized matmul: splits={splits} must divide the {K // chunk} K steps of {chunk}")
    kernel = functools.partial(_kernel, bits=bits, group_size=group_size, chunk=chunk,
                               per_channel=bits == 8 and group_size == K, M=M, N=N, K=K, bm=bm, bn=bn,
                               splits=splits)
    args = (x, q, scale) + ((zero,) if bits == 4 else ())
    out_dtype = out_dtype or x.dtype
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N) if splits == 1 else (splits, M, N),
                                       out_dtype if splits == 1 else jnp.float32),
        grid=(pl.cdiv(M, bm), pl.cdiv(N, bn), splits),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret_mode.generic_param(interpret),
        name=f"quantized_matmul_int{bits}",
    )(*args)
    # Split-K partials summed here: splits x M x N fp32, small next to the weights at decode M.
    return y if splits == 1 else y.sum(0).astype(out_dtype)
