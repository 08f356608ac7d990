"""Sliced loading of MoE safetensors folders under tensor parallelism (checkpoints/sharded.py):
each device's slice of the [L, E, D, F] / [L, E, F, D] expert stacks, read per (layer, expert)
HF tensor, equals that slice of the full load, and every read of an expert tensor covers only
the device's F / tp of it."""

from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("name", ["mixtral_moe", "qwen3_moe"])
def test_expert_slices_equal_the_full_load_and_read_only_their_part(name, monkeypatch):
    import checkpoints
    from checkpoints import sharded
    from jaxserve.model.llama import flat_params, param_axes, replicate_kv_heads
    from sharding import rules
    from sharding.mesh import make_mesh

    reads: dict[str, list[tuple[tuple, int]]] = {}  # HF tensor -> (index, elements) per read
    real_open = sharded.safe_open

    class Recording:
        """A safetensors handle whose get_slice records what each read asks for."""

        def __init__(self, handle):
            self._h = handle

        def __enter__(self):
            self._h = self._h.__enter__()
            return self

        def __exit__(self, *exc):
            return self._h.__exit__(*exc)

        def keys(self):
            return self._h.keys()

        def get_slice(self, tname):
            sl = self._h.get_slice(tname)

            class Slice:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, index):
                    out = sl[index]
                    reads.setdefault(tname, []).append((repr(index), out.size))
                    return out
            return Slice()

    monkeypatch.setattr(sharded, "safe_open", lambda *a, **k: Recording(real_open(*a, **k)))
    tp = 2
    mesh = make_mesh(tp=tp)
    model = sharded.load_hf_sharded(DATA / name, "float32", mesh)
    full, _ = checkpoints.load_model(DATA / name, "float32")
    full = replicate_kv_heads(full, rules.kv_replication(full.cfg.num_heads, full.cfg.num_kv_heads, tp))
    want = flat_params(full)
    got = flat_params(model)
    cfg = model.cfg
    for path in ("layers.we_gate", "layers.we_up", "layers.we_down"):
        arr = got[path]
        assert arr.shape[:2] == (cfg.num_layers, cfg.num_experts), path
        assert arr.sharding.spec == rules.spec_for(param_axes(cfg)[path], arr.shape, mesh, path)
        for shard in arr.addressable_shards:  # F split over tp: half of every expert's matrix
            assert shard.data.shape[-1 if path != "layers.we_down" else -2] == arr.shape[-1 if path != "layers.we_down" else -2] // tp
    for path, arr in got.items():
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want[path])[shard.index], err_msg=path)
    experts = [n for n in reads if ".experts." in n]
    assert len(experts) == 3 * cfg.num_layers * cfg.num_experts  # every (layer, expert) tensor read
    for n in experts:
        size = int(np.prod(want["layers.we_gate"].shape[2:]))  # D * F: every expert matrix's size
        # one read per device, each exactly its F / tp part, two different parts
        assert [e for _, e in reads[n]] == [size // tp] * tp, (n, reads[n])
        assert len({i for i, _ in reads[n]}) == tp, (n, reads[n])


def test_load_reads_a_moe_folder_in_shards_under_tp():
    """jaxserve.loading.load (what LLM, serve and the scripts call) takes the sliced reader for
    a MoE folder at tp > 1, as for a dense one (it used to read MoE folders whole)."""
    from jaxserve import loading
    from sharding.mesh import make_mesh
    loaded = loading.load(DATA / "mixtral_moe", "float32", mesh=make_mesh(tp=2))
    assert loaded.weights == "float32, read in shards"
    w = loaded.model.layers.we_down[...]
    assert w.addressable_shards[0].data.shape == (2, 4, 64, 64)  # [L, E, F / tp, D]
