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

Measured (2-core machine, SmolLM2-135M fp32, attention cpu_native, each pair run back to back;
figures move 20-50% between runs with the machine's other load, so read the pairs):
  scripts/profile_decode.py, ms, xla -> cpu_native (6-row blocks; load 1.1-1.4):
    the 7 projections of all 30 layers: 1 row 28.5 -> 22.3, 4: 26.8 -> 34.9, 8: 31.8 -> 34.4,
    24: 66.4 -> 65.5; the whole step: 44.8 -> 36.9, 69.6 -> 74.4, 95.3 -> 95.6, 239.3 -> 265.4
    (with 4-row blocks, an earlier pair, load 1.0-1.7: projections 20.5 -> 21.5, 23.8 -> 30.6,
    28.8 -> 36.0, 53.9 -> 73.3)
  scripts/bench_offline.py offline-mixed-48 (load 1.4-1.7): useful 87.3 tok/s, roofline fraction
    0.494 with "xla"; 82.9 tok/s, 0.462 with "cpu_native" (the same output lengths); ms per step
    by bucket: 1 row 29.5 -> 28.8, 4: 41.3 -> 49.7, 8: 59.8 -> 88.0, 48: 180.7 -> 201.8 (4-row
    blocks, earlier: 91.7 against 83.6 tok/s)
It wins at one row only, so the default stays "xla" (a max_rows of 1 would keep just the win;
not measured end to end). In isolation it reads a 113 MB [576, 49152] W at 20-27 GB/s at 1 row
(XLA 24-36 in the same runs); with num_threads=2 it measured from as fast as 1 thread (busier
moments) to 1.7x faster. What might win: a
packed W layout ([N / 64, K, 64], each tile one contiguous stream) prepared at load, a larger
register block for M >= 8, the stacked [L, K, N] weight passed with the layer index (the kernel
takes it; the decoder's scan still hands it per-layer slices).

"cpu_native_packed" (measurement, not finished): the same kernel's packed-W entry, W packed at load
as [N/64, K, 64] (loading.pack_float_weights), the decoder passing packed stacks whole with the
layer index (no per-layer slice copy); prefill chunks einsum an unpacked copy. Measured (load 1.5-5,
other helpers running; pairs back to back):
  scripts/bench_small_matmul.py (W from DRAM, ms per product xla / unpacked / packed): [576, 1536]
    M=1 0.207/0.279/0.176, 4 0.364/0.373/0.183, 8 0.440/0.474/0.271, 24 0.685/0.793/0.559,
    48 1.063/1.322/0.986 (the other shapes alike: packed 1.6-2.2x XLA at M = 4-8, 1.1-1.25x at 24-48)
  scripts/profile_decode.py, layers without attention, ms, xla -> packed (load 1.8-2.2): 1 row
    41.3 -> 20.9, 4: 54.8 -> 20.4, 8: 62.7 -> 35.6, 24: 121.1 -> 66.4; the step 70.0 -> 48.7,
    133.9 -> 81.6, 187.1 -> 147.0, 466.8 -> 424.7
  scripts/bench_offline.py offline-mixed-48 (load 2.8-5): 39.4 -> 45.5 useful tok/s (same outputs)
Part of that gain is the whole-stack + layer index (no scan slice copy), not the layout alone.

Not for tensor parallelism: a weight split over "tp" would be gathered whole around the custom
call, so a mesh with tp > 1 refuses "cpu_native" (`resolve`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.small_matmul import cpu_native as smm_cpu
from sharding import backends

# The names matmul_impl takes; FLOAT_MATMUL has exactly these rows, in this order.
MATMUL_IMPLS = ("xla", "cpu_native", "cpu_native_packed")
# Most rows (batch x tokens) a projection may have to take the native kernel: decode buckets
# (max_num_seqs up to 64) and speculative verification; prefill chunks keep XLA's GEMM.
MAX_ROWS = 64

def _auto(platform: str):
    # The CPU takes the packed native kernel (measured in this module's docstring); other
    # backends' own dots already read weights at their bandwidth.
    if platform == "cpu":
        return (("cpu_native_packed", None), ("xla", None))
    return (("xla", None),)


FLOAT_MATMUL = backends.Table(field="matmul_impl", logger="jaxserve.float_matmul", auto=_auto, rows=(
    backends.Backend("xla", ("cpu", "gpu", "tpu"), None),
    backends.Backend("cpu_native", ("cpu",), smm_cpu.small_matmul_cpu, unavailable=smm_cpu.unavailable_reason),
    # The same kernel's packed-W entry; the loader packs the float projections at load
    # (loading.pack_float_weights) and the decoder passes stacked weights with the layer index.
    backends.Backend("cpu_native_packed", ("cpu",), smm_cpu.small_matmul_packed_cpu,
                     unavailable=smm_cpu.unavailable_reason),
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

    @property
    def is_packed(self) -> bool:
        return self.backend.name == "cpu_native_packed"

    def __call__(self, x, w):
        """x [M, K] @ w [K, N] -> [M, N] fp32."""
        if self.is_packed:  # an unpacked weight (one not packed at load) under the packed row
            return smm_cpu.small_matmul_cpu(x, w)
        return self.backend.fn(x, w)

    def packed(self, x, data, n, layer):
        """x [M, K] @ a packed W ([T, K, 64], or [L, T, K, 64] with `layer`) -> [M, n] fp32."""
        return smm_cpu.small_matmul_packed_cpu(x, data, n, layer)


def resolve(impl: str, *, tp: int = 1, dtype="float32") -> FloatMatmul | None:
    """The FloatMatmul for `impl` ("auto": by backend), checked for this backend; None for "xla"
    (plain jnp.einsum). "auto" takes "xla" where the native kernel cannot serve the model (a
    mesh with tp > 1, weights other than fp32) and says so once."""
    if impl == "auto" and (tp > 1 or jnp.dtype(dtype) != jnp.float32):
        why = f"the mesh has tp = {tp}" if tp > 1 else f"the weights are {jnp.dtype(dtype).name}"
        backends.say_once(FLOAT_MATMUL.logger, f"matmul_impl 'auto': 'xla' ({why}; the native CPU kernel "
                          "runs fp32 weights on one device)")
        return None
    row = FLOAT_MATMUL.resolve(impl)
    if row.fn is None:
        return None
    if tp > 1:
        raise ValueError(f"matmul_impl: {impl!r} runs on one device; this mesh has tp = {tp} (use 'xla')")
    return FloatMatmul(row)
