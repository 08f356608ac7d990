"""Grouped matmul (the Mixture-of-Experts expert projections): rows of lhs [M, K] sorted by
group, group g's rows times rhs[g] [K, N]. reference.py: the pure-jnp reference (a dense
per-group loop) and the argument check; tpu.py: the Pallas TPU kernel; block_sizes.py: its
block sizes as data. On CPU / GPU the model uses jax.lax.ragged_dot (layers.moe_mlp)."""

from pallas_kernels.grouped_matmul.reference import ref_grouped_matmul, validate  # noqa: F401
