"""The family registry (jaxserve/model/family.py): every family's table derives consistent
shapes, axes and HF / GGUF names; configs and weights round-trip; each family added through it
matches HF transformers (tests/goldens, scripts/make_goldens.py) on the dense path and through
the paged engine."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import byte_tokenizer, dense_forward, drain, make_engine
from test_goldens import check_case

import checkpoints
from checkpoints.name_table import hf_to_params, params_to_hf
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model import family
from jaxserve.scheduler.window import freeable_window
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "goldens"
# Families beyond the first three, each with its HF goldens (scripts/make_goldens.py).
NEW_FAMILIES = ["qwen3_qknorm", "phi3_fused", "gemma3_local_global", "gemma2_softcap", "mixtral_moe", "qwen3_moe"]


def tiny_cfg(arch: str) -> ModelConfig:
    d = dict(architectures=[family.get(arch).hf_class], model_type=arch, vocab_size=64, hidden_size=16,
             intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, max_position_embeddings=64, eos_token_id=2)
    return ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("arch", sorted(family.families()))
def test_table_derivations_agree_and_round_trip(arch):
    """Shapes, axes and quantizable paths come from one table and agree; config.json and the
    HF tensors written from random params read back exactly (fused tensors joined and split)."""
    cfg = tiny_cfg(arch)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    shapes, axes = family.param_shapes(cfg), family.param_axes(cfg)
    assert set(shapes) == set(axes)
    for path, shape in shapes.items():
        assert len(axes[path]) == len(shape), path
        assert path.startswith("layers.") == (axes[path][0] == "layers"), path
    for path, in_axes in family.quantizable(cfg).items():
        assert path in shapes and max(in_axes) < len(shapes[path]) - path.startswith("layers."), path
    assert cfg.num_parameters() == sum(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    for p in family.table(cfg):
        if p.layout == "norm1":  # stored 1 + w, ~1: (v - 1) + 1 == v exactly for v >= 0.5
            params[p.path] = rng.uniform(0.5, 1.5, size=shapes[p.path]).astype(np.float32)
    hf = params_to_hf(cfg, params)
    assert {k: v.shape for k, v in hf.items()} == family.hf_tensor_shapes(cfg)
    back = hf_to_params(cfg, set(hf), hf.__getitem__)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k], err_msg=k)
    gguf = set(family.gguf_to_hf_names(cfg).values())
    gguf |= {n for names in family.gguf_expert_names(cfg).values() for n in names}
    if family.get(arch).gguf_arch is not None or arch in ("mistral", "mixtral"):  # the last two: as `llama`
        assert gguf == set(hf), "every HF tensor has a GGUF name"


def test_phi3_long_rope_is_refused_in_one_line():
    d = tiny_cfg("phi3").to_hf_dict()
    d["rope_scaling"] = {"type": "longrope", "long_factor": [1.0] * 2, "short_factor": [1.0] * 2}
    with pytest.raises(ConfigError, match=r"^rope_scaling.type: Phi-3's 'longrope' RoPE scaling .* not implemented"):
        ModelConfig.from_hf_dict(d)
    d = dict(tiny_cfg("phi3").to_hf_dict(), partial_rotary_factor=0.75)
    with pytest.raises(ConfigError, match="^partial_rotary_factor: 0.75"):
        ModelConfig.from_hf_dict(d)


def test_unknown_model_type_names_the_supported_ones():
    d = dict(tiny_cfg("llama").to_hf_dict(), architectures=["FooForCausalLM"], model_type="foo")
    with pytest.raises(ConfigError, match="^architecture: unsupported model .*Qwen3ForCausalLM"):
        ModelConfig.from_hf_dict(d)


@pytest.fixture(scope="module", params=NEW_FAMILIES)
def golden_model(request):
    golden = json.loads((GOLDENS / f"{request.param}.json").read_text())
    model, loaded = checkpoints.load_model(ROOT / golden["checkpoint"], "float32")
    return request.param, golden, model


def test_dense_matches_hf(golden_model):
    """fp32 greedy ids equal HF's, top-5 logits within tolerances.fp32_logits_atol (see test_goldens.check_case)."""
    name, golden, model = golden_model
    logits_of = dense_forward(model)
    for case in golden["cases"]:
        assert check_case(logits_of, case, model.cfg) == case["greedy_ids"], f"{name} prompt {case['prompt_ids']}"


def test_paged_engine_matches_hf(golden_model):
    """The golden prompts through the paged engine at once, prefill chunked by an 8-token budget
    (the 12- and 20-token prompts cross the 8-token windows mid-prefill), 4-token pages, a
    pool small enough to preempt, and n = 2 greedy samples: every sample is HF's greedy ids.
    Gemma 3 and Mixtral run with tp = 2 on fake devices (heads and MLP / expert FFN columns
    split; each Gemma layer's sliding_window passes through the tensor-parallel seam)."""
    name, golden, model = golden_model
    tp = 2 if name in ("gemma3_local_global", "mixtral_moe") else 1
    # Phi-3's window covers every layer, so pages behind it are freed (scheduler/window.py) and
    # 13 pages no longer run short: 7 (at least the 5 one windowed sample can hold) still do.
    pages = 7 if freeable_window(model.cfg) else 13
    eng = make_engine(model, byte_tokenizer(), tp=tp, max_model_len=64, page_size=4, num_pages=pages, max_num_seqs=4,
                      max_num_batched_tokens=8, token_buckets=(8,))  # one executable: decodes pad to 8
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    for i, case in enumerate(golden["cases"]):
        eng.add_request({"prompt_token_ids": case["prompt_ids"]}, params, request_id=str(i))
    drain(eng)
    assert eng.compiles_after_warmup == 0
    for i, case in enumerate(golden["cases"]):
        outs = eng.pop_finished(str(i)).outputs
        assert [o.token_ids for o in outs] == [case["greedy_ids"]] * 2, f"{name} prompt {i}"
    assert eng.stats["preemptions"] > 0, "the pool was meant to force preemption"
    if name.startswith("gemma"):  # two KV groups: the sliding layers' pages left their window
        assert eng.scheduler.sliding_page_pool is not None and eng.scheduler.pages_freed_by_window > 0
    assert eng.runner._state["layers"]["wq"][...].addressable_shards[0].data.shape[2] == 4 // tp
    if name == "mixtral_moe":  # [L, E, D, F]: every expert's FFN columns split over tp
        assert eng.runner._state["layers"]["we_gate"][...].addressable_shards[0].data.shape[3] == 128 // tp


def test_config_switches_are_validated():
    cfg = tiny_cfg("llama")
    with pytest.raises(ConfigError, match="^layer_types: has 1 entries, num_layers is 2"):
        dataclasses.replace(cfg, layer_types=("full_attention",))
    with pytest.raises(ConfigError, match="^sliding_window: layer_types has sliding layers"):
        dataclasses.replace(cfg, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ConfigError, match="^hidden_act: unsupported activation 'relu'"):
        dataclasses.replace(cfg, hidden_act="relu")


@pytest.mark.parametrize("name", ["phi3_fused", "gemma3_local_global"])
def test_sharded_loading_splits_fused_rows_and_gemma_norms(name):
    """tp = 2 on fake devices: each device's slice read from safetensors (Phi-3's fused
    qkv / gate_up row ranges, Gemma's 1 + w norms) equals that slice of the full load."""
    import test_tensor_parallel
    test_tensor_parallel.test_sharded_loading_reads_slices_equal_to_full_load(name, 2)
