"""A draft model of its own (Engine(draft_model=...), --speculative-model / --speculative-quantize):
its own KV cache on the target's pages, written in every step for every token the target computes.
With the target itself as its draft every draft must be kept, which holds only if the draft's
cache covers every position (prefill chunks, decode tokens, kept drafts, prefix-cache hits,
recomputation after preemption); with another draft greedy outputs stay the dense model's."""

import numpy as np
import pytest
from conftest import assert_dense_greedy, drain, make_engine
from test_engine_prefix_cache import on_and_off, workload
from test_speculative_sampling import noisy_copy

from jaxserve.config import ConfigError, LoadConfig
from jaxserve.engine.build import check_same_vocabulary
from jaxserve.types import SamplingParams


# One engine shape for the greedy runs: the same step programs (a draft's weights are arguments,
# not constants), so every engine after the first loads them from the test run's compilation
# cache (conftest.XLA_CACHE) instead of compiling them again.
# 21 usable pages of 4 for up to 4 sequences of up to 44 + 16 tokens: preemption is forced;
# prompts up to 44 tokens and a 32-token budget: prefill is chunked. One bucket: the step
# always pads to 32 (the bucket list is not what these tests are about).
SHAPE = dict(max_model_len=128, page_size=4, num_pages=22, max_num_seqs=4, max_num_batched_tokens=32,
             token_buckets=(32,), num_speculative_tokens=3)


def _greedy_run(model, tok, prompts, draft, **kw):
    eng = make_engine(model, tok, **{**SHAPE, **kw}, draft_model=draft)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, params, request_id=str(i))
        eng.step()
    drain(eng)
    assert eng.compiles_after_warmup == 0
    return [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(prompts))], eng


def _prompts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(k)).tolist() for k in rng.integers(3, 45, n)]


def test_the_target_as_its_own_draft_keeps_every_draft_through_chunks_and_preemption(tiny_model):
    model, tok = tiny_model
    prompts = _prompts()
    got, eng = _greedy_run(model, tok, prompts, model)
    assert eng.stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert eng.stats["draft_tokens"] > 0
    assert eng.stats["accepted_draft_tokens"] == eng.stats["draft_tokens"], (
        f"{eng.stats}: a draft equal to the target refused some: its KV cache missed a position")
    assert_dense_greedy(model, prompts, got, 16)


def test_another_draft_leaves_greedy_outputs_the_dense_models(tiny_model):
    model, tok = tiny_model
    prompts = _prompts(seed=1)
    got, eng = _greedy_run(model, tok, prompts, noisy_copy(model, scale=0.3))
    assert 0 < eng.stats["accepted_draft_tokens"] < eng.stats["draft_tokens"], eng.stats
    assert_dense_greedy(model, prompts, got, 16)


def test_with_prefix_caching_and_int8_kv_the_own_copy_still_keeps_every_draft(tiny_model):
    model, tok = tiny_model
    work = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p, _ in workload(3)]
    on, off, eng = on_and_off(model, tok, work, num_speculative_tokens=3, kv_cache_dtype="int8", draft_model=model)
    assert on == off and eng.stats["draft_tokens"] > 0
    # A prefix-cache hit skips the target's computation of those pages: the draft's cache must
    # hold them too (written when they were first computed), or its drafts would be refused.
    assert eng.stats["accepted_draft_tokens"] == eng.stats["draft_tokens"], eng.stats


def _unwarmed(model, tok, draft_model=None, **kw):
    """make_engine's engine without its warm-up: for what construction alone decides (the
    pool's size, the warning), which no compiled step program changes."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    base = dict(max_model_len=256, page_size=4, num_pages=96, max_num_seqs=8, max_num_batched_tokens=32,
                token_buckets=(8, 32))
    return Engine(model, tok, EngineConfig(**{**base, **kw}), (), draft_model=draft_model)


def test_the_pool_counts_both_models_pages(tiny_model):
    model, tok = tiny_model
    plain = _unwarmed(model, tok, num_pages=None, kv_cache_bytes=1 << 20)
    both = _unwarmed(model, tok, num_pages=None, kv_cache_bytes=1 << 20, num_speculative_tokens=2, draft_model=model)
    assert both.scheduler_config.num_pages == plain.scheduler_config.num_pages // 2


def test_a_draft_not_smaller_than_the_target_is_warned(tiny_model, caplog):
    model, tok = tiny_model
    with caplog.at_level("WARNING", logger="jaxserve.engine"):
        _unwarmed(model, tok, num_speculative_tokens=2, draft_model=model)
    assert "the draft's weights" in caplog.text and "not smaller than the target's" in caplog.text


def test_bad_drafts_are_one_line_naming_the_field(tiny_model):
    model, tok = tiny_model
    with pytest.raises(ConfigError, match="speculative_model: drafts up to num_speculative_tokens"):
        make_engine(model, tok, token_buckets=(8, 32), draft_model=model)
    with pytest.raises(ConfigError, match="speculative_layers: a draft model of its own and self-speculation"):
        make_engine(model, tok, token_buckets=(8, 32), num_speculative_tokens=2, speculative_layers=1,
                    draft_model=model)
    with pytest.raises(ConfigError, match="speculative_quantize"):
        LoadConfig(speculative_quantize="int3")


class _Vocab:
    def __init__(self, tokens):
        self.tokens = tokens
        self.vocab_size = len(tokens)

    def id_to_token(self, i):
        return self.tokens[i]


def test_a_draft_with_another_tokenizer_is_refused_naming_the_first_difference():
    check_same_vocabulary(_Vocab(["a", "b", "c"]), _Vocab(["a", "b", "c"]))
    with pytest.raises(ConfigError, match=r"speculative_model: token 1 is 'x' in the draft's tokenizer, 'b' in the target's"):
        check_same_vocabulary(_Vocab(["a", "b", "c"]), _Vocab(["a", "x", "c"]))
    with pytest.raises(ConfigError, match="speculative_model: its tokenizer has 2 tokens, the target's 3"):
        check_same_vocabulary(_Vocab(["a", "b", "c"]), _Vocab(["a", "b"]))


def test_build_engine_loads_a_quantized_copy_of_the_target_as_its_draft():
    """--speculative-quantize int8 without --speculative-model: the target's own checkpoint,
    quantized, drafts (the path `serve`, `generate` and the scripts take)."""
    from conftest import ROOT, assert_dense_greedy

    from jaxserve.config import EngineConfig
    from jaxserve.engine.build import build_engine
    load = LoadConfig(model=str(ROOT / "tests" / "data" / "llama_mqa"), dtype="float32", speculative_quantize="int8")
    # One bucket: half the step programs to compile, and the bucket list is not what this is about.
    lm, eng = build_engine(load, EngineConfig(max_model_len=128, page_size=4, num_pages=40, max_num_seqs=4,
                                              max_num_batched_tokens=32, token_buckets=(32,),
                                              num_speculative_tokens=2))
    assert eng.runner.own_draft and eng.scheduler_config.model_drafts
    eng.warmup(progress=False)
    prompts = _prompts(3, seed=2)
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                        request_id=str(i))
    drain(eng)
    assert eng.stats["accepted_draft_tokens"] > 0
    assert_dense_greedy(lm.model, prompts, [eng.pop_finished(str(i)).outputs[0].token_ids for i in range(3)], 10)


def test_a_missing_draft_path_is_one_line_before_the_target_loads(monkeypatch):
    from jaxserve import loading
    from jaxserve.config import EngineConfig
    from jaxserve.engine.build import build_engine

    def no_load(*a, **kw):
        raise AssertionError("the target was loaded before the draft's path was checked")
    monkeypatch.setattr(loading, "load", no_load)
    with pytest.raises(ConfigError, match="speculative_model: /no/such/draft does not exist"):
        build_engine(LoadConfig(speculative_model="/no/such/draft"), EngineConfig(num_speculative_tokens=2))
