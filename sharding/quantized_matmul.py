"""The quantized-matmul seam: every matmul of the model against a quantized weight goes through
`quantized_matmul`, which runs one implementation, chosen by name:

  "xla"                   reference.xla_quantized_matmul: dequantize then one fp32 dot; runs
                          everywhere, the CPU path (measured fastest there, docs/quantization.md)
  "ref"                   reference.ref_quantized_matmul, the definition (tests)
  "pallas_tpu"            the Mosaic TPU kernel, TPU only
  "pallas_gpu"            the Triton GPU kernel, NVIDIA GPUs only
  "pallas_tpu_interpret"  the same kernels in Pallas's interpret mode, on CPU, so tests can
  "pallas_gpu_interpret"  run a whole model through them (slow; tiny models only)
  "auto"                  by backend: TPU -> pallas_tpu, GPU -> pallas_gpu, CPU -> xla

There is no silent fallback: an implementation this backend cannot run is a ValueError naming
it, and a shape a kernel cannot take is a ValueError from the kernel when it is traced (which
the engine does for every bucket at warm-up).

Tensor parallelism: a weight split over the mesh's "tp" axis (sharding/rules.quantized_spec)
runs its matmul per shard under shard_map, so every implementation, the Pallas kernels
included, sees one device's plain [N/tp, K] or [N, K/tp] matrix:
  "n"  column-parallel: x replicated, each device computes its output columns [M, N/tp]
  "k"  row-parallel: x split along K like the weight's input groups, each device computes a
       partial [M, N] in fp32 and a psum adds them (then the cast to out_dtype)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.quantized_matmul import gpu as qmm_gpu
from pallas_kernels.quantized_matmul import reference as qmm_ref
from pallas_kernels.quantized_matmul import tpu as qmm_tpu

QUANT_IMPLS = ("xla", "ref", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")
_BACKEND_OF = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def check_quant_impl(impl: str) -> str:
    """Resolve `impl` ("auto" by backend) and check this backend runs it; returns the name."""
    backend = jax.default_backend()
    if impl == "auto":
        impl = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, "xla")
    if impl not in QUANT_IMPLS:
        raise ValueError(f"quantized matmul impl {impl!r} is not available; choose one of {QUANT_IMPLS} or 'auto'")
    need = _BACKEND_OF.get(impl)
    if need is not None and backend != need:
        raise ValueError(f"quantized matmul impl {impl!r} needs a {need.upper()} backend, this one is "
                         f"{backend!r}; use {impl + '_interpret'!r} to run the kernel on CPU, or 'xla'")
    return impl


def quantized_matmul(x, q, scale, zero=None, *, bits: int, group_size: int, impl: str = "auto",
                     out_dtype=None, shard: tuple | None = None):
    """x [M, K] @ W^T -> [M, N], W quantized as in pallas_kernels/quantized_matmul/reference.py:
    q int8 [N, K] or uint8 [N, K/2] (int4), scale / zero [N, K/G]. shard: None, or (mesh, "n" |
    "k") for a weight split over the mesh's "tp" axis (module docstring)."""
    impl = check_quant_impl(impl)
    kw = dict(bits=bits, group_size=group_size, impl=impl)
    if shard is None:
        return _local(x, q, scale, zero, out_dtype=out_dtype, **kw)
    mesh, split = shard
    if split not in ("n", "k"):
        raise ValueError(f"quantized matmul shard split {split!r}: expected 'n' or 'k'")
    w_spec = P("tp", None) if split == "n" else P(None, "tp")
    specs = (P() if split == "n" else P(None, "tp"), w_spec, w_spec) + ((w_spec,) if zero is not None else ())
    if split == "n":
        def body(x, q, scale, *zero):
            return _local(x, q, scale, zero[0] if zero else None, out_dtype=out_dtype, **kw)
        out_spec = P(None, "tp")
    else:
        def body(x, q, scale, *zero):
            part = _local(x, q, scale, zero[0] if zero else None, out_dtype=jnp.float32, **kw)
            return jax.lax.psum(part, "tp").astype(out_dtype or x.dtype)
        out_spec = P()
    # check_vma=False: the Pallas calls inside carry no varying-axis annotations.
    f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
    return f(x, q, scale, *(() if zero is None else (zero,)))


def _interpret(impl: str):
    return interpret_mode.impl_fill() if impl.endswith("_interpret") else False


def _local(x, q, scale, zero, *, bits: int, group_size: int, impl: str, out_dtype):
    kw = dict(bits=bits, group_size=group_size, out_dtype=out_dtype)
    if impl == "xla":
        return qmm_ref.xla_quantized_matmul(x, q, scale, zero, **kw)
    if impl == "ref":
        return qmm_ref.ref_quantized_matmul(x, q, scale, zero, **kw)
    if impl.startswith("pallas_tpu"):
        return qmm_tpu.quantized_matmul_tpu(x, q, scale, zero, interpret=_interpret(impl), **kw)
    return qmm_gpu.quantized_matmul_gpu(x, q, scale, zero, interpret=_interpret(impl), **kw)
