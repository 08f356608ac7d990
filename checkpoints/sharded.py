"""Sharded loading of HF safetensors folders: each process reads only the slices its devices hold.

For every parameter, `jax.make_array_from_callback` asks for the slice each local device owns;
the callback reads just those rows or columns of the HF tensors through safetensors'
`get_slice` (memory-mapped), so no process ever builds a full host copy of the model. Tensor
parallelism splits one axis per parameter (sharding/rules.py), always the leading dim of its HF
"in" or "out" group, which is a contiguous row or column range of the HF [out, in] tensor.

KV projections that tensor parallelism replicates (fewer KV heads than tp) are small: they are
read whole and repeated (jaxserve.model.llama.replicate_kv_heads explains the head order).

MoE experts: a row stacked [L, E, ...] (Param.expert) is one HF tensor per (layer, expert)
(`...experts.{e}.w1.weight`); a device's slice names its layers and experts (the expert axis is
not split, so all of them) and, inside each expert's matrix, the F range tp gives it: a row
range of w1 / w3 ([F, D]) or a column range of w2 ([D, F]), read through get_slice like a
dense MLP's. So each process reads only its F/tp of every expert, never a whole expert.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import ExitStack
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from checkpoints.errors import CheckpointError
from checkpoints.hf import read_hf_config, safetensors_files
from checkpoints.name_table import expected_hf_names, table, to_ours
from jaxserve.model.decoder import Decoder, param_axes, param_shapes
from sharding import rules


def _full(s: slice, n: int) -> bool:
    return (s.start or 0) == 0 and (s.stop is None or s.stop == n)


def load_hf_sharded(folder: str | Path, dtype, mesh) -> Decoder:
    folder = Path(folder)
    cfg = read_hf_config(folder)
    tp = mesh.shape["tp"]
    copies = rules.kv_replication(cfg.num_heads, cfg.num_kv_heads, tp)
    tcfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * copies)
    shapes = param_shapes(tcfg)
    shardings = rules.param_shardings(param_axes(tcfg), shapes, mesh)
    expected = expected_hf_names(cfg)
    dtype = jnp.dtype(dtype)
    where: dict[str, Path] = {}  # tensor name -> its file
    with _Files(where) as files:
        for f in safetensors_files(folder):
            for name in files.open(f).keys():
                where[name] = f
        missing = sorted(set(expected) - set(where))
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]!r} (expected shape {expected[missing[0]]})")
        for name, shape in expected.items():
            got = tuple(files[name].get_slice(name).get_shape())
            if got != shape:
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {shape}")

    arrays = {}
    for e in table(cfg):
        ours = shapes[e.path]
        replicated_kv = copies > 1 and e.path in ("layers.wk", "layers.wv", "layers.bk", "layers.bv")

        def read(index, e=e, ours=ours, replicated_kv=replicated_kv):
            n_lead = 2 if e.expert else (1 if e.per_layer else 0)  # [L, E, ...] / [L, ...] / none
            layer_idx = range(ours[0])[index[0]] if n_lead else [None]
            expert_idx = range(ours[1])[index[1]] if e.expert else [None]
            inner, inner_shape = index[n_lead:], ours[n_lead:]
            # Files are opened (memory-mapped) for one device's slice of one parameter and
            # closed after it. Kept open for the whole load, every file page any read touched
            # stayed in this process's resident set: the whole file, in a one-process load.
            with _Files(where) as files:
                parts = [_read_one(files, e, i, inner, inner_shape, copies if replicated_kv else 1, expert=x)
                         for i in layer_idx for x in expert_idx]
            if not n_lead:
                return parts[0].astype(dtype, copy=False)
            lead = (len(layer_idx), len(expert_idx))[:n_lead]
            out = np.empty(lead + parts[0].shape, dtype)  # no second stacked copy
            flat = out.reshape((-1,) + parts[0].shape)
            for j, p in enumerate(parts):
                flat[j] = p
            return out

        arrays[e.path] = jax.make_array_from_callback(ours, shardings[e.path], read)
    from flax import nnx
    model = nnx.eval_shape(lambda: Decoder(tcfg, dtype=dtype, rngs=nnx.Rngs(0)))
    for path, value in arrays.items():
        owner = model
        *parents, leaf = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        getattr(owner, leaf).set_value(value)
    return model


class _Files:
    """Safetensors files opened on first use and all closed on exit; files[name] = the handle
    of the file holding tensor `name`."""

    def __init__(self, where: dict[str, Path]):
        self._where = where
        self._open: dict[Path, object] = {}
        self._stack = ExitStack()

    def __getitem__(self, name: str):
        return self.open(self._where[name])

    def open(self, f: Path):
        if f not in self._open:
            self._open[f] = self._stack.enter_context(safe_open(str(f), framework="numpy"))
        return self._open[f]

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def _read_one(files, e, layer, index, ours, copies, expert=None):
    """The part `index` (slices over ours) of one (layer's, expert's) tensor, in our layout."""
    name = e.hf.format(i=layer, e=expert) if layer is not None else e.hf
    sl = files[name].get_slice(name)
    if copies > 1:  # small replicated KV projection: read whole, repeat heads, then cut
        full_ours = list(ours)
        head_axis = 1 if e.layout == "linear" else 0
        full_ours[head_axis] //= copies
        w = to_ours(e, sl[:], tuple(full_ours))
        w = np.repeat(w, copies, axis=head_axis)
        return w[tuple(index)]
    sharded = [d for d, s in enumerate(index) if not _full(s, ours[d])]
    if len(sharded) > 1:
        raise CheckpointError(f"{name}: sharded on more than one axis {sharded}, unsupported")
    if e.layout == "same":
        return np.asarray(sl[tuple(index)])
    if e.layout == "norm1":
        w = np.asarray(sl[tuple(index)])
        return (w.astype(np.float32) + 1).astype(w.dtype)
    if e.layout == "bias":
        if not sharded:
            return np.asarray(sl[:]).reshape(ours)
        d = sharded[0]
        s = index[d]
        inner = math.prod(ours[d + 1:])
        flat = np.asarray(sl[s.start * inner:s.stop * inner])
        return flat.reshape((s.stop - s.start,) + tuple(ours[d + 1:]))
    # linear: ours = (in dims..., out dims...); HF = [prod(out), prod(in)]
    # A fused tensor's part (Phi-3's qkv_proj) is HF rows r0 .. r0 + n of it.
    in_dims = e.in_dims
    r0, n = e.rows if e.rows is not None else (0, math.prod(ours[in_dims:]))
    if not sharded:
        w = np.asarray(sl[r0:r0 + n, :])
        return np.ascontiguousarray(w.T).reshape(ours)
    d = sharded[0]
    s = index[d]
    group = range(0, in_dims) if d < in_dims else range(in_dims, len(ours))
    if d != group[0]:
        raise CheckpointError(f"{name}: sharded on axis {d}, not the leading axis of its group")
    inner = math.prod(ours[d + 1:group[-1] + 1])
    lo, hi = s.start * inner, s.stop * inner
    part = list(ours)
    part[d] = s.stop - s.start
    if d < in_dims:  # HF columns
        w = np.asarray(sl[r0:r0 + n, lo:hi])
    else:  # HF rows
        w = np.asarray(sl[r0 + lo:r0 + hi, :])
    return np.ascontiguousarray(w.T).reshape(part)
