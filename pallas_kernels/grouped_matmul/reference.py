"""The grouped matmul's meaning, in plain jnp, and its argument check.

lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M). Rows are grouped in order:
group g owns rows [offsets[g], offsets[g + 1]) with offsets = [0, cumsum(group_sizes)], and
out[rows of g] = lhs[rows of g] @ rhs[g]. Rows past sum(group_sizes) belong to no group and
come out zero (jax.lax.ragged_dot's convention). fp32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def validate(lhs, rhs, group_sizes) -> None:
    """Shape and dtype errors naming the argument and the limit (trace-time: shapes are static)."""
    if lhs.ndim != 2:
        raise ValueError(f"grouped matmul: lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"grouped matmul: rhs must be [G, K, N], got shape {rhs.shape}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"grouped matmul: rhs K={rhs.shape[1]} must equal lhs K={lhs.shape[1]}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"grouped matmul: rhs dtype {rhs.dtype} must equal lhs dtype {lhs.dtype}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped matmul: group_sizes must be [G={rhs.shape[0]}], got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped matmul: group_sizes must be integers, got {group_sizes.dtype}")


def ref_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    """Dense per-group reference: every group's matmul over all M rows, kept on its own rows.
    G times the work of the grouped kernel; for tests only."""
    validate(lhs, rhs, group_sizes)
    M = lhs.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    starts = ends - group_sizes.astype(jnp.int32)
    rows = jnp.arange(M)[:, None]
    out = jnp.zeros((M, rhs.shape[2]), jnp.float32)
    for g in range(rhs.shape[0]):
        y = jnp.dot(lhs, rhs[g], preferred_element_type=jnp.float32)
        out = jnp.where((rows >= starts[g]) & (rows < ends[g]), y, out)
    return out.astype(out_dtype or lhs.dtype)
