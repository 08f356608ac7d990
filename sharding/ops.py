"""The attention seam: every paged-attention call of the model goes through here.

`paged_attention` runs one implementation, chosen once at start-up by `check_impl`:
  "xla"                   plain XLA reading each sequence's KV once per query block
                          (pallas_kernels.ragged_paged_attention_blocked); runs everywhere,
                          the CPU path of development, CI and CPU serving
  "xla_reference"         the per-token pure-jnp reference (ragged_paged_attention), the
                          definition the others are tested against; slow for prefill
  "pallas_tpu"            the Mosaic TPU kernel (ragged_paged_attention_tpu), TPU only
  "pallas_gpu"            the Mosaic GPU kernel (ragged_paged_attention_gpu), Hopper GPUs only
  "pallas_tpu_interpret"  the same kernels under their interpret modes: on CPU, so tests can
  "pallas_gpu_interpret"  run the whole engine through them (slow; tiny models only); uninitialised
                          memory NaN, or zeros with JAXSERVE_INTERPRET_FILL=zero (interpret.py)
  "cpu_native"            a C++ XLA FFI kernel for the CPU (ragged_paged_attention_cpu), built
                          at install time (setup.py); fp32 only; the fastest CPU path for
                          decode and speculative verification
  "auto"                  by backend: TPU -> pallas_tpu, GPU -> pallas_gpu, CPU -> cpu_native
                          where its library was built and the model takes it (fp32, head dim a
                          multiple of 8, no int8 KV), else xla; which one and why is logged once
There is no silent fallback: an implementation this backend cannot run, or a model shape a
kernel cannot take (head dim, page size, dtype, heads per KV head), is a ValueError at
start-up that names it. The kernels validate the full shapes again when they are traced,
which the runner does for every bucket at warm-up.
Sharding of these calls over a device mesh (shard_map) lives in sharding/rules.py.
"""

from __future__ import annotations

import functools
import logging

import jax

from pallas_kernels import interpret as interpret_mode
from pallas_kernels import kv_cache
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels import ragged_paged_attention_blocked as rpa_blocked
from pallas_kernels import ragged_paged_attention_cpu as rpa_cpu
from pallas_kernels import ragged_paged_attention_gpu as rpa_gpu
from pallas_kernels import ragged_paged_attention_tpu as rpa_tpu

ATTENTION_IMPLS = ("xla", "xla_reference", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret",
                   "cpu_native")
_BACKEND_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cpu_native": "cpu"}


log = logging.getLogger("jaxserve.attention")

# Off for now. When the cache became [L, P, page, K * H] the native kernel went ~60x slower
# than xla at batch-1 decode (a reshape to [.., K, H] before the call made XLA copy the donated
# cache per call); it now reads the stored layout in place (32.0 vs xla's 30.5 tok/s, batch 1,
# SmolLM2 fp32). Turn on after an A/B over a batched workload on an idle machine.
AUTO_PREFERS_NATIVE = False


@functools.cache
def _say_once(level: int, message: str) -> None:
    log.log(level, message)


def _auto(head_dim=None, q_dtype=None, kv_dtype=None) -> str:
    backend = jax.default_backend()
    if backend != "cpu":
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "xla")
    why = rpa_cpu.unavailable_reason()
    if why is None and not AUTO_PREFERS_NATIVE:
        why = "the native kernel is built but not yet the default (sharding/ops.py AUTO_PREFERS_NATIVE)"
    if why is None and head_dim is not None:
        try:
            rpa_cpu.check_supported(head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)
        except ValueError as e:
            why = f"this model's shapes are not the kernel's ({e})"
    if why is None:
        _say_once(logging.INFO, "attention_impl 'auto': the native CPU kernel (cpu_native)")
        return "cpu_native"
    _say_once(logging.WARNING, f"attention_impl 'auto' uses 'xla' on this CPU: {why}")
    return "xla"


def check_impl(impl: str, *, num_heads: int | None = None, num_kv_heads: int | None = None,
               head_dim: int | None = None, page_size: int | None = None, q_dtype=None,
               kv_dtype=None) -> str:
    """Resolve `impl` ("auto" by backend) and check this backend runs it; with the model's
    shapes given, also check the kernel takes them. Returns the resolved name."""
    kv = kv_dtype if kv_dtype is not None else q_dtype
    if impl == "auto":
        impl = _auto(head_dim, q_dtype, kv)
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl {impl!r} is not available; choose one of {ATTENTION_IMPLS} or 'auto'")
    backend = jax.default_backend()
    need = _BACKEND_OF.get(impl)
    if need is not None and backend != need:
        hint = "'xla'" if need == "cpu" else f"{impl + '_interpret'!r} to run the kernel on CPU, or 'xla'"
        raise ValueError(f"attention_impl {impl!r} needs a {need.upper()} backend, this one is {backend!r}; "
                         f"use {hint}")
    if impl == "pallas_gpu":
        cc = str(getattr(jax.devices()[0], "compute_capability", "0.0"))
        if not cc.startswith("9."):
            raise ValueError(f"attention_impl 'pallas_gpu' is a Hopper (sm_90) WGMMA kernel; this GPU is "
                             f"compute capability {cc}; use attention_impl='xla'")
    if impl == "cpu_native":
        if head_dim is not None:
            rpa_cpu.check_supported(head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv)
        rpa_cpu.ensure_registered()  # loads the library now: one not built fails at start-up
    elif head_dim is not None and not impl.startswith("xla"):
        if impl.startswith("pallas_tpu"):
            rpa_tpu.check_supported(head_dim=head_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv)
        else:
            rpa_gpu.check_supported(head_dim=head_dim, page_size=page_size,
                                    num_q_per_kv=num_heads // num_kv_heads, q_dtype=q_dtype, kv_dtype=kv)
    return impl


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Write the step's new K/V [T, K, H] into the paged caches at slot_mapping [T] (-1 = skip);
    int8 caches (kv_cache.QuantizedKV) quantize on the way in."""
    return kv_cache.write_kv(k_cache, v_cache, layer, k, v, slot_mapping)


def paged_attention(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                    sliding_window=None, kv_chunk_pages=16, impl="xla", soft_cap=None, max_decode_run=1):
    """q [T, N, H] over caches [L, P, page, K * H] as stored, or [L, P, page, K, H] (or int8 QuantizedKV); see
    ref_ragged_paged_attention for every shape. `impl` as resolved by check_impl.
    `max_decode_run`: the longest run a step uses to decode (1, or 1 + the speculative draft
    length): the "xla" path gives runs up to that length its decode loop; results are the
    same for every value, only the speed differs."""
    impl = check_impl(impl)
    args = (q, k_cache, v_cache, layer, positions, token_seq, block_tables)
    if impl == "xla":
        return rpa_blocked.blocked_ragged_paged_attention(*args, sliding_window=sliding_window,
                                                          kv_chunk_pages=kv_chunk_pages, soft_cap=soft_cap,
                                                          decode_queries=max_decode_run)
    if impl == "cpu_native":
        return rpa_cpu.ragged_paged_attention_cpu(*args, sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "xla_reference":
        return rpa.ref_ragged_paged_attention(*args, sliding_window=sliding_window,
                                              kv_chunk_pages=kv_chunk_pages, soft_cap=soft_cap)
    interpret = interpret_mode.impl_fill() if impl.endswith("_interpret") else False
    kernel = rpa_tpu.ragged_paged_attention_tpu if impl.startswith("pallas_tpu") else \
        rpa_gpu.ragged_paged_attention_gpu
    return kernel(*args, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
