"""Logical axis -> mesh axis rules, and the NamedShardings they give parameters and the cache.

Rule table (Megatron-style tensor parallelism over the "tp" mesh axis):
  heads, kv_heads  -> tp   attention is split by heads: each device owns whole heads
  mlp              -> tp   gate/up split by columns, down by rows: one all-reduce per MLP
  vocab            -> tp   embedding rows and LM-head columns
  everything else  -> replicated (layers, embed, head_dim)
An axis whose size does not divide by its mesh axis is an error naming both, except that KV
heads fewer than tp are first replicated to tp copies (expand_kv_heads) so each device holds
the KV head its query heads read.

Quantized weights (jaxserve.model.quant_linear.QuantizedWeight; this package does not import
it, `quantized_spec` takes its static fields) are stored as arrays [layers..., N, .]: output
rows N (the weight's output dims flattened), then its inputs K packed (q) or grouped (scale,
zero). The same rule table applies to the float axes; a split output axis becomes a split of N
(column-parallel), a split input axis a split of the K side in whole groups (row-parallel).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels import kv_cache

RULES = {"heads": "tp", "kv_heads": "tp", "mlp": "tp", "vocab": "tp"}


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh, name: str) -> P:
    parts = []
    for ax, dim in zip(axes, shape):
        mesh_axis = RULES.get(ax) if ax else None
        if mesh_axis is not None and mesh.shape[mesh_axis] > 1:
            if dim % mesh.shape[mesh_axis]:
                raise ValueError(f"{name}: axis {ax!r} of size {dim} does not divide by "
                                 f"{mesh_axis}={mesh.shape[mesh_axis]}")
            parts.append(mesh_axis)
        else:
            parts.append(None)
    return P(*parts)


def param_shardings(axes: dict[str, tuple], shapes: dict[str, tuple], mesh: Mesh) -> dict[str, NamedSharding]:
    return {k: NamedSharding(mesh, spec_for(axes[k], shapes[k], mesh, k)) for k in shapes}


def quantized_spec(name: str, axes: tuple[str | None, ...], full_shape: tuple[int, ...], n_lead: int,
                   in_axes: tuple[int, ...], group_size: int, mesh: Mesh) -> tuple[P, str | None]:
    """(spec, split) for a quantized weight of float shape `full_shape` (n_lead stacked dims, then
    one matrix whose axes `in_axes` are its inputs) with logical `axes`: `spec` fits each of its
    arrays q / scale / zero [lead..., N, .]; `split` is "n" (output rows split), "k" (input
    groups split) or None (replicated). A split this layout cannot express is a ValueError
    naming tp and the weight: the split axis must lead its group (so each device's part is one
    contiguous range of N or of K), and row-parallel parts must be whole groups."""
    float_spec = spec_for(axes, full_shape, mesh, name)
    split_dims = [d for d, part in enumerate(float_spec) if part is not None]
    if not split_dims:
        return P(*[None] * (n_lead + 2)), None
    tp = mesh.shape["tp"]
    matrix = full_shape[n_lead:]
    out_axes = tuple(a for a in range(len(matrix)) if a not in in_axes)
    d = split_dims[0] - n_lead
    if len(split_dims) > 1 or d < 0 or d not in (out_axes[:1] + in_axes[:1]):
        raise ValueError(f"tp={tp} cannot split the quantized weight {name} (float shape {full_shape}, "
                         f"axes {axes}, inputs {in_axes}): only the leading output or input axis of one "
                         f"matrix can be split")
    if d in out_axes:
        return P(*[None] * n_lead, "tp", None), "n"
    K = 1
    for a in in_axes:
        K *= matrix[a]
    if (K // tp) % group_size:
        raise ValueError(f"tp={tp} cannot split the quantized weight {name} along its {K} inputs: "
                         f"{K // tp} per device is not a whole number of groups of {group_size}; "
                         f"quantize with a group size dividing {K // tp} (--quantize-group-size) or "
                         f"choose another tp")
    return P(*[None] * n_lead, None, "tp"), "k"


def cache_spec(ndim: int, scales: bool = False) -> P:
    """Split by KV heads, like the k/v projections that fill them: values [L, P, page, K * H]
    (as stored; heads are contiguous runs of H lanes, so a device's share is its heads) or
    [L, P, page, K, H] on axis 3; int8 scales [L, P, K, page] (pallas_kernels/kv_cache.py) on axis 2."""
    if scales:
        return P(None, None, "tp", None)
    return P(None, None, None, "tp") if ndim == 4 else P(None, None, None, "tp", None)


def cache_specs(cache):
    """cache_spec for every array of a cache pytree (KVCache of plain arrays or QuantizedKV)."""
    def side(c):
        if kv_cache.is_quantized(c):
            return kv_cache.QuantizedKV(cache_spec(c.values.ndim), cache_spec(c.scales.ndim, scales=True))
        return cache_spec(c.ndim)
    return jax.tree.map(side, cache, is_leaf=kv_cache.is_cache_side)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_replication(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """How many copies of each KV head tensor parallelism needs (1 = none); errors name the shapes."""
    if num_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_heads={num_heads}; choose tp among "
                         f"{[d for d in range(1, num_heads + 1) if num_heads % d == 0]}")
    if num_kv_heads % tp == 0:
        return 1
    if tp % num_kv_heads == 0:
        return tp // num_kv_heads
    raise ValueError(f"tp={tp} neither divides nor is a multiple of num_kv_heads={num_kv_heads}")


def shard_attend(attend, mesh: Mesh):
    """Run the model's attend (write KV + paged attention, single-device code) per tp shard.

    in:  layer  P()                       scalar, same everywhere
         q      P(None, None, "tp", None) [1, T, N, H]: this device's query heads
         k, v   P(None, None, "tp", None) [1, T, K, H]: this device's KV heads
         cache  cache_spec                [L, P, page, K * H]: this device's KV heads
         meta   P()                       positions, slots, block tables: the same for all heads
    out: q-shaped output split by heads, and the cache as it came in.
    """
    if mesh.shape["tp"] == 1:
        return attend
    heads = P(None, None, "tp", None)

    def wrapped(layer, q, k, v, cache, meta, **static):
        # `static`: per-layer keyword settings (a layer's sliding_window), the same on every shard.
        cspec = cache_specs(cache)
        mspec = jax.tree.map(lambda _: P(), meta)
        f = jax.shard_map(functools.partial(attend, **static), mesh=mesh, in_specs=(P(), heads, heads, heads, cspec, mspec),
                          out_specs=(heads, cspec), check_vma=False)
        return f(layer, q, k, v, cache, meta)

    return wrapped
