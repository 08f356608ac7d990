"""The attention seam: the ATTENTION backend table (sharding/backends.py), one row per
implementation, resolved once at start-up (`resolve`) into the callable the model's attend
runs (model/paged_attention.py). The rows:
  "xla"                   plain XLA reading each sequence's KV once per query block
                          (pallas_kernels.ragged_paged_attention.blocked); runs everywhere,
                          the CPU path of development, CI and CPU serving
  "xla_reference"         the per-token pure-jnp reference (ragged_paged_attention.reference), the
                          definition the others are tested against; slow for prefill
  "pallas_tpu"            the Mosaic TPU kernel (ragged_paged_attention.tpu), TPU only
  "pallas_gpu"            the Mosaic GPU kernel (ragged_paged_attention.gpu), Hopper GPUs only
  "pallas_tpu_interpret"  the same kernels under their interpret modes: on CPU, so tests can
  "pallas_gpu_interpret"  run the whole engine through them (slow; tiny models only); uninitialised
                          memory NaN, or zeros with JAXSERVE_INTERPRET_FILL=zero (interpret.py)
  "cpu_native"            a C++ XLA FFI kernel for the CPU (ragged_paged_attention.cpu_native), built
                          at install time (setup.py); fp32 only; the fastest CPU path for
                          decode and speculative verification
  "auto"                  by backend: TPU -> pallas_tpu, GPU -> pallas_gpu, CPU -> cpu_native
                          where its library was built and the model takes it (fp32, head dim a
                          multiple of 8, no int8 KV), else xla; which one and why is logged once
There is no silent fallback: an implementation this backend cannot run, or a model shape a
kernel cannot take (head dim, page size, dtype, heads per KV head), is a ValueError at
start-up that names it; "auto" logs once what it took and why it passed over the others.
The kernels validate the full shapes again when they are traced, which the runner does for
every bucket at warm-up.
Sharding of these calls over a device mesh (shard_map) lives in sharding/rules.py.
"""

from __future__ import annotations

from pallas_kernels import interpret as interpret_mode
from pallas_kernels import kv_cache
from pallas_kernels.ragged_paged_attention import reference as rpa
from pallas_kernels.ragged_paged_attention import blocked as rpa_blocked
from pallas_kernels.ragged_paged_attention import cpu_native as rpa_cpu
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import tpu as rpa_tpu
from sharding import backends

# The names attention_impl takes (besides "auto"); the ATTENTION table below has exactly these
# rows, in this order (tests/test_backends.py holds them equal).
ATTENTION_IMPLS = ("xla", "xla_reference", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret",
                   "cpu_native")

# Was off ("auto" on the CPU took xla): the native kernel won attention alone but not every
# batched decode step. A/B, interleaved ABAB, medians (2-core machine shared with other jobs,
# load average in brackets; the engine rows by scripts/ab_native_attention.py):
#   attention only, SmolLM2 shapes (9:3 heads, head dim 64, fp32, page 16), stored cache layout,
#   5 reps [load 1.0-2.2]: xla / native = 4.4x, 2.5x, 2.1x (context 512; batch 8, 32, 64) and
#   2.0x, 1.6x, 1.9x (context 2048).
#   whole engine, SmolLM2 fp32, B requests of 64 prompt tokens, median decode step in ms, xla vs
#   native: B=8: 101 vs 123 [2.8] (native slower in 4/4 pairs), 150 vs 188 [5], 304 vs 347 [10];
#   B=32: 782 vs 672 [11-14]; B=64: 382 vs 326 [4.7] (native faster in 4/4), 534 vs 597 [5-10].
# So native lost ~20% at batch 8 with short contexts (a per-call cost that attention alone
# did not show, ~0.7 ms per layer call) while it won at batch 64. The per-call cost was the
# kernel starting a std::thread on every call (30 a step); it now runs on XLA's intra-op pool.
# After that change (same machine, load average in brackets, interleaved):
#   attention only, 30 layers, one row at context 100 [6-9], 2 x 3 cache sizes: old native
#   1.9-30 ms (erratic), new 0.66-1.9 ms, xla 2.4-3.3 ms.
#   whole engine (scripts/ab_native_attention.py, medians of 4 ABAB reps), xla vs native:
#   64-token prompts: B=8 198 vs 206 ms wall, 115 vs 110 ms CPU [6.5]; B=32 605 vs 514 wall,
#   247 vs 214 CPU [8-9]; 512-token prompts: B=1 119 vs 79 wall, 87 vs 71 CPU [5.7];
#   B=8 93 vs 91 wall, 153 vs 119 CPU [3.4-4.6].
#   again at load 2.3-5.7, 512-token prompts: B=1 93 vs 70 ms wall (1.32x), B=8 163 vs 133
#   (1.22x), B=32 335 vs 218 (1.54x); CPU 92 vs 70, 164 vs 145, 293 vs 262.
#   scripts/profile_decode.py, rows 1/8/24/48 at contexts 600-2000, back to back [3.1-4.2]:
#   whole step xla vs native 92 vs 73, 197 vs 173, 578 vs 450, 967 vs 767 ms; attention
#   alone 37 vs 16, 96 vs 66, 418 vs 285, 706 vs 528 ms.
# So native now ties or wins at every batch measured and uses less CPU everywhere, and since it
# splits a row's keys by the row alone (fixed 512-key parts) its outputs are as batch-invariant
# as xla's. On: "auto" on the CPU takes it wherever it takes the model (fp32 queries and cache;
# bf16 or int8 KV fall back to xla, said once at start-up), and the whole suite runs through it.
AUTO_PREFERS_NATIVE = True

_ANY = ("cpu", "gpu", "tpu")


# Each row's callable: (q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
# sliding_window, soft_cap, kv_chunk_pages, max_decode_run) -> out [T, N, H]; the arguments a
# kernel has no use for (its own blocking) are dropped here, in one place.
def _xla(*args, sliding_window, soft_cap, kv_chunk_pages, max_decode_run):
    return rpa_blocked.blocked_ragged_paged_attention(*args, sliding_window=sliding_window,
                                                      kv_chunk_pages=kv_chunk_pages, soft_cap=soft_cap,
                                                      decode_queries=max_decode_run)


def _xla_reference(*args, sliding_window, soft_cap, kv_chunk_pages, max_decode_run):
    return rpa.ref_ragged_paged_attention(*args, sliding_window=sliding_window, kv_chunk_pages=kv_chunk_pages,
                                          soft_cap=soft_cap)


def _cpu_native(*args, sliding_window, soft_cap, kv_chunk_pages, max_decode_run):
    return rpa_cpu.ragged_paged_attention_cpu(*args, sliding_window=sliding_window, soft_cap=soft_cap)


def _pallas(kernel, interpret: bool):
    def run(*args, sliding_window, soft_cap, kv_chunk_pages, max_decode_run):
        # The interpret fill is read when the step is traced (JAXSERVE_INTERPRET_FILL).
        return kernel(*args, sliding_window=sliding_window, soft_cap=soft_cap,
                      interpret=interpret_mode.impl_fill() if interpret else False)
    return run


def _refuses(check):
    """A kernel's check_supported (raises, naming the field) as a row's `unsupported`."""
    def unsupported(**shapes):
        try:
            check(**shapes)
        except ValueError as e:
            return str(e)
        return None
    return unsupported


def _tpu_takes(*, num_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype):
    rpa_tpu.check_supported(head_dim=head_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype)


def _gpu_takes(*, num_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype):
    rpa_gpu.check_supported(head_dim=head_dim, page_size=page_size, num_q_per_kv=num_heads // num_kv_heads,
                            q_dtype=q_dtype, kv_dtype=kv_dtype)


def _native_takes(*, num_heads, num_kv_heads, head_dim, page_size, q_dtype, kv_dtype):
    rpa_cpu.check_supported(head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)


def _hopper() -> str | None:
    cc = str(getattr(backends.target_devices()[0], "compute_capability", "0.0"))
    if not cc.startswith("9."):
        return (f"attention_impl 'pallas_gpu' is a Hopper (sm_90) WGMMA kernel; this GPU is "
                f"compute capability {cc}; use attention_impl='xla'")
    return None


def _auto(platform: str):
    if platform == "tpu":
        return (("pallas_tpu", None), ("xla", None))
    if platform == "gpu":
        return (("pallas_gpu", None), ("xla", None))
    if platform == "cpu":
        return (("cpu_native", None if AUTO_PREFERS_NATIVE else
                 "not auto's choice on the CPU yet: measured at least as fast as xla's, not yet run through "
                 "the whole test suite as the default (sharding/ops.py AUTO_PREFERS_NATIVE)"),
                ("xla", None))
    return (("xla", None),)


_INTERPRET = "'{}_interpret' to run the kernel on CPU, or 'xla'"
ATTENTION = backends.Table(field="attention_impl", logger="jaxserve.attention", auto=_auto, rows=(
    backends.Backend("xla", _ANY, _xla),
    backends.Backend("xla_reference", _ANY, _xla_reference),
    backends.Backend("pallas_tpu", ("tpu",), _pallas(rpa_tpu.ragged_paged_attention_tpu, False),
                     unsupported=_refuses(_tpu_takes), instead=_INTERPRET.format("pallas_tpu")),
    backends.Backend("pallas_gpu", ("gpu",), _pallas(rpa_gpu.ragged_paged_attention_gpu, False),
                     unsupported=_refuses(_gpu_takes), unavailable=_hopper, instead=_INTERPRET.format("pallas_gpu")),
    backends.Backend("pallas_tpu_interpret", _ANY, _pallas(rpa_tpu.ragged_paged_attention_tpu, True),
                     unsupported=_refuses(_tpu_takes)),
    backends.Backend("pallas_gpu_interpret", _ANY, _pallas(rpa_gpu.ragged_paged_attention_gpu, True),
                     unsupported=_refuses(_gpu_takes)),
    backends.Backend("cpu_native", ("cpu",), _cpu_native, unsupported=_refuses(_native_takes),
                     unavailable=rpa_cpu.unavailable_reason),
))


def resolve(impl: str, *, num_heads: int | None = None, num_kv_heads: int | None = None,
            head_dim: int | None = None, page_size: int | None = None, q_dtype=None,
            kv_dtype=None) -> backends.Backend:
    """The ATTENTION row for `impl` ("auto" by backend), checked for this backend and machine;
    with the model's shapes given (head_dim and the rest), also checked to take them."""
    shapes = {}
    if head_dim is not None:
        shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                      q_dtype=q_dtype, kv_dtype=kv_dtype if kv_dtype is not None else q_dtype)
    return ATTENTION.resolve(impl, **shapes)


def check_impl(impl: str, **shapes) -> str:
    """The name `resolve` picks (scripts and tests that want the name only)."""
    return resolve(impl, **shapes).name


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Write the step's new K/V [T, K, H] into the paged caches at slot_mapping [T] (-1 = skip);
    int8 caches (kv_cache.QuantizedKV) quantize on the way in."""
    return kv_cache.write_kv(k_cache, v_cache, layer, k, v, slot_mapping)


def paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                    sliding_window=None, kv_chunk_pages=16, impl="xla", soft_cap=None, max_decode_run=1):
    """q [T, N, H] over caches [L, P, page, K * H] as stored, or [L, P, page, K, H] (or int8 QuantizedKV); see
    ref_ragged_paged_attention for every shape. `impl` is resolved here, on every call: for
    scripts and tests; the model gets its row's callable once (model/paged_attention.py).
    `max_decode_run`: the longest run a step uses to decode (1, or 1 + the speculative draft
    length): the "xla" path gives runs up to that length its decode loop; results are the
    same for every value, only the speed differs."""
    return resolve(impl).fn(q, k_cache, v_cache, layer, positions, token_seq, block_tables,
                            sliding_window=sliding_window, soft_cap=soft_cap, kv_chunk_pages=kv_chunk_pages,
                            max_decode_run=max_decode_run)
