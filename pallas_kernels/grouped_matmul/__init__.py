"""Grouped matmul (the Mixture-of-Experts expert projections): rows of lhs [M, K] sorted by
group, group g's rows times rhs[g] [K, N]. reference.py: the pure-jnp reference (a dense
per-group loop) and the argument check, and the quantized experts' definition; tpu.py: the
Pallas TPU kernel; tpu_quantized.py: its twin over int8 / int4 experts; xla.py: the quantized
experts in plain XLA (CPU / GPU); work_list.py: the (row tile, group) visits; block_sizes.py:
the TPU block sizes as data. Float experts on CPU / GPU run jax.lax.ragged_dot
(sharding/grouped_matmul.py)."""

from pallas_kernels.grouped_matmul.reference import ref_grouped_matmul, validate  # noqa: F401
