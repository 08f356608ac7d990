"""Ragged paged attention as a native CPU kernel: an XLA FFI custom call written in C++
(pallas_kernels/native/ragged_paged_attention_cpu.cc; `attention_impl="cpu_native"`).

Same contract as `reference.ref_ragged_paged_attention`, for fp32 queries and
fp32 caches with a head dim that is a multiple of 8; anything else is refused by
`check_supported` at start-up, never run on another path.

The library is built at install time as a compiled extension (setup.py: `make setup`, i.e.
`pip install -e .`, with the XLA FFI headers jaxlib ships) into
pallas_kernels/native/_ragged_paged_attention_cpu*.so, and registered with XLA:CPU on first use.
It carries the hash of the source it was built from; a library built from another source is
refused (`unavailable_reason`), never run. attention_impl="auto" picks this kernel on the CPU
when the library is present and the model takes it (sharding/ops.py), and says once at
start-up why it did not otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_cache, native_library
from pallas_kernels.native_library import NativeBuildError
from pallas_kernels.ragged_paged_attention import reference as rpa

_SOURCE = Path(__file__).parents[1] / "native" / "ragged_paged_attention_cpu.cc"
_LIBRARY = "_ragged_paged_attention_cpu"  # setup.py's extension name, in pallas_kernels/native/
_SYMBOL = "JaxserveRaggedPagedAttentionCpu"
_TARGET = "jaxserve_ragged_paged_attention_cpu"


def check_supported(*, head_dim: int, q_dtype=None, kv_dtype=None) -> None:
    """Refuse, naming the field, what the native kernel does not take."""
    if head_dim % 8:
        raise ValueError(f"attention_impl 'cpu_native' needs head_dim a multiple of 8, this model's is {head_dim}; "
                         f"use attention_impl='xla'")
    for name, dtype in (("dtype", q_dtype), ("kv_cache_dtype", kv_dtype)):
        if dtype is not None and jnp.dtype(dtype) != jnp.float32:
            raise ValueError(f"attention_impl 'cpu_native' takes float32 only; {name} is {jnp.dtype(dtype).name}; "
                             f"use attention_impl='xla' (or --dtype float32 and --kv-cache-dtype auto)")


def source_hash() -> str:
    """sha256 of the kernel source, 16 hex digits: what setup.py builds into the library."""
    return native_library.source_hash(_SOURCE)


def library_path() -> Path | None:
    """The installed library, or None where the install did not build it."""
    return native_library.library_path(_SOURCE, _LIBRARY)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    return native_library.load(_SOURCE, _LIBRARY, "attention", ": no C++ compiler or jaxlib headers then?")


def unavailable_reason() -> str | None:
    """None where the built library is here, loads and matches the source; else why not."""
    return _load()[1]


def available() -> bool:
    return unavailable_reason() is None


@functools.cache
def ensure_registered() -> None:
    """Load the installed library and register the custom call with XLA:CPU, once per process."""
    lib, why = _load()
    if lib is None:
        raise NativeBuildError(f"attention_impl 'cpu_native': {why}; or use attention_impl='xla'")
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")


def ragged_paged_attention_cpu(q, k_cache, v_cache, layer, positions, token_seq, block_tables, *,
                               sliding_window: int | None = None, soft_cap: float | None = None,
                               q_block: int = 32, num_threads: int = 0):
    """q [T, N, H] over caches [L, P, page, K * H] or [L, P, page, K, H]; every argument as in
    ref_ragged_paged_attention. `q_block`: most tokens of one sequence per work item;
    `num_threads`: worker threads per call (0 = one per core). Padding rows are zeros."""
    rpa.validate(q, k_cache, v_cache, positions, token_seq, block_tables)
    if kv_cache.is_quantized(k_cache):
        raise ValueError("attention_impl 'cpu_native' takes float32 caches, not int8; use attention_impl='xla'")
    check_supported(head_dim=q.shape[-1], q_dtype=q.dtype, kv_dtype=k_cache.dtype)
    # The caches go in as stored: the C++ side takes K from [.., K * H] and q's head dim. A
    # reshape to [.., K, H] here, free as it looks, made XLA copy the whole donated cache on
    # every call (batch-1 decode 0.2 tok/s against xla's 30).
    ensure_registered()
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(()), positions.astype(jnp.int32),
                token_seq.astype(jnp.int32), block_tables.astype(jnp.int32),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
                q_block=np.int64(q_block), num_threads=np.int64(num_threads))
