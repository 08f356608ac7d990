"""The grouped matmul's meaning, in plain jnp, and its argument check.

lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (sum <= M). Rows are grouped in order:
group g owns rows [offsets[g], offsets[g + 1]) with offsets = [0, cumsum(group_sizes)], and
out[rows of g] = lhs[rows of g] @ rhs[g]. Rows past sum(group_sizes) belong to no group and
come out zero (jax.lax.ragged_dot's convention). fp32 accumulation.

Quantized experts (`ref_quantized_grouped_matmul`): rhs stored per group in the quantized
matmul's int8 / int4 layout (below); the definition dequantizes every group and runs the float
reference. xla.py and tpu_quantized.py compute it without a float copy of the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import reference as qmm_ref


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


# -- Quantized experts ------------------------------------------------------------------------
# rhs stored as pallas_kernels/quantized_matmul's layout, one matrix per group, out-major:
#   int8  q int8 [G, N, K],       scale [G, N, K/gs]                 W[g] = scale * q
#   int4  q uint8 [G, N, K/2],    scale, zero [G, N, K/gs]           W[g] = scale * u + zero
# (gs: the quantization group size along K, named `group_size` as there; G is the expert
# count.) out[rows of g] = lhs[rows of g] @ W[g]^T.


def validate_quantized(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int) -> None:
    """The quantized operands' checks, naming the argument and the limit: each group's matrix
    must pass quantized_matmul's own check (one [N, K] weight), all groups alike."""
    if q.ndim != 3 or scale.ndim != 3 or (zero is not None and zero.ndim != 3):
        raise ValueError(f"quantized grouped matmul: q / scale / zero must be [G, N, .], got q {q.shape}, "
                         f"scale {scale.shape}, zero {None if zero is None else zero.shape}")
    G = q.shape[0]
    if scale.shape[0] != G or (zero is not None and zero.shape[0] != G):
        raise ValueError(f"quantized grouped matmul: scale / zero must have G={G} groups like q {q.shape}")
    qmm_ref.validate(lhs, q[0], scale[0], None if zero is None else zero[0], bits=bits, group_size=group_size)
    if group_sizes.shape != (G,):
        raise ValueError(f"quantized grouped matmul: group_sizes must be [G={G}], got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"quantized grouped matmul: group_sizes must be integers, got {group_sizes.dtype}")


def ref_quantized_grouped_matmul(lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int,
                                 out_dtype=None) -> jax.Array:
    """The definition: every group's weight dequantized to fp32 (quantized_matmul's
    `dequantize`), then ref_grouped_matmul in fp32 at HIGHEST precision. Materialises the
    whole fp32 [G, K, N]: tests only."""
    validate_quantized(lhs, q, scale, zero, group_sizes, bits=bits, group_size=group_size)
    w = qmm_ref.dequantize(q, scale, zero, bits=bits, group_size=group_size)  # [G, N, K] fp32
    with jax.default_matmul_precision("highest"):
        out = ref_grouped_matmul(lhs.astype(jnp.float32), jnp.swapaxes(w, 1, 2), group_sizes,
                                 out_dtype=jnp.float32)
    return out.astype(out_dtype or lhs.dtype)
