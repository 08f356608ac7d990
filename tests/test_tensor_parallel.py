"""Tensor parallelism on fake CPU devices (conftest sets 8): the same greedy tokens and
logprobs as tp = 1, no compilation after warm-up, parameters and cache really split, and two
processes joined by jax.distributed forming one 4-device mesh."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import dense_forward, drain, first_layers, make_engine
from multiprocess import coordinator_address, run_job
from tolerances import fp32_logprobs_atol
from tp_cases import TINY_TP, run_tiny_tp, tiny_tp_model, tiny_tp_prompts

from jaxserve.types import SamplingParams
from sharding import rules

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tp1():
    return run_tiny_tp(tp=1, logprobs=True)


@pytest.fixture(scope="module")
def tp_logprobs_atol(tp1):
    """Sharded matmuls add their partial sums in another order: fp32 reordering only, bounded
    from the model's reduction chain and its logits' size (one dense pass over the sequences)."""
    seqs = [p + t for p, t in zip(tiny_tp_prompts(), tp1[0])]
    logits = dense_forward(tiny_tp_model())(seqs)
    live = np.concatenate([logits[i, :len(s)] for i, s in enumerate(seqs)])
    return fp32_logprobs_atol(TINY_TP, max(map(len, seqs)), live)


# tp=2 splits the 2 KV heads; 8 replicates each to 4 copies (4, with 2 copies, runs the same
# replication code: test_tp_with_int8_kv_cache_matches_tp1 below uses it).
@pytest.mark.parametrize("tp", [2, 8])
def test_tp_matches_tp1(tp1, tp_logprobs_atol, tp):
    tokens, logprobs, eng = run_tiny_tp(tp=tp, logprobs=True)
    assert tokens == tp1[0]
    np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(tp1[1]), atol=tp_logprobs_atol)
    # The weights really are split: a device holds 1/tp of the MLP and of the query heads.
    wq = eng.runner._state["layers"]["wq"][...]
    assert wq.addressable_shards[0].data.shape[2] == TINY_TP.num_heads // tp
    # 2 KV heads: tp=2 splits them, tp=4/8 replicate each to tp/2 copies, one head per device.
    k_cache = eng.runner.cache.k
    # The cache is stored [L, P, page, K * H]: a device's share is its heads' runs of H lanes.
    assert k_cache.addressable_shards[0].data.shape[3] == (1 if tp >= 2 else 2) * TINY_TP.head_dim
    assert eng.runner.model_cfg.num_kv_heads == max(2, tp)


def test_tp2_on_the_native_cpu_kernel_matches_tp1(tp1, tp_logprobs_atol):
    """The C++ attention kernel runs per shard under shard_map (one KV head per device) and
    gives the XLA path's tokens."""
    tokens, logprobs, _ = run_tiny_tp(tp=2, logprobs=True, attention_impl="cpu_native")
    assert tokens == tp1[0]
    np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(tp1[1]), atol=tp_logprobs_atol)


def test_tp_with_int8_kv_cache_matches_tp1():
    assert run_tiny_tp(tp=4, kv_cache_dtype="int8") == run_tiny_tp(tp=1, kv_cache_dtype="int8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tp2_with_quantized_weights_matches_tp1(mode):
    """Column-parallel (q/k/v, gate/up, LM head: output rows split) and row-parallel (o, down:
    input groups split, partial sums added) quantized matmuls give tp=1's greedy tokens."""
    from checkpoints.quantize import QuantizeSpec
    from jaxserve.model import quant_linear as ql
    spec = QuantizeSpec(mode, 32)  # o's 64 inputs make one group of 32 per device at tp=2
    tokens, _, eng = run_tiny_tp(tp=2, logprobs=True, quantize=spec)
    assert tokens == run_tiny_tp(tp=1, quantize=spec)
    layers = eng.runner._state["layers"]
    wq, wo = layers["wq"][...], layers["wo"][...]
    assert ql.is_quantized(wq) and wq.split == "n" and wo.split == "k"
    # The weights carry their split only; the mesh is the resolved matmul's, bound once.
    from flax import nnx
    assert nnx.merge(eng.runner._graphdef, eng.runner._state).quantized_matmul.mesh is eng.runner.mesh
    assert wq.q.addressable_shards[0].data.shape[1] == wq.q.shape[1] // 2  # output rows
    assert wo.scale.addressable_shards[0].data.shape[2] == wo.scale.shape[2] // 2  # input groups


def test_tp2_quantized_matmul_kernel_runs_per_shard():
    """The Pallas TPU kernel (interpret mode) sees each device's plain matrix under shard_map:
    tp=2 gives the tokens of tp=1 on the XLA path. One short request: interpret mode is slow."""
    from checkpoints.quantize import QuantizeSpec
    from conftest import byte_tokenizer
    from tp_cases import tiny_tp_model

    def tokens(tp, impl):
        eng = make_engine(tiny_tp_model(QuantizeSpec("int4", 32), impl), byte_tokenizer(), tp=tp,
                          token_buckets=(8,), max_num_batched_tokens=8, max_num_seqs=4)
        eng.add_request({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        request_id="a")
        drain(eng)
        return eng.pop_finished("a").outputs[0].token_ids
    assert tokens(2, "pallas_tpu_interpret") == tokens(1, "xla")


def test_tp_refuses_quantized_groups_split_across_devices():
    from checkpoints.quantize import QuantizeSpec
    # int8's default group here is 64: o's 64 inputs split over 2 devices are half a group each.
    with pytest.raises(ValueError, match=r"tp=2 cannot split the quantized weight layers.wo along its 64 "
                                         r"inputs: 32 per device is not a whole number of groups of 64"):
        run_tiny_tp(tp=2, quantize=QuantizeSpec("int8"))


def test_smollm2_tp3_matches_tp1(smollm2):
    """SmolLM2's own head counts (9 query heads, 3 KV heads: one KV head per device), its
    first 4 layers (every layer is split the same way)."""
    lm = smollm2
    model = first_layers(lm.model, 4)
    prompts = ["The capital of France is", "Once upon a time, there was a little"]
    outs = {}
    for tp in (1, 3):
        eng = make_engine(model, lm.tokenizer, lm.eos_token_ids, page_size=16, num_pages=32, tp=tp,
                          max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,))
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=10), request_id=str(i))
        drain(eng)
        outs[tp] = [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(prompts))]
    assert outs[3] == outs[1]


def test_tp_errors_name_the_shapes():
    with pytest.raises(ValueError, match="tp=3 does not divide num_heads=8"):
        rules.kv_replication(8, 2, 3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        rules.kv_replication(12, 3, 2)
    assert rules.kv_replication(9, 3, 3) == 1 and rules.kv_replication(8, 1, 8) == 8


def test_two_processes_one_mesh_match_single_process():
    want = run_tiny_tp(tp=1)
    coordinator = coordinator_address()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    outs = run_job([[sys.executable, str(ROOT / "tests" / "tp_worker.py"), coordinator, "2", str(i)] for i in range(2)],
                   [env, env])
    for out in outs:
        line = [ln for ln in out.splitlines() if ln.startswith("TOKENS ")]
        assert line, out
        assert json.loads(line[0][len("TOKENS "):]) == want


@pytest.mark.parametrize("name,tp", [("llama_mqa", 4), ("qwen2_bias", 2), ("llama3_rope", 2)])
def test_sharded_loading_reads_slices_equal_to_full_load(name, tp):
    """Each device's slice, read straight from safetensors, equals the same slice of the fully
    loaded (and, for MQA, KV-replicated) model."""
    import checkpoints
    from checkpoints.sharded import load_hf_sharded
    from jaxserve.model.llama import flat_params, param_axes, replicate_kv_heads
    from sharding.mesh import make_mesh
    mesh = make_mesh(tp=tp)
    folder = ROOT / "tests" / "data" / name
    sharded = load_hf_sharded(folder, "float32", mesh)
    full, _ = checkpoints.load_model(folder, "float32")
    full = replicate_kv_heads(full, rules.kv_replication(full.cfg.num_heads, full.cfg.num_kv_heads, tp))
    want = flat_params(full)
    for path, arr in flat_params(sharded).items():
        assert arr.sharding.spec == rules.spec_for(param_axes(sharded.cfg)[path], arr.shape, mesh, path)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want[path])[shard.index], err_msg=path)
