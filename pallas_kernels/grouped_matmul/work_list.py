"""The grouped matmul's work list, shared by the TPU kernels (tpu.py, tpu_quantized.py) and the
XLA path over quantized experts (xla.py): rows cut into tiles of tm, each tile visited once per
group it overlaps (keeping only that group's rows), tiles past the groups once (to zero them);
built with jnp on device from the group sizes, so no host sync and no recompile per routing.
tpu.py's module docstring explains the visits' order and the spare visits at the end.
`accumulate_visit` is the TPU kernels' shared body: zero, accumulate a visit's rows, write out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def work_list(group_sizes: jax.Array, m: int, tm: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(tile, group, lo, hi) per visit, each [m_tiles + G - 1] int32 (see the module docstring).
    m: rows (a multiple of tm)."""
    G = group_sizes.shape[0]
    m_tiles = m // tm
    V = m_tiles + G - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // tm
    ntiles = jnp.where(ends > starts, (ends + tm - 1) // tm - first, 0)  # tiles group g overlaps
    cum = jnp.cumsum(ntiles)
    used = cum[-1]  # visits the groups take
    v = jnp.arange(V, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, v, side="right"), G - 1).astype(jnp.int32)
    in_groups = v < used
    covered = (ends[-1] + tm - 1) // tm  # tiles holding some group's rows: [0, covered)
    tile = jnp.where(in_groups, first[g] + v - (cum[g] - ntiles[g]), covered + v - used)
    tile = jnp.minimum(tile, m_tiles - 1)
    # Visits past the groups keep no rows; they fetch the rhs block the last group visit had.
    last_g = jnp.where(used > 0, g[jnp.maximum(used - 1, 0)], 0)
    group = jnp.where(in_groups, g, last_g)
    lo = jnp.where(in_groups, starts[g], 0)
    hi = jnp.where(in_groups, ends[g], 0)
    return tile.astype(jnp.int32), group.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def visit_flags(tile_ref, v, nv):
    """Inside a kernel over the work list: visit v's row tile, and whether v is that tile's
    first visit (zero its accumulator) and its last (write the tile out); a tile's visits are
    consecutive in the list."""
    tile = tile_ref[v]
    first = jnp.logical_or(v == 0, tile_ref[jnp.maximum(v - 1, 0)] != tile)
    last = jnp.logical_or(v == nv - 1, tile_ref[jnp.minimum(v + 1, nv - 1)] != tile)
    return tile, first, last


def accumulate_visit(tile_ref, lo_ref, hi_ref, acc_ref, out_ref, tm: int, product) -> None:
    """The body of every grouped kernel at visit v (grid axis 1) and K step k (axis 2): zero the
    row tile's accumulator at its first visit's first K step, add `product()` (the visit's [tm, tn]
    fp32 product with its group's weights) to the rows [lo, hi) its group owns, and write the
    tile out after its last visit's last K step."""
    v, k = pl.program_id(1), pl.program_id(2)
    nv, nk = pl.num_programs(1), pl.num_programs(2)
    tile, first_visit, last_visit = visit_flags(tile_ref, v, nv)

    @pl.when(jnp.logical_and(first_visit, k == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    lo, hi = lo_ref[v], hi_ref[v]

    @pl.when(hi > lo)  # visits keeping no rows add nothing (and skip the MXU)
    def _():
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        # A select, not a multiply by a 0/1 mask: another group's rows may hold inf / NaN
        # products (or stale memory) that must not leak in as NaN.
        acc_ref[...] += jnp.where((rows >= lo) & (rows < hi), product(), 0.0)

    @pl.when(jnp.logical_and(last_visit, k == nk - 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)
