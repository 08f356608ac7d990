"""y[M, N] = x[M, K] @ W[K, N] for small M in fp32 as a native CPU kernel: an XLA FFI custom call
written in C++ (pallas_kernels/native/small_matmul_cpu.cc), built at install time by setup.py
beside the native attention kernel and loaded the same way (the library carries the hash of
the source it was built from; another source's library is refused, never run).

W may be one [K, N] matrix or a stacked [L, K, N] with a traced layer index, so a decoder's
scanned layer loop passes its stacked weights as stored and no per-layer slice is copied.
Every output is one fma chain over k in order, computed whole by one work item (threads split
N, and a prefill product of few tiles its rows too; never K): a row's result is bit-identical
whatever its batch mates and the thread count.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native_library
from pallas_kernels.native_library import NativeBuildError

_SOURCE = Path(__file__).parents[1] / "native" / "small_matmul_cpu.cc"
_LIBRARY = "_small_matmul_cpu"  # setup.py's extension name, in pallas_kernels/native/
_SYMBOL = "JaxserveSmallMatmulCpu"
_TARGET = "jaxserve_small_matmul_cpu"
_PACKED_SYMBOL = "JaxserveSmallMatmulPackedCpu"
_PACKED_TARGET = "jaxserve_small_matmul_packed_cpu"
_PACKED_MANY_SYMBOL = "JaxserveSmallMatmulPackedManyCpu"
_PACKED_MANY_TARGET = "jaxserve_small_matmul_packed_many_cpu"
TILE_N = 64  # the packed layout's tile width (kTileN in the kernel)


def source_hash() -> str:
    """sha256 of the kernel source, 16 hex digits: what setup.py builds into the library."""
    return native_library.source_hash(_SOURCE)


def library_path() -> Path | None:
    return native_library.library_path(_SOURCE, _LIBRARY)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    return native_library.load(_SOURCE, _LIBRARY, "matmul")


def unavailable_reason() -> str | None:
    """None where the built library is here, loads and matches the source; else why not."""
    return _load()[1]


def available() -> bool:
    return unavailable_reason() is None


def vector_width() -> int | None:
    """The built library's vector width in floats (16 AVX-512, 8 AVX2 + FMA, 1 scalar), None
    where it is not available."""
    lib, _ = _load()
    return None if lib is None else int(ctypes.CFUNCTYPE(ctypes.c_int)(("JaxserveSmallMatmulVectorWidth", lib))())


@functools.cache
def ensure_registered() -> None:
    lib, why = _load()
    if lib is None:
        raise NativeBuildError(f"matmul_impl 'cpu_native': {why}; or use matmul_impl='xla'")
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(_PACKED_TARGET, jax.ffi.pycapsule(getattr(lib, _PACKED_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(_PACKED_MANY_TARGET, jax.ffi.pycapsule(getattr(lib, _PACKED_MANY_SYMBOL)),
                                platform="cpu")


def check_supported(x, w, layer=None) -> None:
    """Refuse, naming the field and the limit, what the kernel does not take."""
    for name, a in (("x", x), ("w", w)):
        if jnp.dtype(a.dtype) != jnp.float32:
            raise ValueError(f"small_matmul_cpu takes float32 only; {name} is {jnp.dtype(a.dtype).name}; "
                             f"use matmul_impl='xla'")
    if x.ndim < 1:
        raise ValueError(f"small_matmul_cpu: x must have a last (K) dim, its shape is {tuple(x.shape)}")
    if w.ndim not in (2, 3):
        raise ValueError(f"small_matmul_cpu: w must be [K, N] or [L, K, N], its shape is {tuple(w.shape)}")
    if w.shape[-2] != x.shape[-1]:
        raise ValueError(f"small_matmul_cpu: x's last dim (K = {x.shape[-1]}) must equal w's dim -2 "
                         f"(w is {tuple(w.shape)})")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError(f"small_matmul_cpu: layer is needed exactly when w is stacked [L, K, N]; "
                         f"w is {tuple(w.shape)}, layer is {'given' if layer is not None else 'None'}")
    if isinstance(layer, int) and not 0 <= layer < w.shape[0]:
        raise ValueError(f"small_matmul_cpu: layer {layer} out of range [0, {w.shape[0]})")


def _operands(x, layer, rows=None):
    """The kernels' operands besides W: x flattened to [M, K], the layer index and the live-row
    count (None: all M) as int32 scalars."""
    x2 = x.reshape(-1, x.shape[-1])
    layer_arr = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    rows_arr = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32).reshape(())
    return x2, layer_arr, rows_arr


def small_matmul_cpu(x, w, layer=None, *, num_threads: int = 0):
    """x [..., K] @ w [K, N] (or w[layer] of a stacked [L, K, N]) -> [..., N], fp32.
    `layer` may be a traced int32 scalar (one executable for every layer); `num_threads`: worker
    threads per call (0 = XLA's intra-op pool size)."""
    check_supported(x, w, layer)
    ensure_registered()
    n = w.shape[-1]
    x2, layer_arr, _ = _operands(x, layer)
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, w, layer_arr, num_threads=np.int64(num_threads)).reshape(*x.shape[:-1], n)


def pack(w):
    """W [K, N] (or stacked [L, K, N]) -> the packed layout [ceil(N / 64), K, 64] (or
    [L, ceil(N / 64), K, 64]): tile t holds columns [64 t, 64 t + 64) row after row, the last tile
    zero-padded, so the kernel reads one tile down all K rows as one contiguous stream. Done once
    at load; the packed array replaces W (same bytes, plus the padding)."""
    if w.ndim not in (2, 3):
        raise ValueError(f"small_matmul_cpu.pack: w must be [K, N] or [L, K, N], its shape is {tuple(w.shape)}")
    k, n = w.shape[-2:]
    tiles = -(-n // TILE_N)
    pad = [(0, 0)] * (w.ndim - 1) + [(0, tiles * TILE_N - n)]
    wp = jnp.pad(w, pad).reshape(*w.shape[:-2], k, tiles, TILE_N)
    return jnp.moveaxis(wp, -2, -3)


# What a packed W may hold: float32, or bfloat16 (widened to fp32 in registers as it is read, so
# the product is the float32 one of W.astype(float32), bit for bit, from half the bytes).
PACKED_W_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_packed(x, w_packed, n: int, layer, name: str) -> None:
    if jnp.dtype(x.dtype) != jnp.float32:
        raise ValueError(f"small_matmul_packed_cpu takes a float32 x; x is {jnp.dtype(x.dtype).name}")
    if jnp.dtype(w_packed.dtype) not in PACKED_W_DTYPES:
        raise ValueError(f"small_matmul_packed_cpu takes a float32 or bfloat16 {name}; it is "
                         f"{jnp.dtype(w_packed.dtype).name}")
    if w_packed.ndim not in (3, 4) or w_packed.shape[-1] != TILE_N:
        raise ValueError(f"small_matmul_packed_cpu: {name} must be [T, K, {TILE_N}] or [L, T, K, {TILE_N}], "
                         f"its shape is {tuple(w_packed.shape)}")
    if w_packed.shape[-3] != -(-n // TILE_N) or w_packed.shape[-2] != x.shape[-1]:
        raise ValueError(f"small_matmul_packed_cpu: {name} {tuple(w_packed.shape)} is not pack() of a "
                         f"[K = {x.shape[-1]}, n = {n}] W")
    if (w_packed.ndim == 4) != (layer is not None):
        raise ValueError(f"small_matmul_packed_cpu: layer is needed exactly when {name} is stacked")


def small_matmul_packed_cpu(x, w_packed, n: int, layer=None, *, rows=None, num_threads: int = 0):
    """x [..., K] @ W -> [..., n] fp32, W given as pack(W) ([ceil(n / 64), K, 64], or stacked
    [L, ceil(n / 64), K, 64] with `layer`), fp32 or bf16; n is W's column count (the packing pads it).
    `rows` (an int32 scalar, may be traced; None = all): only the first `rows` rows of x (flattened
    to [M, K]) are live, as in a step padded to its bucket; the rows after them come out zero,
    unread and uncomputed."""
    _check_packed(x, w_packed, n, layer, "w_packed")
    ensure_registered()
    x2, layer_arr, rows_arr = _operands(x, layer, rows)
    call = jax.ffi.ffi_call(_PACKED_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, w_packed, layer_arr, rows_arr, num_threads=np.int64(num_threads)).reshape(*x.shape[:-1], n)


def small_matmul_packed_many_cpu(x, ws_packed, ns, layer=None, *, rows=None, num_threads: int = 0) -> tuple:
    """(x @ W_0, x @ W_1, ...) as small_matmul_packed_cpu gives each, in one call: the products of
    one input (a layer's q, k and v; gate and up), each split into the work items it has alone,
    all handed to the thread pool at once: one hand-off and one wait, where one call each left a
    thread idle at the end of every call (a GQA model's k and v are a few tiles each).
    Every W packed alike (all stacked with the same `layer`, or none); the same outputs, bit for
    bit, as one call each."""
    ws_packed, ns = tuple(ws_packed), tuple(ns)
    if not ws_packed or len(ws_packed) != len(ns):
        raise ValueError(f"small_matmul_packed_many_cpu: one n per packed weight, at least one "
                         f"(got {len(ws_packed)} weights, {len(ns)} n)")
    for i, (w, n) in enumerate(zip(ws_packed, ns)):
        _check_packed(x, w, n, layer, f"ws_packed[{i}]")
    ensure_registered()
    x2, layer_arr, rows_arr = _operands(x, layer, rows)
    call = jax.ffi.ffi_call(_PACKED_MANY_TARGET,
                            tuple(jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for n in ns))
    ys = call(x2, layer_arr, rows_arr, *ws_packed, num_threads=np.int64(num_threads))
    return tuple(y.reshape(*x.shape[:-1], n) for y, n in zip(ys, ns))
