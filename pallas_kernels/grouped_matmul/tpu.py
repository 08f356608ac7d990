"""Grouped matmul for TPU (Pallas Mosaic): lhs [M, K] rows sorted by group, times rhs [G, K, N]
(reference.py states the meaning), fp32 accumulation in VMEM scratch.

The work list. Rows are cut into tiles of tm. A tile that holds rows of several groups is
visited once per group it overlaps, multiplying by that group's rhs and keeping only that
group's rows (a select on the [tm, tn] product); a tile that holds no group's rows (the padding
past sum(group_sizes)) is visited once, to write zeros. The wrapper builds the list with jnp,
on device, from the group sizes (no host sync, no recompile per routing): per visit its row
tile, its group (the rhs block to fetch) and the row range [lo, hi) it keeps. Visits are in
row order, so a tile's visits are consecutive. Their number depends on the routing but is at
most m_tiles + G - 1 (each group boundary inside a tile adds one); the grid is that static
bound and the spare visits at the end repeat the last tile keeping no rows (same blocks, so
the pipeline fetches nothing new for them).

Grid (N tiles, visits, K tiles): the output block (tile, j) must stay resident over all its
tile's visits and the K loop, so visits sit inside the N axis (a (tile, N, K) grid would write
the block back between two visits of one tile and the second would overwrite the first). The N
axis is "parallel" (megacore splits it); visits and K are "arbitrary". The accumulator is
zeroed at a tile's first visit (k = 0) and written out at its last visit (last k).

K tiles must divide K exactly (a partial K tile would add padding into the sums); M is padded
to whole tiles here and the padding's rows dropped; a partial last N tile is fine (its extra
columns are dropped on write). Group sizes summing past M are clamped to M (there is no error
channel on device; jax.lax.ragged_dot leaves that case undefined too).

Not run on TPU hardware (none was at hand): tests run it under the TPU interpret mode on CPU;
scripts/tpu_kernel_sweep.py compiles it with libtpu (Mosaic + XLA:TPU, compile-only devices) for
v5e / v6e / v5p at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes (tp 1 and 8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.grouped_matmul import block_sizes
from pallas_kernels.grouped_matmul.reference import validate
from pallas_kernels.grouped_matmul.work_list import accumulate_visit, work_list

_LANES = 128


def _sublanes(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def choose_blocks(M: int, N: int, K: int, dtype, *, tm: int | None = None, tn: int | None = None,
                  tk: int | None = None) -> tuple[int, int, int]:
    """(tm, tn, tk) from block_sizes.TPU_TABLE (or the given overrides), made legal."""
    row = block_sizes.lookup(M)
    tm = min(tm or row["tm"], _round_up(M, _sublanes(dtype)))
    tn = tn or row["tn"]
    tn = N if N <= tn else tn
    if tk is None:
        cands = [c for c in range(_LANES, min(row["tk"], K) + 1, _LANES) if K % c == 0]
        tk = max(cands) if cands else K
    if tm % _sublanes(dtype):
        raise ValueError(f"TPU grouped matmul: tm={tm} must be a multiple of {_sublanes(dtype)} "
                         f"for {jnp.dtype(dtype).name}")
    if tn != N and tn % _LANES:
        raise ValueError(f"TPU grouped matmul: tn={tn} must be a multiple of {_LANES} or N={N}")
    if K % tk or (tk != K and tk % _LANES):
        raise ValueError(f"TPU grouped matmul: tk={tk} must divide K={K} and be a multiple of "
                         f"{_LANES} (or all of K)")
    return tm, tn, tk


def _kernel(tile_ref, group_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, tm: int):
    accumulate_visit(tile_ref, lo_ref, hi_ref, acc_ref, out_ref, tm,
                     lambda: jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "tm", "tn", "tk"))
def grouped_matmul_tpu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
                       interpret: bool | str = False, tm: int | None = None, tn: int | None = None,
                       tk: int | None = None) -> jax.Array:
    """out [M, N] = per group g, lhs[rows of g] @ rhs[g] (reference.ref_grouped_matmul).

    tm, tn, tk override block_sizes.TPU_TABLE (tests). interpret: False (compile for TPU), or
    True / "nan" / "zero" for the TPU interpret mode on CPU with that fill of uninitialised
    memory (pallas_kernels/interpret.py)."""
    validate(lhs, rhs, group_sizes)
    M, K = lhs.shape
    G, _, N = rhs.shape
    tm, tn, tk = choose_blocks(M, N, K, lhs.dtype, tm=tm, tn=tn, tk=tk)
    m = _round_up(M, tm)
    if m != M:
        lhs = jnp.pad(lhs, ((0, m - M), (0, 0)))
    tile, group, lo, hi = work_list(group_sizes, m, tm)
    visits = tile.shape[0]
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    isz = lhs.dtype.itemsize
    need = 2 * (tm * tk + tk * tn) * isz + 2 * tm * tn * out_dtype.itemsize + 2 * tm * tn * 4
    vmem_limit = min(max(_round_up(need * 5 // 4, 1 << 20), 16 << 20), 48 << 20)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(pl.cdiv(N, tn), visits, K // tk),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda j, v, k, tile, group, lo, hi: (tile[v], k)),
            pl.BlockSpec((None, tk, tn), lambda j, v, k, tile, group, lo, hi: (group[v], k, j)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda j, v, k, tile, group, lo, hi: (tile[v], j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((m, N), out_dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret_mode.tpu_params(interpret),
        name="grouped_matmul",
    )(tile, group, lo, hi, lhs, rhs)
    return out[:M] if m != M else out
