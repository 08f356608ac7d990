"""The float-matmul seam: the FLOAT_MATMUL backend table (sharding/backends.py) for the model's
float projections and LM head, resolved once at load (`resolve`, from LoadConfig.matmul_impl)
into the `FloatMatmul` the Decoder holds and model/quant_linear.einsum consults. The rows:

  "xla"                jnp.einsum, XLA's own dot (every backend; auto's choice off the CPU)
  "cpu_native_packed"  auto's choice on the CPU for fp32 and bf16 weights on one device (bf16 tiles
                       widened to fp32 in registers: the fp32 product of the same weights, from
                       half the bytes; x cast to fp32 for the call), where the library's
                       build measured faster than XLA (AUTO_BY_VECTOR_WIDTH: AVX-512 and AVX2
                       builds; a scalar build was never measured): the C++ kernel
                       (pallas_kernels/small_matmul/cpu_native.py) on weights the loader
                       packed as [N/64, K, 64] (loading.pack_float_weights; a tied embedding as
                       the LM head's [D, V]), the decoder passing the whole stacked weight and
                       the layer index (XLA's scan would copy each layer's slice first). Every
                       fp32 product of a packed weight takes it: up to 128 rows (64 on AVX2;
                       every decode bucket) a chunked small-M loop (the next chunk prefetched), above that
                       (prefill chunks) a GEMM loop of whole-K register blocks over
                       48-row panels of x held in L2; until session 11 prefill chunks ran
                       XLA's dot on an unpacked per-layer copy. Decided when the step is traced (shapes are static).
                       Products of one input (q, k, v; gate, up) go as one call
                       (quant_linear.einsums -> FloatMatmul.packed_many).
  "cpu_native"         the same kernel on unpacked [K, N] weights (slower beyond one row: kept to
                       compare).

bf16 weights through the packed row (2-core AMD EPYC Zen 4, 2026-12-08, SmolLM2 in bf16, two
interleaved runs each): on jax 0.10.2, whose XLA:CPU has no fast bf16 dot, `jaxserve generate`
decoded 37.4 / 30.3 tok/s against 4.2 / 4.2 through xla (41.8 / 40.7 in fp32); on jax 0.12.0.1
a wash: bench_generate's batch-1 engine 61.2 / 72.3 against xla's 68.1 / 68.4, bench_offline
offline-mixed-48 94.6 / 90.2 useful tok/s against 74.3 / 98.8 (each run's outputs differ in
length: bf16 rounding). So auto takes the packed row for bf16 too.

Measured on the idle 2-core machine (SmolLM2-135M fp32, attention cpu_native; run-to-run spread
about 15%, and the roofline's bandwidth probe itself moved from 28 to 44 GB/s between runs):
  scripts/bench_offline.py offline-mixed-48: xla 91.2 useful tok/s, roofline fraction 0.502;
    cpu_native_packed 107.1 / 96.7 / 110.2 tok/s, 0.605 / 0.589 / 0.569 (the last two as auto,
    the last with the spread attention prefetch too); ms per step, xla -> packed (first pair):
    1 row 29.1 -> 23.0, 4: 43.3 -> 28.4, 8: 53.6 -> 40.0, 16: 73.9 -> 58.9, 24: 100.4 -> 86.8,
    48: 169.3 -> 139.4, the 512-token prefill bucket 869.5 -> 806.7
  scripts/profile_decode.py, the layers without attention: 20.4 ms at 1 row (xla) against 15.7
    (packed, 27 GB/s of weights); at 24 rows 60.2 against 35.8
  the same run with MAX_ROWS = 512 (prefill through the packed kernel, no unpacked copy): 114.0
    tok/s, the prefill bucket 811.8 ms a step, no better than the copy's 817.5; xla's own, same
    hour: 742.6 ms (and 93.5 tok/s overall)
  scripts/bench_generate.py batch-1: the engine at 48.5 tok/s, its bandwidth ceiling's 100%
    (26.1 GB/s measured by that script's probe)
  Earlier (loaded machine): the unpacked kernel won only at one row (bench_offline 82.9 against
    xla's 87.3 tok/s); packing the tiles is what made it win at 4-48 rows.

Session 11 (same machine; tied head packed, next-chunk prefetch, the prefill loop), packed
against xla, ms per product (bench_small_matmul, cold W, noisy +-15%): 576x1536 at 8 rows 0.18
against 0.29, 40 rows 0.45-0.53 against 0.53-0.83, 512 rows 4.52 (200 GFLOP/s) against 4.64;
1536x576 at 512 rows 4.81 against 4.93. bench_offline: 119.3 useful tok/s, 0.684 of the step
roofline (the 512-token bucket 761.7 ms a step, 0.77 of its roofline).

Session 12: the packed entry takes the step's live-row count (Decoder.hidden(live_tokens=),
head(live_rows=), from the runner) and skips the bucket's padding rows (10-25% of a decode
step's rows on offline-mixed-48). profile_decode, the step at contexts 100-700, interleaved A/B
(without -> with): 12 rows in bucket 16, 46-52 -> 35-37 ms (also the chunked loop, not the GEMM
loop, for 12 live rows); 20 rows in bucket 24, 64-73 -> 62-66; 40 rows in bucket 48, 115-131 ->
111-114.

Not for tensor parallelism: a weight split over "tp" would be gathered whole around the custom
call, so a mesh with tp > 1 refuses the native rows ("auto" takes xla there, and a runner on a
mesh unpacks a packed model first).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.small_matmul import cpu_native as smm_cpu
from sharding import backends

# The names matmul_impl takes; FLOAT_MATMUL has exactly these rows, in this order.
MATMUL_IMPLS = ("xla", "cpu_native", "cpu_native_packed")
# Most rows (batch x tokens) a projection may have to take the unpacked native kernel ("cpu_native",
# whose chunked loop re-reads x per panel): decode buckets and speculative verification. The
# packed row has no limit (its prefill loop).
MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class BuildMeasurement:
    """What "auto" does with one build of the native matmul library, and the measurement behind it."""

    build: str  # the instruction set the library was compiled for
    packed_wins: bool  # the packed kernel beat XLA's dot in the engine
    measured: str  # the figures, which machine, when


# "auto" per vector width of the library's build (smm_cpu.vector_width(), floats): the packed
# kernel where it beat XLA's dot in the engine, on scripts/bench_offline.py's default natural-text
# run (shared/workloads/offline-mixed-48.json, SmolLM2-135M fp32, every other setting default;
# useful tok/s and the fraction of the step roofline, median of 3 runs, the range in brackets).
# A width with no row (a scalar build) was never measured: auto takes xla there.
AUTO_BY_VECTOR_WIDTH = {
    16: BuildMeasurement("AVX-512", True, (
        "2-core AMD EPYC Zen 4 (AVX-512), 2026-12-06: packed 137.6 tok/s [131.6-138.7], 0.76 "
        "[0.72-0.80] of the step roofline, against xla 104.4 tok/s, 0.55 (one run)")),
    # Measured on the same Zen 4 with the library built -march=x86-64-v3 (AVX2 + FMA, 16 ymm): no
    # AVX2-only machine was at hand. XLA's own dot runs its AVX-512 kernels there whatever the
    # library's build (--xla_cpu_max_isa=AVX2 left it unchanged), so xla is if anything flattered
    # against a real AVX2 machine. Until 2026-12-06 auto took xla for this build: an earlier
    # measurement had it 7% slower overall, before the chunked loop took AVX2 products of up to
    # 64 rows (small_matmul_cpu.cc kGemmLoopAbove: the 16- to 48-row decode steps ran 15-25%
    # faster). Batch-1 decode (bench_generate.py) is where this build trailed the AVX-512 one on
    # the Zen 4: 37-39 tok/s (80-86% of that script's one-thread bandwidth ceiling of the time)
    # against 51-55, and xla's 34-38; the trace had every projection 15-25% slower at one row and
    # the small k / v ones 2x, which register blocks of 8 accumulator chains at one row did not
    # change there.
    # Measured again on a 2-core Intel Xeon (AVX-512, AMX; 480 MB L3), the AVX2 build before and
    # after its blocks of 1-3 rows were widened to read whole or half 64-column tile rows
    # (small_matmul_cpu.cc vecs_for, kChunkRows): 105.5 tok/s [104.1-106.9], 0.47 [0.46-0.47] ->
    # 110.2 [109.0-111.9], 0.50 [0.50-0.51]; ms a step (the median runs) 1 row 32.4 -> 25.8
    # (the AVX-512 build's 26.5), 4 rows 38.6 -> 30.0, 16: 56.0 -> 54.2, 48: 123.1 -> 121.1;
    # batch-1 engine decode 33.6 -> 44.6 tok/s (AVX-512: 44.0), 62% -> 79% of bench_generate's
    # bandwidth ceiling (AVX-512: 82%). The roofline there is XLA's AVX-512 GEMM peak (325
    # GFLOP/s), which no AVX2 code reaches: prefill (the 512-token bucket, 0.50) is where this
    # build trails; xla's own AVX-512 dots took that bucket in 513 ms against 770.
    # Same Xeon, 2026-12-07, the chunked loop's prefetch shared out over its row blocks (two
    # interleaved runs each): this build 114.7 / 116.9 -> 117.9 / 119.2 tok/s, ms a step 8 rows
    # 42.7 / 41.6 -> 36.1 / 34.6, 24: 74.2 / 73.9 -> 68.1 / 68.8, 48: 117.8 / 113.7 -> 108.2 /
    # 106.7; the AVX-512 build (now the chunked loop up to 128 rows too) 152.2 / 150.2 -> 154.3 /
    # 157.0 tok/s, 0.69 / 0.69 -> 0.71 / 0.72 of the step roofline.
    # Same Zen 4 family, 2026-12-07, as an AVX2-only machine: a fresh clone set up and run under
    # scripts/avx2_only (AVX-512 and AMX masked out of CPUID for every program: the library built
    # -march=native came out AVX2, XLA and its libraries dispatched for AVX2), three runs of each
    # matmul_impl (medians: the string's first figures); outputs identical to HF transformers' on
    # 48 / 48 (a fourth run, 0.73). Unmasked the same evening, this build 140.6 / 142.9 / 139.3
    # tok/s, 0.83 / 0.79 / 0.69, and the AVX-512 build 145.4 / 144.2 / 143.4, 0.81 / 0.78 / 0.78.
    8: BuildMeasurement("AVX2 + FMA", True, (
        "2-core AMD EPYC Zen 4 with AVX-512 masked out of CPUID (scripts/avx2_only), 2026-12-07: packed "
        "133.4 tok/s [130.6-137.9], 0.71 [0.66-0.74] of the step roofline, against xla 98.4 tok/s "
        "[96.1-98.9], 0.56 [0.56-0.58]; "
        "AVX2 build on a 2-core AMD EPYC Zen 4, 2026-12-06: packed 123.0 tok/s [120.3-127.2], 0.70 "
        "[0.69-0.72] of the step roofline, against xla 101.1 tok/s [96.7-103.2], 0.57 [0.56-0.58]; "
        "on a 2-core Intel Xeon (AVX-512, AMX), 2026-12-06: packed 110.2 tok/s [109.0-111.9], 0.50 "
        "[0.50-0.51], against xla (its dots AVX-512 there) 108.4 tok/s, 0.48 (one run)")),
}


def _auto(platform: str):
    # Other backends' own dots already read weights at their bandwidth.
    if platform != "cpu":
        return (("xla", None),)
    width = smm_cpu.vector_width()
    skip = None
    if width is not None:
        m = AUTO_BY_VECTOR_WIDTH.get(width)
        if m is None:
            skip = (f"the native matmul library is built for {width}-float vectors, a build never measured "
                    f"against xla (sharding/float_matmul.py AUTO_BY_VECTOR_WIDTH)")
        elif not m.packed_wins:
            skip = f"its {m.build} build measured slower than xla ({m.measured})"
        else:
            backends.say_once("jaxserve.float_matmul", f"the native matmul library is an {m.build} build, "
                              f"which measured faster than xla: {m.measured}")
    return (("cpu_native_packed", skip), ("xla", None))


FLOAT_MATMUL = backends.Table(field="matmul_impl", logger="jaxserve.float_matmul", auto=_auto, rows=(
    backends.Backend("xla", ("cpu", "gpu", "tpu"), None),
    backends.Backend("cpu_native", ("cpu",), smm_cpu.small_matmul_cpu, unavailable=smm_cpu.unavailable_reason),
    # The same kernel's packed-W entry; the loader packs the float projections at load
    # (loading.pack_float_weights) and the decoder passes stacked weights with the layer index.
    backends.Backend("cpu_native_packed", ("cpu",), smm_cpu.small_matmul_packed_cpu,
                     unavailable=smm_cpu.unavailable_reason),
))


_PACKED_DTYPES = frozenset(smm_cpu.PACKED_W_DTYPES)  # what the packed kernel reads


@dataclasses.dataclass(frozen=True)
class FloatMatmul:
    """The model's float matmul: one resolved row of FLOAT_MATMUL and its row limit. Hashable,
    so a model can hold it statically."""

    backend: backends.Backend
    max_rows: int = MAX_ROWS
    # The live rows of the products it runs (an int32 scalar, traced, from `live`; None = all):
    # a step padded to its bucket computes only its real tokens in the packed kernel, whose rows
    # past them come out zero. Other rows compute the padding (its values are never read).
    live_rows: object = dataclasses.field(default=None, compare=False, hash=False)

    @property
    def name(self) -> str:
        return self.backend.name

    def takes(self, rows: int, x_dtype, w_dtype, out_dtype, *, packed: bool = False) -> bool:
        """Whether a [rows, K] @ [K, N] product runs the native kernel (decided at trace time):
        the packed row at any row count (prefill chunks too), the unpacked one up to max_rows.
        fp32 throughout, except a `packed` weight under the packed row, which may be bf16 (the
        kernel widens it as it reads) with x and the output fp32 or bf16 (quant_linear casts x
        to fp32 for the call and the result to the output dtype)."""
        fits = 0 < rows and (self.is_packed or rows <= self.max_rows)
        if self.backend.fn is None or not fits:
            return False
        dtypes = {jnp.dtype(d) for d in (x_dtype, w_dtype, out_dtype)}
        return dtypes <= (_PACKED_DTYPES if packed and self.is_packed else {jnp.dtype(jnp.float32)})

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
        return smm_cpu.small_matmul_packed_cpu(x, data, n, layer, rows=self.live_rows)

    def packed_many(self, x, datas, ns, layer) -> tuple:
        """x [M, K] @ each packed W (all stacked alike, one `layer`) -> a [M, n] fp32 each, in one
        call (smm_cpu.small_matmul_packed_many_cpu)."""
        return smm_cpu.small_matmul_packed_many_cpu(x, datas, ns, layer, rows=self.live_rows)

    def live(self, rows) -> "FloatMatmul":
        """This matmul for products whose first `rows` rows (an int32 scalar) are the live ones
        and the rest bucket padding; None: every row."""
        return dataclasses.replace(self, live_rows=rows)


def resolve(impl: str, *, tp: int = 1, dtype="float32") -> FloatMatmul | None:
    """The FloatMatmul for `impl` ("auto": by backend), checked for this backend; None for "xla"
    (plain jnp.einsum). "auto" takes "xla" where the native kernel cannot serve the model (a
    mesh with tp > 1, weights other than fp32 and bf16) and says so once. bf16 weights run
    packed only (the kernel widens them as it reads: half the bytes of fp32)."""
    if impl == "auto" and (tp > 1 or jnp.dtype(dtype) not in _PACKED_DTYPES):
        why = f"the mesh has tp = {tp}" if tp > 1 else f"the weights are {jnp.dtype(dtype).name}"
        backends.say_once(FLOAT_MATMUL.logger, f"matmul_impl 'auto': 'xla' ({why}; the native CPU kernel "
                          "runs fp32 and bf16 weights on one device)")
        return None
    row = FLOAT_MATMUL.resolve(impl)
    if row.fn is None:
        return None
    if tp > 1:
        raise ValueError(f"matmul_impl: {impl!r} runs on one device; this mesh has tp = {tp} (use 'xla')")
    if row.name == "cpu_native" and jnp.dtype(dtype) != jnp.float32:
        raise ValueError(f"matmul_impl: 'cpu_native' reads fp32 weights; these are {jnp.dtype(dtype).name} "
                         f"(use 'cpu_native_packed', 'auto' or 'xla')")
    return FloatMatmul(row)
