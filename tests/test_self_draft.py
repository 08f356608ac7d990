"""Self-speculative drafts (speculative_layers=N, engine/self_draft.py): the target's first N layers
draft, the step verifies. Greedy outputs must be the dense model's token for token, with chunked
prefill and preemption, int8 KV, prefix caching and tensor parallelism; a bad setting is one line
naming the field. (The law of sampled outputs: tests/test_speculative_sampling.py.)"""

import pytest
from conftest import assert_dense_greedy, byte_tokenizer, first_layers, make_engine, staggered_with_drafts
from test_engine_prefix_cache import on_and_off, workload
from test_speculative import _prompts

from jaxserve.config import ConfigError, EngineConfig
from jaxserve.types import SamplingParams


def test_self_drafts_equal_dense_greedy_on_smollm2_with_chunking_and_preemption(smollm2):
    lm = smollm2
    target = first_layers(lm.model, 6)  # a 6-layer SmolLM2 drafted by its first 5
    prompts = _prompts(lm)
    # One bucket (every step padded to 32): half the step programs to compile. Chunking comes
    # from the 32-token budget (a 40-token prompt), preemption from the pool: both still occur.
    eng = make_engine(target, lm.tokenizer, lm.eos_token_ids, max_model_len=256, page_size=4,
                      num_pages=31, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(32,),
                      num_speculative_tokens=3, speculative_layers=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs, _ = staggered_with_drafts(eng, prompts, params)
    assert_dense_greedy(target, prompts, [o.token_ids for o in outs], params.max_tokens)


def test_self_drafts_with_prefix_caching_and_int8_kv(tiny_model):
    model, tok = tiny_model
    work = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p, _ in workload(3, vocab=9)]
    on, off, eng = on_and_off(model, tok, work, num_speculative_tokens=3, speculative_layers=1, kv_cache_dtype="int8")
    assert on == off and eng.stats["draft_tokens"] > 0
    _, plain, _ = on_and_off(model, tok, work, kv_cache_dtype="int8")  # no speculation at all
    assert on == plain


def test_self_drafts_under_tensor_parallelism():
    from tp_cases import tiny_tp_model
    work = [(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p, _ in workload(5)]
    model = tiny_tp_model()
    on, off, eng = on_and_off(model, byte_tokenizer(), work, tp=2, num_speculative_tokens=2, speculative_layers=1)
    assert on == off and eng.runner.mesh.shape["tp"] == 2 and eng.stats["draft_tokens"] > 0
    assert_dense_greedy(model, [p for p, _ in work], [o[0] for o in on], 10)


def test_bad_settings_are_one_line_naming_the_field(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ConfigError, match="speculative_layers.*num_speculative_tokens"):
        EngineConfig(speculative_layers=1)
    with pytest.raises(ConfigError, match="speculative_layers"):
        EngineConfig(num_speculative_tokens=2, speculative_layers=-1)
    with pytest.raises(ConfigError, match=r"speculative_layers: must be in \[1, 1\] \(the model has 2 layers"):
        make_engine(model, tok, token_buckets=(8, 32), num_speculative_tokens=2, speculative_layers=2)


def test_a_model_with_two_kv_groups_is_refused():
    import checkpoints
    from conftest import ROOT
    gemma, _ = checkpoints.load_model(ROOT / "tests" / "data" / "gemma3_local_global", "float32")
    with pytest.raises(ConfigError, match="speculative_layers: not supported for a model with sliding and full"):
        make_engine(gemma, byte_tokenizer(), token_buckets=(8, 32), num_speculative_tokens=2, speculative_layers=1)
