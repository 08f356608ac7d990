"""jaxserve compile's parts that need no TPU compiler (tests/tpu_compile/ has the ones that do):
abstract weights in exactly the loader's layouts, an abstract runner lowering exactly the real
runner's programs, and the HLO scan's counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import ROOT
from jaxserve.aot import hlo_scan
from jaxserve.aot.abstract_model import abstract_model
from jaxserve.config import EngineConfig
from jaxserve.config_engine import PER_CHANNEL, QuantizeSpec
from jaxserve.model import quant_linear as ql

MQA = ROOT / "tests" / "data" / "llama_mqa"


def _layout(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), tree)


@pytest.mark.parametrize("mode,group", [("int8", None), ("int8", PER_CHANNEL), ("int8", 32), ("int4", None),
                                        ("int4", 64)])
def test_abstract_quantized_weights_are_the_loaders_layouts(mode, group):
    import checkpoints
    from checkpoints.quantize import quantize_params
    from jaxserve.model.llama import flat_params
    model, loaded = checkpoints.load_model(MQA, "float32")
    spec = QuantizeSpec(mode, group)
    real = quantize_params(loaded.config, flat_params(model), spec)
    abstract = abstract_model(loaded.config, jnp.float32, spec)
    got = {p: abstract_param(abstract, p) for p in real}
    for path, w in real.items():
        a = got[path]
        assert ql.is_quantized(w) == ql.is_quantized(a), path
        if ql.is_quantized(w):
            assert (a.bits, a.group_size, a.shape, a.in_axes) == (w.bits, w.group_size, w.shape, w.in_axes), path
        assert _layout(a) == _layout(jax.tree.map(np.asarray, w)), path


def abstract_param(model, path):
    owner = model
    *parents, leaf = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return getattr(owner, leaf).get_value()


def test_abstract_runner_lowers_the_real_runners_program():
    """The same StableHLO from weights and from shapes alone, at tp=2 over an MQA model (so the
    abstract path also replicates the KV head, as the real one does)."""
    import checkpoints
    from jaxserve.engine.build import engine_mesh
    from jaxserve.engine.runner import ModelRunner
    model, loaded = checkpoints.load_model(MQA, "float32")
    config = EngineConfig(tp=2, max_model_len=64, page_size=4, num_pages=32, max_num_seqs=4,
                          max_num_batched_tokens=8, token_buckets=(8,), attention_impl="xla")
    mesh = engine_mesh(2, jax.devices()[:2])
    sched = config.scheduler_config(loaded.config, 4)
    real = ModelRunner(model, sched, config, mesh)
    abstract = ModelRunner(abstract_model(loaded.config, jnp.float32), sched, config, mesh)
    assert abstract.abstract and not real.abstract
    assert _layout(nnx.to_pure_dict(abstract._state)) == _layout(nnx.to_pure_dict(real._state))
    assert jax.tree.map(lambda x: x.sharding.spec, abstract.cache) == jax.tree.map(lambda x: x.sharding.spec, real.cache)
    specs = lambda r: jax.tree.map(lambda x: x.sharding.spec, nnx.to_pure_dict(r._state))  # noqa: E731
    assert specs(abstract) == specs(real)
    # The traced step, equation for equation (the StableHLO text differs only in how jax
    # numbered and shared its private functions, which depends on what it lowered before).
    def program(runner):
        cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.cache)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner._state)
        return str(jax.make_jaxpr(runner.step_fn)(state, cache, runner.arrays.abstract_inputs(8)))
    assert program(abstract) == program(real)
    abstract.lower(8).compile()  # and it compiles (here for the CPU mesh)
    # So an executable `jaxserve compile --aot-dir` saved from abstract weights has the key the
    # serving runner looks it up by (executable_store.py).
    from jaxserve.aot import executable_store
    assert executable_store.program_key(abstract, 8) == executable_store.program_key(real, 8)


def test_abstract_runner_needs_a_mesh():
    import checkpoints
    from jaxserve.engine.runner import ModelRunner
    _, loaded = checkpoints.load_model(MQA, "float32")
    config = EngineConfig(max_model_len=64, page_size=4, num_pages=32, max_num_seqs=4, max_num_batched_tokens=8,
                          token_buckets=(8,))
    with pytest.raises(ValueError, match="needs a mesh"):
        ModelRunner(abstract_model(loaded.config, jnp.float32), config.scheduler_config(loaded.config, 4), config)


_HLO = """HloModule m, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], bf16[1,8,256])) -> (s32[], bf16[1,8,256]) {
  %p = (s32[], bf16[1,8,256]) parameter(0)
  %h = bf16[1,8,256]{2,1,0} get-tuple-element(%p), index=1
  %ar = bf16[1,8,256]{2,1,0:T(8,128)(2,1)} all-reduce(%h), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %cp = bf16[2,64,16,512]{3,2,1,0} copy(%kv), metadata={op_name="x"}
  ROOT %t = (s32[], bf16[1,8,256]) tuple(%i, %ar)
}

%cond (p: (s32[], bf16[1,8,256])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%lp_branch (q: bf16[1,8,256]) -> bf16[1,8,256] {
  %q = bf16[1,8,256]{2,1,0} parameter(0)
  %cp2 = bf16[2,64,16,512]{3,2,1,0} copy(%kv2)
  ROOT %ar2 = bf16[1,8,256]{2,1,0} all-reduce(%q), channel_id=2, to_apply=%add
}

%skip (q: bf16[1,8,256]) -> bf16[1,8,256] {
  ROOT %q = bf16[1,8,256]{2,1,0} parameter(0)
}

%cond2 (p: (s32[], bf16[1,8,256])) -> pred[] {
  %i2 = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n2 = s32[]{:T(128)} constant(4)
  ROOT %lt = pred[]{:T(512)} compare(%i2, %n2), direction=LT
}

%retile (input: s8[4,64,128]) -> s8[4,64,128] {
  %input = s8[4,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %copy.7 = s8[4,64,128]{2,1,0:T(8,128)(4,1)} copy(%input)
}

%layer_slice (w: s8[4,64,128], i: s32[]) -> (s8[64,128]) {
  %w = s8[4,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  %i = s32[] parameter(1)
  %nested = s8[4,64,128]{2,1,0:T(8,128)(4,1)} fusion(%w), kind=kLoop, calls=%retile
  %inner = s8[4,64,128]{2,1,0} copy(%w)
  %ds = s8[1,64,128]{2,1,0} dynamic-slice(%nested, %i, %i, %i), dynamic_slice_sizes={1,64,128}
  %b = s8[64,128]{1,0} bitcast(%ds)
  ROOT %t = (s8[64,128]) tuple(%b)
}

%whole_copy (w: s8[4,64,128]) -> s8[4,64,128] {
  %w = s8[4,64,128]{2,1,0:T(32,128)(4,1)} parameter(0)
  ROOT %out = s8[4,64,128]{2,1,0:T(8,128)(4,1)} copy(%w)
}

ENTRY %main (a: bf16[1,8,256]) -> f32[8] {
  %f1 = (s8[64,128]) fusion(%wq, %j), kind=kLoop, calls=%layer_slice
  %f2 = s8[4,64,128]{2,1,0:T(8,128)(4,1)} fusion(%wq), kind=kLoop, calls=%whole_copy
  %pf = (s8[4,64,128]{2,1,0:T(8,128)(4,1)S(1)}, s8[4,64,128]{2,1,0:T(8,128)(4,1)}, u32[]{:S(2)}) copy-start(%wq)
  %rl = (s8[4,64,128]{1,2,0:T(8,128)(4,1)S(1)}, s8[4,64,128]{2,1,0:T(8,128)(4,1)}, u32[]{:S(2)}) copy-start(%wq)
  %w = (s32[], bf16[1,8,256]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"30"}}
  %w2 = (s32[], bf16[1,8,256]) while(%t1), condition=%cond2, body=%body, backend_config={"flag_configs":[]}
  %br = bf16[1,8,256]{2,1,0} conditional(%pred, %a, %a), true_computation=%lp_branch, false_computation=%skip
  %ag = f32[8]{0} all-gather-start(%x), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ag)
  ROOT %r = f32[8]{0} copy(%agd)
}
"""


def test_hlo_scan_counts_collectives_per_execution_and_finds_watched_copies():
    found, copies = hlo_scan.scan(_HLO, {("bf16", (2, 64, 16, 512))})
    # once per iteration: the 30-trip loop (XLA:GPU's known_trip_count) and the 4-trip one
    # (XLA:TPU keeps no annotation: the bound its condition compares with)
    assert found["all-reduce"].count == 34
    assert found["all-reduce"].bytes == 34 * 8 * 256 * 2
    assert found["all-reduce"].conditional == 1  # the one in a cond branch: not every step's
    assert found["all-gather"].count == 1 and found["all-gather"].bytes == 32  # -start counted, -done not
    assert "collective-permute" not in found
    assert sorted((c.opcode, c.shape, c.count, c.conditional) for c in copies) == [
        ("copy", "bf16[2,64,16,512]", 1, True), ("copy", "bf16[2,64,16,512]", 34, False)]
    assert hlo_scan.scan(_HLO, set())[1] == []  # copies of unwatched shapes are not reported
    # A weight stack [4, 64, 128]: copied inside a fusion that outputs one layer's slice (its
    # nested retile and its inner copy are never written) is not a copy of it; a fusion whose
    # root is the copy writes the whole stack, and is. An async copy into VMEM (S(1)) in the
    # same layout is a prefetch; one that changes the layout on the way is a relayout.
    _, copies = hlo_scan.scan(_HLO, {("s8", (4, 64, 128))})
    assert sorted((c.opcode, c.shape, c.count, c.conditional) for c in copies) == [
        ("copy", "s8[4,64,128]", 1, False), ("copy-start", "s8[4,64,128]", 1, False)]


@pytest.mark.parametrize("name", ["llama-3.1-70b", "qwen3-30b-a3b", "gemma-3-27b", "mixtral-8x7b"])
def test_published_configs_match_their_parameter_counts(name):
    """The committed configs are the published models': their parameter counts (billions, as
    published) come out of the family tables."""
    from checkpoints.hf import read_hf_config
    from jaxserve.model.family import param_shapes
    published = {"llama-3.1-70b": 70.6, "qwen3-30b-a3b": 30.5, "gemma-3-27b": 27.0, "mixtral-8x7b": 46.7}
    n = sum(math.prod(s) for s in param_shapes(read_hf_config(ROOT / "examples" / "configs" / name)).values())
    assert round(n / 1e9, 1) == published[name]


def test_aot_dir_serves_the_saved_executable_and_compiles_the_rest(tmp_path):
    """`serve --aot-dir` (EngineConfig.aot_dir): a step executable serialized for this machine
    (executable_store.save, what `jaxserve compile --aot-dir` writes) is loaded at warm-up
    instead of compiled, and computes what the compiled one does; a bucket the folder lacks is
    compiled, and a runner whose program differs (another max_num_seqs) loads nothing."""
    import dataclasses

    import checkpoints
    from jaxserve.aot import executable_store
    from jaxserve.engine.runner import ModelRunner
    model, loaded = checkpoints.load_model(MQA, "float32")
    config = EngineConfig(max_model_len=64, page_size=4, num_pages=32, max_num_seqs=4, max_num_batched_tokens=8,
                          token_buckets=(4, 8), attention_impl="xla", compilation_cache_dir=None)
    sched = config.scheduler_config(loaded.config, 4)
    writer = ModelRunner(model, sched, config)
    entry = executable_store.save(tmp_path, writer, 8, writer._compile(8))
    assert entry["name"] == "step_T8" and entry["serialized_bytes"] > 0 and entry["jax"] == jax.__version__

    reader = ModelRunner(model, sched, dataclasses.replace(config, aot_dir=str(tmp_path)))
    reader.warmup(progress=False)
    assert reader.aot_loaded == [8] and sorted(reader._executables) == [4, 8]
    rng = np.random.default_rng(0)
    inputs = jax.tree.map(lambda s: jnp.asarray(rng.integers(0, 4, s.shape)).astype(s.dtype),
                          writer.arrays.abstract_inputs(8))
    fresh = ModelRunner(model, sched, config)  # its own cache: each call donates the one it gets
    want = writer.lower(8).compile()(fresh._state, fresh.cache, inputs)
    got = reader._executables[8](reader._state, reader.cache, inputs)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    other = dataclasses.replace(config, aot_dir=str(tmp_path), max_num_seqs=2)
    stranger = ModelRunner(model, other.scheduler_config(loaded.config, 4), other)
    stranger.warmup(progress=False)
    assert stranger.aot_loaded == []
