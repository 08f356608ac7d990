"""Grouped matmul over int8 / int4 experts for TPU (Pallas Mosaic): lhs [M, K] rows sorted by
group, times each group's quantized weight (reference.py's quantized layout: q [G, N, K'],
scale / zero [G, N, K/gs]), dequantized inside the kernel per K tile. fp32 accumulation.

The schedule is tpu.py's: grid (N tiles, visits, K tiles), the visits built on device from
the group sizes by tpu.work_list (each row tile once per group it overlaps; a select keeps
that group's rows), the accumulator zeroed at a tile's first visit and written at its last.
What changes is the weight operand and the product of one K tile:

  weight block   q [tn, tk] int8, or [tn, tk/2] packed int4, of the visit's group (out-major,
                 so each product is an NT dot as in quantized_matmul/tpu.py)
  scales         f32 rows [K/gs, tn] of the visit's group, resident while k advances (the
                 wrapper transposes [G, N, K/gs] to [G, K/gs, N]: a group's scales are then one
                 lane row that multiplies the [tm, tn] product; v5e / v6e have no f16 loads)
  product        per quantization group inside the tile, as quantized_matmul/tpu.py does it:
                   int8   (x_g . q_g^T) * s_g
                   int4   (x_lo . lo^T + x_hi . hi^T) * s_g + sum(x_g) * z_g
                 and a tile inside one quantization group (per channel: gs = K) scales the
                 whole tile's product by that group's row. int8 codes and int4 nibbles are
                 exact in bf16, so the MXU takes them converted to lhs's dtype.

So HBM holds and streams the weights in their stored width: no [G, K, N] float copy is made
anywhere. Block sizes: tpu.choose_blocks' tm and tn; tk as there, but also a multiple of the
quantization group (gs < K) whose int4 block is whole 128-lane rows (or all of K).

Costs beyond the float kernel's: the scales' transpose + convert per call (N * K/gs values per
group: an eighth of the int8 bytes at gs = 32 with f32 out, less at larger groups; better done
once at load), and tm x tn VPU multiplies per quantization group. Not run on TPU hardware
(none was at hand): tested in the TPU interpret mode on CPU; scripts/tpu_kernel_sweep.py
compiles it with libtpu for v5e / v6e / v5p at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes
(int8 per channel, int4 g128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.grouped_matmul import block_sizes
from pallas_kernels.grouped_matmul.reference import validate_quantized
from pallas_kernels.grouped_matmul.tpu import choose_blocks
from pallas_kernels.grouped_matmul.work_list import accumulate_visit, work_list
from pallas_kernels.quantized_matmul import tpu as qmm_tpu

_LANES = 128


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def choose_quantized_blocks(M: int, N: int, K: int, dtype, *, bits: int, group_size: int,
                            tm: int | None = None, tn: int | None = None, tk: int | None = None
                            ) -> tuple[int, int, int]:
    """(tm, tn, tk): tm, tn as tpu.choose_blocks; tk the largest divisor of K up to the
    table's tk that is a multiple of the quantization group (gs < K) and gives a weight block
    of whole 128-lane rows, or all of K (module docstring). Overrides are checked."""
    tm, tn, _ = choose_blocks(M, N, K, dtype, tm=tm, tn=tn, tk=K)
    gs = group_size
    per_lane = 2 if bits == 4 else 1
    if tk is None:
        unit = gs if gs < K else _LANES
        top = block_sizes.lookup(M)["tk"]
        cands = [c for c in range(unit, min(top, K) + 1, unit)
                 if K % c == 0 and c % _LANES == 0 and (c // per_lane) % _LANES == 0]
        tk = max(cands) if cands else K
    if K % tk:
        raise ValueError(f"TPU quantized grouped matmul: tk={tk} must divide K={K}")
    if gs < K and tk % gs:
        raise ValueError(f"TPU quantized grouped matmul: tk={tk} must be a multiple of the group size {gs}")
    if bits == 4 and gs > tk:
        raise ValueError(f"TPU quantized grouped matmul: int4 tk={tk} must hold whole groups of {gs}")
    if tk != K and (tk % _LANES or (tk // per_lane) % _LANES):
        raise ValueError(f"TPU quantized grouped matmul: tk={tk} gives a weight block of {tk // per_lane} "
                         f"lanes; blocks must be whole {_LANES}-lane rows or all of K={K}")
    return tm, tn, tk


def _tile_product(x_ref, q_ref, s_ref, z_ref, k, *, bits: int, gs: int, tk: int, shape):
    """The [tm, tn] fp32 product of this K tile with the visit's group's weight block."""
    cdt = x_ref.dtype
    if gs >= tk:  # the tile lies inside one quantization group (per channel: gs = K)
        row = (k * tk) // gs
        s = s_ref[pl.ds(row, 1), :]
        if bits == 8:
            return qmm_tpu.dot_nt(x_ref[...], q_ref[...].astype(cdt)) * s
        gpb, first = 1, row  # int4: gs == tk (choose_quantized_blocks)
    else:
        gpb, first = tk // gs, k * (tk // gs)
    return qmm_tpu.sum_group_products(x_ref, q_ref, s_ref, z_ref, first, gpb, bits=bits, group_size=gs,
                                      shape=shape)


def _kernel(tile_ref, group_ref, lo_ref, hi_ref, x_ref, q_ref, s_ref, *rest, tm: int, bits: int,
            gs: int, tk: int):
    z_ref, out_ref, acc_ref = rest if bits == 4 else (None, *rest)
    k = pl.program_id(2)
    accumulate_visit(tile_ref, lo_ref, hi_ref, acc_ref, out_ref, tm,
                     lambda: _tile_product(x_ref, q_ref, s_ref, z_ref, k, bits=bits, gs=gs, tk=tk,
                                           shape=acc_ref.shape))


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "out_dtype", "interpret", "tm", "tn", "tk"))
def quantized_grouped_matmul_tpu(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int,
                                 out_dtype=None, interpret: bool | str = False, tm: int | None = None,
                                 tn: int | None = None, tk: int | None = None) -> jax.Array:
    """out [M, N] = per group g, lhs[rows of g] @ dequantize(q[g], scale[g], zero[g])^T
    (reference.ref_quantized_grouped_matmul), the weights read as stored.

    lhs [M, K] fp32 / bf16; q int8 [G, N, K] or uint8 [G, N, K/2] (int4); scale (and int4 zero)
    [G, N, K/gs]; group_sizes [G] int. tm, tn, tk override the block sizes (tests). interpret:
    False (compile for TPU), or True / "nan" / "zero" for the TPU interpret mode on CPU."""
    validate_quantized(lhs, q, scale, zero, group_sizes, bits=bits, group_size=group_size)
    M, K = lhs.shape
    G, N = q.shape[:2]
    tm, tn, tk = choose_quantized_blocks(M, N, K, lhs.dtype, bits=bits, group_size=group_size,
                                         tm=tm, tn=tn, tk=tk)
    m = _round_up(M, tm)
    if m != M:
        lhs = jnp.pad(lhs, ((0, m - M), (0, 0)))
    tile, group, lo, hi = work_list(group_sizes, m, tm)
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    wk = tk // 2 if bits == 4 else tk
    srows = K // group_size
    index = dict(
        x=lambda j, v, k, tile, group, lo, hi: (tile[v], k),
        w=lambda j, v, k, tile, group, lo, hi: (group[v], j, k),
        s=lambda j, v, k, tile, group, lo, hi: (group[v], 0, j),  # resident while k advances
    )
    in_specs = [pl.BlockSpec((tm, tk), index["x"]), pl.BlockSpec((None, tn, wk), index["w"]),
                pl.BlockSpec((None, srows, tn), index["s"])]
    args = [lhs, q, jnp.swapaxes(scale.astype(jnp.float32), 1, 2)]
    if bits == 4:
        in_specs.append(pl.BlockSpec((None, srows, tn), index["s"]))
        args.append(jnp.swapaxes(zero.astype(jnp.float32), 1, 2))
    nscale = 2 if bits == 4 else 1
    need = (2 * (tm * tk * lhs.dtype.itemsize + tn * wk + nscale * _round_up(srows, 8) * tn * 4)
            + 2 * tm * tn * out_dtype.itemsize + 3 * tm * tn * 4 + 2 * tn * min(tk, 512) * 4)
    vmem_limit = min(max(_round_up(need * 5 // 4, 1 << 20), 16 << 20), 48 << 20)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(pl.cdiv(N, tn), tile.shape[0], K // tk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, k, tile, group, lo, hi: (tile[v], j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, bits=bits, gs=group_size, tk=tk),
        out_shape=jax.ShapeDtypeStruct((m, N), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret_mode.tpu_params(interpret),
        name=f"grouped_matmul_int{bits}",
    )(tile, group, lo, hi, *args)
    return out[:M] if m != M else out
