"""Ragged paged attention as a native CPU kernel: an XLA FFI custom call written in C++
(pallas_kernels/native/ragged_paged_attention_cpu.cc; `attention_impl="cpu_native"`).

Same contract as `ragged_paged_attention.ref_ragged_paged_attention`, for fp32 queries and
fp32 caches with a head dim that is a multiple of 8; anything else is refused by
`check_supported` at start-up, never run on another path.

The library is compiled on first use with the machine's C++ compiler (`$CXX`, else g++) and
`-march=native`, and kept in `$JAXSERVE_NATIVE_CACHE` (default ~/.cache/jaxserve/native) under a
name hashed from the source, the flags, the compiler, jax and the host (a -march=native build
is for this machine's CPU; a home shared between hosts must not hand it to another), so a
change to any of them builds afresh; concurrent processes (pytest-xdist, multi-process jobs)
never see half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_cache
from pallas_kernels import ragged_paged_attention as rpa

_SOURCE = Path(__file__).parent / "native" / "ragged_paged_attention_cpu.cc"
_SYMBOL = "JaxserveRaggedPagedAttentionCpu"
_TARGET = "jaxserve_ragged_paged_attention_cpu"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread")


class NativeBuildError(RuntimeError):
    """The native kernel could not be compiled or loaded; the message says why and what to use."""


def check_supported(*, head_dim: int, q_dtype=None, kv_dtype=None) -> None:
    """Refuse, naming the field, what the native kernel does not take."""
    if head_dim % 8:
        raise ValueError(f"attention_impl 'cpu_native' needs head_dim a multiple of 8, this model's is {head_dim}; "
                         f"use attention_impl='xla'")
    for name, dtype in (("dtype", q_dtype), ("kv_cache_dtype", kv_dtype)):
        if dtype is not None and jnp.dtype(dtype) != jnp.float32:
            raise ValueError(f"attention_impl 'cpu_native' takes float32 only; {name} is {jnp.dtype(dtype).name}; "
                             f"use attention_impl='xla' (or --dtype float32 and --kv-cache-dtype auto)")


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path() -> Path:
    """Where the built library is (or will be) for this source, compiler, jax and host."""
    cache = Path(os.environ.get("JAXSERVE_NATIVE_CACHE") or Path.home() / ".cache" / "jaxserve" / "native")
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeBuildError(f"attention_impl 'cpu_native' is compiled on first use and needs a C++ compiler: "
                               f"{_compiler()!r} failed ({e}); install g++ (or set CXX), or use "
                               f"attention_impl='xla'") from e
    h = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), version.encode(), jax.__version__.encode(),
                 platform.machine().encode(), platform.node().encode()):
        h.update(part)
    return cache / f"ragged_paged_attention_cpu-{h.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the library unless this exact build is already there; returns its path."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [_compiler(), *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        os.unlink(tmp)
        raise NativeBuildError(f"attention_impl 'cpu_native': building {_SOURCE.name} failed "
                               f"({' '.join(cmd)}):\n{proc.stderr[-4000:]}\nuse attention_impl='xla'")
    os.replace(tmp, out)  # atomic: a concurrent process sees the old state or the whole file
    return out


@functools.cache
def ensure_registered() -> None:
    """Build (if needed), load and register the custom call with XLA:CPU, once per process."""
    lib = ctypes.cdll.LoadLibrary(str(build()))
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
    # The C++ side reads K from the cache's dims: give it [L, P, page, K, H] (a free reshape here).
    k_cache, v_cache = kv_cache.as_heads(k_cache, q.shape[-1]), kv_cache.as_heads(v_cache, q.shape[-1])
    ensure_registered()
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(()), positions.astype(jnp.int32),
                token_seq.astype(jnp.int32), block_tables.astype(jnp.int32),
                sliding_window=np.int64(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0),
                q_block=np.int64(q_block), num_threads=np.int64(num_threads))
