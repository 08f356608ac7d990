"""The quantized-matmul seam: the QUANTIZED_MATMUL backend table (sharding/backends.py), one
row per implementation, resolved once at start-up (`resolve`, from the load's quant_impl) into
the `QuantizedMatmul` the model holds and every quantized projection calls
(model/quant_linear.einsum). The rows:

  "xla"                   reference.xla_quantized_matmul: dequantize then one fp32 dot; runs
                          everywhere, the CPU path (measured fastest there, docs/quantization.md)
  "ref"                   reference.ref_quantized_matmul, the definition (tests)
  "pallas_tpu"            the Mosaic TPU kernel, TPU only
  "pallas_gpu"            the Triton GPU kernel, NVIDIA GPUs only
  "pallas_tpu_interpret"  the same kernels in Pallas's interpret mode, on CPU, so tests can
  "pallas_gpu_interpret"  run a whole model through them (slow; tiny models only)
  "auto"                  by backend: TPU -> pallas_tpu, GPU -> pallas_gpu, CPU -> xla

There is no silent fallback: an implementation this backend cannot run is a ValueError naming
quant_impl, and a shape a kernel cannot take is a ValueError from the kernel when it is traced
(which the engine does for every bucket at warm-up).

Tensor parallelism: a weight split over the mesh's "tp" axis (sharding/rules.quantized_spec
picks the split; the weight records it) runs its matmul per shard under shard_map, over the
mesh the QuantizedMatmul was given (`on_mesh`, by the engine's runner when it places the
weights), so every implementation, the Pallas kernels included, sees one device's plain
[N/tp, K] or [N, K/tp] matrix:
  "n"  column-parallel: x replicated, each device computes its output columns [M, N/tp]
  "k"  row-parallel: x split along K like the weight's input groups, each device computes a
       partial [M, N] in fp32 and a psum adds them (then the cast to out_dtype)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.quantized_matmul import gpu as qmm_gpu
from pallas_kernels.quantized_matmul import reference as qmm_ref
from pallas_kernels.quantized_matmul import tpu as qmm_tpu
from sharding import backends

# The names quant_impl takes (besides "auto"); the QUANTIZED_MATMUL table below has exactly
# these rows, in this order (tests/test_backends.py holds them equal).
QUANT_IMPLS = ("xla", "ref", "pallas_tpu", "pallas_gpu", "pallas_tpu_interpret", "pallas_gpu_interpret")

_ANY = ("cpu", "gpu", "tpu")


# Each row's callable: (x [M, K], q, scale, zero, *, bits, group_size, out_dtype) -> [M, N] on
# one device's matrices.
def _pallas(kernel, interpret: bool):
    def run(x, q, scale, zero, **kw):
        # The interpret fill is read when the step is traced (JAXSERVE_INTERPRET_FILL).
        return kernel(x, q, scale, zero, interpret=interpret_mode.impl_fill() if interpret else False, **kw)
    return run


def _auto(platform: str):
    first = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform)
    return ((first, None), ("xla", None)) if first else (("xla", None),)


_INTERPRET = "'{}_interpret' to run the kernel on CPU, or 'xla'"
QUANTIZED_MATMUL = backends.Table(field="quant_impl", logger="jaxserve.quantized_matmul", auto=_auto, rows=(
    backends.Backend("xla", _ANY, qmm_ref.xla_quantized_matmul),
    backends.Backend("ref", _ANY, qmm_ref.ref_quantized_matmul),
    backends.Backend("pallas_tpu", ("tpu",), _pallas(qmm_tpu.quantized_matmul_tpu, False),
                     instead=_INTERPRET.format("pallas_tpu")),
    backends.Backend("pallas_gpu", ("gpu",), _pallas(qmm_gpu.quantized_matmul_gpu, False),
                     instead=_INTERPRET.format("pallas_gpu")),
    backends.Backend("pallas_tpu_interpret", _ANY, _pallas(qmm_tpu.quantized_matmul_tpu, True)),
    backends.Backend("pallas_gpu_interpret", _ANY, _pallas(qmm_gpu.quantized_matmul_gpu, True)),
))


@dataclasses.dataclass(frozen=True)
class QuantizedMatmul:
    """The model's quantized matmul: one resolved row of QUANTIZED_MATMUL, and the mesh a weight
    split over "tp" runs on (None: one device). Hashable, so a model can hold it statically."""

    backend: backends.Backend
    mesh: Any = None

    @property
    def name(self) -> str:
        return self.backend.name

    def on_mesh(self, mesh) -> "QuantizedMatmul":
        return dataclasses.replace(self, mesh=mesh)

    def __call__(self, x, q, scale, zero=None, *, bits: int, group_size: int, out_dtype=None,
                 split: str | None = None):
        """x [M, K] @ W^T -> [M, N], W quantized as in pallas_kernels/quantized_matmul/reference.py:
        q int8 [N, K] or uint8 [N, K/2] (int4), scale / zero [N, K/G]. split: None, or "n" | "k"
        for a weight split over the mesh's "tp" axis (module docstring)."""
        local = functools.partial(self.backend.fn, bits=bits, group_size=group_size)
        if split is None:
            return local(x, q, scale, zero, out_dtype=out_dtype)
        if split not in ("n", "k"):
            raise ValueError(f"quantized matmul split {split!r}: expected 'n' or 'k'")
        if self.mesh is None:
            raise ValueError(f"quantized matmul: the weight is split over 'tp' ({split!r}) but this matmul "
                             f"was given no mesh (QuantizedMatmul.on_mesh)")
        w_spec = P("tp", None) if split == "n" else P(None, "tp")
        specs = (P() if split == "n" else P(None, "tp"), w_spec, w_spec) + ((w_spec,) if zero is not None else ())
        if split == "n":
            def body(x, q, scale, *zero):
                return local(x, q, scale, zero[0] if zero else None, out_dtype=out_dtype)
            out_spec = P(None, "tp")
        else:
            def body(x, q, scale, *zero):
                part = local(x, q, scale, zero[0] if zero else None, out_dtype=jnp.float32)
                return jax.lax.psum(part, "tp").astype(out_dtype or x.dtype)
            out_spec = P()
        # check_vma=False: the Pallas calls inside carry no varying-axis annotations.
        f = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
        return f(x, q, scale, *(() if zero is None else (zero,)))


def resolve(impl: str) -> QuantizedMatmul:
    """The QUANTIZED_MATMUL row for `impl` ("auto" by backend), checked for this backend."""
    return QuantizedMatmul(QUANTIZED_MATMUL.resolve(impl))


def check_quant_impl(impl: str) -> str:
    """The name `resolve` picks (scripts and tests that want the name only)."""
    return QUANTIZED_MATMUL.resolve(impl).name


def quantized_matmul(x, q, scale, zero=None, *, bits: int, group_size: int, impl: str = "auto",
                     out_dtype=None, shard: tuple | None = None):
    """One call resolving `impl` on the spot (scripts and tests; the model holds its resolved
    QuantizedMatmul). shard: None, or (mesh, "n" | "k")."""
    mesh, split = shard if shard is not None else (None, None)
    return resolve(impl).on_mesh(mesh)(x, q, scale, zero, bits=bits, group_size=group_size,
                                       out_dtype=out_dtype, split=split)
