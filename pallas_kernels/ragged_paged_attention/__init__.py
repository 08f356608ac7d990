"""Ragged paged attention over the paged KV cache: the per-token pure-jnp reference and the
shared shape checks (reference.py), the blocked XLA path the CPU runs (blocked.py), the native
C++ CPU kernel's loader (cpu_native.py; its source is pallas_kernels/native/), the Mosaic TPU
kernel (tpu.py) with its SMEM / VMEM budget (tpu_budget.py), the Mosaic GPU kernel (gpu.py),
and both kernels' block sizes as data (block_sizes.py). The contract every implementation
meets is ref_ragged_paged_attention's."""

from pallas_kernels.ragged_paged_attention.reference import (  # noqa: F401
    ref_ragged_paged_attention, seq_metadata, validate, write_kv)
