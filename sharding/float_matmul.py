"""The float-matmul seam: the FLOAT_MATMUL backend table (sharding/backends.py) for the model's
float projections and LM head, resolved once at load (`resolve`, from LoadConfig.matmul_impl)
into the `FloatMatmul` the Decoder holds and model/quant_linear.einsum consults. The rows:

  "xla"         jnp.einsum, XLA's own dot (the default, every backend)
  "cpu_native"  pallas_kernels/small_matmul/cpu_native.py, the C++ small-M fp32 kernel (CPU only,
                opt-in): used only where a projection's rows M (batch x tokens) are at most
                `max_rows` (64: decode steps and speculative verification; a prefill chunk's
                hundreds of rows keep XLA's GEMM, which blocks for compute where this kernel is
                organised for reading W once) and the operands are fp32; anything else is
                jnp.einsum, decided when the step is traced (shapes are static), not per call.

Measured (scripts/profile_decode.py --attention-impl cpu_native, SmolLM2-135M fp32, 2-core
machine, load 1.0-1.7; xla -> cpu_native, ms): the 7 projections of all 30 layers 20.5 -> 21.5
at 1 row, 23.8 -> 30.6 at 4, 28.8 -> 36.0 at 8, 53.9 -> 73.3 at 24; the whole step 36.4 ->
33.4, 63.2 -> 68.5, 96.9 -> 94.6, 223.6 -> 239.5. scripts/bench_offline.py on
offline-mixed-48 (load 0.5-1.2): useful 91.7 tok/s, roofline fraction 0.552 with "xla"; 83.6
tok/s, 0.496 with "cpu_native" (the same 48 output lengths); ms per step by bucket, xla ->
cpu_native: 1 row 31.6 -> 29.3, 4: 44.7 -> 60.4, 8: 54.8 -> 69.1, 24: 117.7 -> 143.6, 48:
165.1 -> 219.3. It wins only at one row, so the default stays "xla". In isolation the
kernel reads a 113 MB [576, 49152] W at ~20 GB/s at 1 row (XLA ~24) and is compute-bound
from ~8 rows (then 4 x 64 register blocks, ~50 GFLOP/s a thread, XLA's GEMM ~80; now 6 x 64); with num_threads=2 it
measured about as fast as with 1 (not explained yet: the second pool thread may start late, or
one thread's reads already saturate what this access pattern gets). What might win: a
packed W layout ([N / 64, K, 64], each tile one contiguous stream) prepared at load, a larger
register block for M >= 8, the stacked [L, K, N] weight passed with the layer index (the kernel
takes it; the decoder's scan still hands it per-layer slices).

Not for tensor parallelism: a weight split over "tp" would be gathered whole around the custom
call, so a mesh with tp > 1 refuses "cpu_native" (`resolve`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.small_matmul import cpu_native as smm_cpu
from sharding import backends

# The names matmul_impl takes; FLOAT_MATMUL has exactly these rows, in this order.
MATMUL_IMPLS = ("xla", "cpu_native")
# Most rows (batch x tokens) a projection may have to take the native kernel: decode buckets
# (max_num_seqs up to 64) and speculative verification; prefill chunks keep XLA's GEMM.
MAX_ROWS = 64

FLOAT_MATMUL = backends.Table(field="matmul_impl", logger="jaxserve.float_matmul",
                              auto=lambda platform: (("xla", None),), rows=(
    backends.Backend("xla", ("cpu", "gpu", "tpu"), None),
    backends.Backend("cpu_native", ("cpu",), smm_cpu.small_matmul_cpu, unavailable=smm_cpu.unavailable_reason),
))


@dataclasses.dataclass(frozen=True)
class FloatMatmul:
    """The model's float matmul: one resolved row of FLOAT_MATMUL and its row limit. Hashable,
    so a model can hold it statically."""

    backend: backends.Backend
    max_rows: int = MAX_ROWS

    @property
    def name(self) -> str:
        return self.backend.name

    def takes(self, rows: int, x_dtype, w_dtype, out_dtype) -> bool:
        """Whether a [rows, K] @ [K, N] product runs the native kernel (decided at trace time)."""
        f32 = jnp.dtype(jnp.float32)
        return (self.backend.fn is not None and 0 < rows <= self.max_rows and jnp.dtype(x_dtype) == f32
                and jnp.dtype(w_dtype) == f32 and jnp.dtype(out_dtype) == f32)

    def __call__(self, x, w):
        """x [M, K] @ w [K, N] -> [M, N] fp32."""
        return self.backend.fn(x, w)


def resolve(impl: str, *, tp: int = 1) -> FloatMatmul | None:
    """The FloatMatmul for `impl`, checked for this backend; None for "xla" (plain jnp.einsum)."""
    row = FLOAT_MATMUL.resolve(impl)
    if row.fn is None:
        return None
    if tp > 1:
        raise ValueError(f"matmul_impl: {impl!r} runs on one device; this mesh has tp = {tp} (use 'xla')")
    return FloatMatmul(row)
