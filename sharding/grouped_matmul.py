"""The grouped-matmul seam (Mixture-of-Experts expert projections, layers.moe_mlp): the
GROUPED_MATMUL backend table (sharding/backends.py), resolved once when the model is built into
the `GroupedMatmul` the Decoder holds. The rows:

  "ragged_dot"            jax.lax.ragged_dot: XLA's grouped matmul; CPU and GPU
  "pallas_tpu"            pallas_kernels/grouped_matmul's Mosaic kernel, TPU only
  "pallas_tpu_interpret"  the same kernel in the TPU interpret mode on CPU, so tests can run a
                          MoE model through it (slow; tiny models only)
  "auto"                  TPU -> pallas_tpu, otherwise ragged_dot

Not a config flag yet: the model resolves "auto"; tests set `Decoder.grouped_matmul` to
another row (`resolve`). Each row's callable: (lhs [M, K], rhs [G, K, N], group_sizes [G], *,
out_dtype) -> [M, N], fp32 accumulation.

Quantized experts (`GroupedMatmul.quantized`): each row also names how it runs int8 / int4
experts stored [G, N, K'] (pallas_kernels/grouped_matmul/reference.py's quantized layout)
without a float copy of them: "ragged_dot" -> grouped_matmul/xla.py (dequantizes cache-sized
chunks of rows; docs/quantization.md has the measurements), the Pallas rows -> the TPU
kernel's quantized twin (tpu_quantized.py, dequantizing per K tile in VMEM).

Tensor parallelism: the experts' F axis is split over "tp" (sharding/rules.RULES "mlp"), so
gate / up are column-parallel (split "n": lhs replicated, each device its [M, F/tp]) and down
is row-parallel (split "k": lhs split along F, partial [M, D] in fp32 added by a psum). Given a
mesh (`on_mesh`, by the engine's runner) each call runs per shard under shard_map, so the
Pallas kernel sees one device's experts; without one it is one plain call (GSPMD partitions
ragged_dot itself, but would gather a Pallas call's operands).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels import interpret as interpret_mode
from pallas_kernels.grouped_matmul import tpu as gmm_tpu
from pallas_kernels.grouped_matmul import tpu_quantized as gmm_tpu_q
from pallas_kernels.grouped_matmul import xla as gmm_xla
from sharding import backends

GMM_IMPLS = ("ragged_dot", "pallas_tpu", "pallas_tpu_interpret")


def _ragged_dot(lhs, rhs, group_sizes, *, out_dtype=None):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def _pallas(interpret: bool):
    def run(lhs, rhs, group_sizes, *, out_dtype=None):
        # The interpret fill is read when the step is traced (JAXSERVE_INTERPRET_FILL).
        return gmm_tpu.grouped_matmul_tpu(lhs, rhs, group_sizes, out_dtype=out_dtype,
                                          interpret=interpret_mode.impl_fill() if interpret else False)
    return run


def _pallas_quantized(interpret: bool):
    def run(lhs, q, scale, zero, group_sizes, **kw):
        return gmm_tpu_q.quantized_grouped_matmul_tpu(
            lhs, q, scale, zero, group_sizes, interpret=interpret_mode.impl_fill() if interpret else False, **kw)
    return run


# Each row's quantized callable: (lhs [M, K], q [G, N, K'], scale, zero [G, N, K/gs] or None,
# group_sizes [G], *, bits, group_size, out_dtype) -> [M, N]; keyed like the rows (a test
# holds the keys equal to GMM_IMPLS).
QUANTIZED = {
    "ragged_dot": gmm_xla.xla_quantized_grouped_matmul,
    "pallas_tpu": _pallas_quantized(False),
    "pallas_tpu_interpret": _pallas_quantized(True),
}


def _auto(platform: str):
    return (("pallas_tpu", None), ("ragged_dot", None)) if platform == "tpu" else (("ragged_dot", None),)


GROUPED_MATMUL = backends.Table(field="grouped_matmul", logger="jaxserve.grouped_matmul", auto=_auto, rows=(
    backends.Backend("ragged_dot", ("cpu", "gpu", "tpu"), _ragged_dot),
    backends.Backend("pallas_tpu", ("tpu",), _pallas(False),
                     instead="'pallas_tpu_interpret' to run the kernel on CPU, or 'ragged_dot'"),
    backends.Backend("pallas_tpu_interpret", ("cpu", "gpu", "tpu"), _pallas(True)),
))


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
    """The model's grouped matmul: one resolved GROUPED_MATMUL row and the mesh the experts are
    split over (None: one device). Hashable, so the model holds it statically."""

    backend: backends.Backend
    mesh: Any = None

    @property
    def name(self) -> str:
        return self.backend.name

    def on_mesh(self, mesh) -> "GroupedMatmul":
        return dataclasses.replace(self, mesh=mesh)

    def __call__(self, lhs, rhs, group_sizes, *, out_dtype=None, split: str | None = None):
        """lhs [M, K] rows sorted by group, rhs [G, K, N] -> [M, N] (pallas_kernels/grouped_matmul/
        reference.py). split: how rhs is split over the mesh's "tp" axis, "n" (its N) or "k"
        (its K); ignored without a mesh."""
        fn = self.backend.fn
        if self.mesh is None or split is None:
            return fn(lhs, rhs, group_sizes, out_dtype=out_dtype)
        if split == "n":
            body = functools.partial(fn, out_dtype=out_dtype)
            specs, out_spec = (P(), P(None, None, "tp"), P()), P(None, "tp")
        elif split == "k":
            def body(lhs, rhs, group_sizes):
                part = fn(lhs, rhs, group_sizes, out_dtype=jnp.float32)
                return jax.lax.psum(part, "tp").astype(out_dtype or lhs.dtype)
            specs, out_spec = (P(None, "tp"), P(None, "tp", None), P()), P()
        else:
            raise ValueError(f"grouped matmul split {split!r}: expected 'n' or 'k'")
        # check_vma=False: the Pallas call inside carries no varying-axis annotations.
        f = jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=out_spec, check_vma=False)
        return f(lhs, rhs, group_sizes)

    def quantized(self, lhs, q, scale, zero, group_sizes, *, bits: int, group_size: int, out_dtype=None,
                  split: str | None = None):
        """lhs [M, K] rows sorted by group times each group's quantized weight (q [G, N, K'],
        scale / zero [G, N, K/gs]; reference.ref_quantized_grouped_matmul) -> [M, N], read as
        stored. split: None (one device, or replicated), or "n" / "k" when q, scale and zero
        are split over the mesh's "tp" axis by output rows / by whole input groups (the
        weight's own record, rules.quantized_spec), run per shard as __call__ does."""
        fn = functools.partial(QUANTIZED[self.name], bits=bits, group_size=group_size)
        if split is None:
            return fn(lhs, q, scale, zero, group_sizes, out_dtype=out_dtype)
        if self.mesh is None:
            raise ValueError(f"quantized grouped matmul: the experts are split over 'tp' ({split!r}) but this "
                             f"grouped matmul was given no mesh (GroupedMatmul.on_mesh)")
        if split == "n":
            def body(lhs, group_sizes, q, scale, *zero):
                return fn(lhs, q, scale, zero[0] if zero else None, group_sizes, out_dtype=out_dtype)
            w_spec, x_spec, out_spec = P(None, "tp", None), P(), P(None, "tp")
        elif split == "k":
            def body(lhs, group_sizes, q, scale, *zero):
                part = fn(lhs, q, scale, zero[0] if zero else None, group_sizes, out_dtype=jnp.float32)
                return jax.lax.psum(part, "tp").astype(out_dtype or lhs.dtype)
            w_spec, x_spec, out_spec = P(None, None, "tp"), P(None, "tp"), P()
        else:
            raise ValueError(f"quantized grouped matmul split {split!r}: expected 'n' or 'k'")
        ws = (q, scale) + (() if zero is None else (zero,))
        f = jax.shard_map(body, mesh=self.mesh, in_specs=(x_spec, P()) + (w_spec,) * len(ws),
                          out_specs=out_spec, check_vma=False)
        return f(lhs, group_sizes, *ws)


def resolve(impl: str = "auto") -> GroupedMatmul:
    """The GROUPED_MATMUL row for `impl` ("auto" by backend), checked for this backend."""
    return GroupedMatmul(GROUPED_MATMUL.resolve(impl))
