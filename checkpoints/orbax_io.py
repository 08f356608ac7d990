"""Pre-quantized (or float) checkpoints saved with Orbax, loaded with no conversion at all.

Folder layout (`jaxserve convert --to orbax [--quantize ...]` writes it):
  jaxserve.json   format tag, the model config (HF config.json form), the quantize mode, and
                  for every parameter path either {"kind": "float"} or {"kind": "quantized",
                  bits, group_size, shape, in_axes}: the static half of a QuantizedWeight
  params/         an Orbax StandardCheckpointer tree: {path parts: array} for floats and
                  {path parts: {"q", "scale"[, "zero"]}} for quantized weights, stored as they
                  run (int8 / packed uint8 / fp16 scales), so restoring is reading bytes
  (tokenizer files, written beside them by the caller, which owns tokenizer logic)

`load_orbax` rebuilds the abstract tree from jaxserve.json, restores it in one Orbax call and
reports the seconds it took (`OrbaxLoad.load_s`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np

from checkpoints.errors import CheckpointError
from jaxserve.config import ModelConfig
from jaxserve.model.quant_linear import QuantizedWeight

FORMAT = "jaxserve-orbax-v1"
META_FILE = "jaxserve.json"
PARAMS_DIR = "params"


@dataclasses.dataclass
class OrbaxLoad:
    config: ModelConfig
    params: dict  # path -> jax.Array | QuantizedWeight, on the default device
    quantize: str  # the --quantize mode it was written with
    load_s: float  # seconds from opening the folder to the arrays being ready


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def _get(tree: dict, path: str):
    for p in path.split("."):
        tree = tree[p]
    return tree


def save_orbax(out_dir: str | Path, config: ModelConfig, params: dict, *, quantize: str = "none") -> Path:
    """Write params (float arrays and QuantizedWeight values) and their description."""
    import orbax.checkpoint as ocp
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if (out / PARAMS_DIR).exists():
        raise CheckpointError(f"{out / PARAMS_DIR} already exists; choose an empty folder")
    desc, arrays = {}, {}
    for path, v in params.items():
        if isinstance(v, QuantizedWeight):
            desc[path] = dict(kind="quantized", bits=v.bits, group_size=v.group_size, shape=list(v.shape),
                              in_axes=list(v.in_axes))
            arrays[path] = {"q": v.q, "scale": v.scale, **({"zero": v.zero} if v.zero is not None else {})}
        else:
            desc[path] = dict(kind="float")
            arrays[path] = v
    arrays = jax.tree.map(np.asarray, _nest(arrays))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / PARAMS_DIR, arrays)
        ckptr.wait_until_finished()
    meta = dict(format=FORMAT, config=config.to_hf_dict(), quantize=quantize, params=desc)
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def load_orbax(path: str | Path) -> OrbaxLoad:
    """Restore what save_orbax wrote; QuantizedWeight values come back as they were saved."""
    import orbax.checkpoint as ocp
    t0 = time.perf_counter()
    folder = Path(path).resolve()
    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: not a jaxserve Orbax checkpoint ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder / META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
    config = ModelConfig.from_hf_dict(meta["config"])
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(folder / PARAMS_DIR)
        tree = getattr(stored, "item_metadata", stored)
        tree = getattr(tree, "tree", tree)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), dict(tree),
                              is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
        restored = ckptr.restore(folder / PARAMS_DIR, target)
    params = {}
    for p, d in meta["params"].items():
        v = _get(restored, p)
        if d["kind"] == "quantized":
            v = QuantizedWeight(q=v["q"], scale=v["scale"], zero=v.get("zero"), bits=d["bits"],
                                group_size=d["group_size"], shape=tuple(d["shape"]), in_axes=tuple(d["in_axes"]))
        params[p] = v
    jax.block_until_ready(jax.tree.leaves(params))
    return OrbaxLoad(config, params, meta.get("quantize", "none"), time.perf_counter() - t0)
