"""Step executables serialized to a folder: what `jaxserve compile --aot-dir DIR` writes for the
machine it compiled for, and what `serve --aot-dir DIR` (EngineConfig.aot_dir) loads at warm-up
instead of compiling, so that a pod pays its compile once, ahead of time, on any machine.

Layout of DIR: per program `<key>.bin` (jax.experimental.serialize_executable's bytes) and
`<key>.trees` (the pickled input / output pytree structures deserialize_and_load needs), and
`manifest.json` ({key: name, tokens, jax version, platform, device kind, devices}).

The key is what must be equal for an executable to be the program `serve` would compile: the
step's jaxpr (equation for equation the same from abstract weights as from real ones,
tests/test_aot.py, and the same text in every process; the lowered StableHLO is not, it numbers
its private functions by what the process lowered before), the input shardings, the mesh's axis
sizes, the devices' kind and count, and the jax / jaxlib versions. Any other program (other
flags, another model, another jaxserve or jax) has another key and is compiled as usual; a key
is never trusted on its name alone (the manifest's versions and devices are checked again).
Both files are pickles (jax's own executable format is one): load only a folder you wrote or
trust, as with any checkpoint that unpickles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path

log = logging.getLogger("jaxserve.aot")

MANIFEST = "manifest.json"


def _versions() -> dict:
    import jax
    import jaxlib
    return dict(jax=jax.__version__, jaxlib=jaxlib.__version__)


def _devices(runner) -> list:
    import jax
    return list(runner.mesh.devices.flat) if runner.mesh is not None else [jax.devices()[0]]


def program_key(runner, T: int) -> tuple[str, dict]:
    """(key, facts) of bucket T's step program on this runner (module doc)."""
    import jax
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner._state)
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.cache)
    args = [state, cache, runner.arrays.abstract_inputs(T)]
    if runner.drafting:
        args.append(runner._draft_q_shape(T))
    # Traced as `serve` traces it, with no abstract mesh in context, also for the compile-only
    # runner: under one, jax adds a reshard of a replicated [S] vector to the program it
    # compiles (runner.lower), an identity, so that executable computes what serve's would.
    jaxpr = str(jax.make_jaxpr(runner.step_fn)(*args))
    devices = _devices(runner)
    shardings = "" if runner.mesh is None else str(
        jax.tree.map(lambda x: x.sharding.spec, (runner._state, runner.cache)))
    facts = dict(tokens=T, platform=devices[0].platform, device_kind=devices[0].device_kind,
                 num_devices=len(devices),
                 mesh={} if runner.mesh is None else dict(runner.mesh.shape), **_versions())
    h = hashlib.sha256()
    for part in (jaxpr, shardings, json.dumps(facts, sort_keys=True)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32], facts


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def save(folder: str | Path, runner, T: int, compiled) -> dict:
    """Serialize bucket T's compiled step into `folder`; returns its manifest entry (with
    `serialized_bytes`)."""
    from jax.experimental import serialize_executable
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key, facts = program_key(runner, T)
    blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    (folder / f"{key}.bin").write_bytes(blob)
    (folder / f"{key}.trees").write_bytes(pickle.dumps((in_tree, out_tree)))
    manifest = _read_manifest(folder)
    manifest[key] = dict(facts, name=f"step_T{T}", serialized_bytes=len(blob))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest[key]


def load(folder: str | Path, runner, T: int):
    """Bucket T's step executable from `folder`, loaded onto the runner's devices, or None when
    the folder holds no executable of exactly this program (then the caller compiles it)."""
    from jax.experimental import serialize_executable
    folder = Path(folder)
    key, facts = program_key(runner, T)
    entry = _read_manifest(folder).get(key)
    if entry is None or any(entry.get(k) != v for k, v in facts.items()):
        return None
    in_tree, out_tree = pickle.loads((folder / f"{key}.trees").read_bytes())
    devices = _devices(runner)
    return serialize_executable.deserialize_and_load((folder / f"{key}.bin").read_bytes(), in_tree, out_tree,
                                                     backend=devices[0].client, execution_devices=devices)
