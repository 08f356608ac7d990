"""Prefix caching in the real engine: the same tokens with caching on as off, exactly (greedy and
seeded sampling), for random workloads whose prompts share prefixes of random lengths around
page boundaries, arriving in waves so later ones match what earlier ones left cached; with
preemption forced by a small pool, n > 1, speculative decoding with int8 KV, a sliding-window
model and tp = 2 on fake devices. Greedy outputs are also checked against the dense reference.

Why exact equality: a cached page holds the K/V the same model computed for the same prefix,
and each position's K/V and logits depend only on the tokens before it; the tests of chunked
prefill and preemption (test_engine.py) already hold the engine to the same tokens however a
prompt is split into steps, and a hit is one more way of splitting it.

One token bucket per engine (every step pads to 32 tokens) and the session's compilation
cache keep each pair of engines to one compile."""

from __future__ import annotations

import numpy as np
from conftest import ROOT, assert_dense_greedy, byte_tokenizer, drain, make_engine

from jaxserve.types import SamplingParams

PS = 4


def workload(seed: int, n_requests: int = 14, vocab: int = 256, n_samples: bool = False,
             max_tokens: int = 6):
    """(prompt, params) pairs: each prompt is one of three random bases cut at a page boundary
    +-1 token, plus 0-5 tokens of its own (0: two requests may send the very same prompt).
    Every third request samples (seeded), with n_samples every fourth has n = 2."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(3, vocab, 48).tolist() for _ in range(3)]
    out = []
    for i in range(n_requests):
        base = bases[int(rng.integers(3))]
        cut = max(1, min(len(base), int(rng.integers(1, 12)) * PS + int(rng.integers(-1, 2))))
        prompt = base[:cut] + rng.integers(3, vocab, int(rng.integers(0, 6))).tolist()
        kw = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)  # greedy unless below
        if i % 3 == 1:
            kw.update(temperature=0.8, seed=1000 + i)
        if n_samples and i % 4 == 2:
            kw.update(n=2, temperature=0.8, seed=2000 + i)
        out.append((prompt, SamplingParams(**kw)))
    return out


def run(eng, work, waves: int = 3, steps_between: int = 4):
    """Add the workload in waves with a few steps between them; token ids per request and
    sample, the outputs, and the engine's prefix-cache statistics."""
    per = -(-len(work) // waves)
    for w in range(waves):
        for i, (prompt, params) in enumerate(work[w * per:(w + 1) * per], start=w * per):
            eng.add_request({"prompt_token_ids": prompt}, params, request_id=str(i))
        for _ in range(steps_between):
            if eng.has_unfinished():
                eng.step()
    drain(eng)
    assert eng.compiles_after_warmup == 0
    outs = [eng.pop_finished(str(i)) for i in range(len(work))]
    return [[c.token_ids for c in o.outputs] for o in outs], outs, eng.prefix_cache_stats()


def on_and_off(model, tok, work, **kw):
    """The workload on an engine with caching off, then on one with it on (same shapes: the
    second engine's executable comes from the session's compilation cache)."""
    base = dict(token_buckets=(32,), page_size=PS)
    base.update(kw)
    off_tokens, _, off_stats = run(make_engine(model, tok, enable_prefix_caching=False, **base), work)
    eng = make_engine(model, tok, **base)
    on_tokens, outs, stats = run(eng, work)
    assert off_stats["hits"] == off_stats["queries"] == 0
    assert stats["hits"] > 0, stats  # the workload did hit the cache
    assert sum(o.num_cached_tokens for o in outs) > 0
    return on_tokens, off_tokens, eng


def test_outputs_equal_caching_off_and_dense_greedy_with_preemption_and_n(tiny_model):
    model, tok = tiny_model
    work = workload(1, n_requests=16, n_samples=True)
    # 19 usable pages of 4 tokens for up to 8 sequences of up to ~56 tokens: preemption forced.
    on, off, eng = on_and_off(model, tok, work, num_pages=20)
    assert on == off
    assert eng.stats["preemptions"] > 0 and eng.prefix_cache_stats()["evictions"] > 0
    # Greedy outputs are the dense model's continuations (an independent reference), checked
    # in one forward over every greedy request.
    greedy = [(p, o[0]) for (p, params), o in zip(work, on) if params.greedy]
    assert len(greedy) > 5
    assert_dense_greedy(model, [p for p, _ in greedy], [o for _, o in greedy], 6)


def test_outputs_equal_with_speculative_decoding_and_int8_kv(tiny_model):
    model, tok = tiny_model
    # Prompts from a 6-token alphabet repeat themselves, so n-gram drafts are proposed.
    work = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p, _ in workload(2, vocab=9)]
    on, off, eng = on_and_off(model, tok, work, num_speculative_tokens=3, kv_cache_dtype="int8")
    assert on == off and eng.stats["draft_tokens"] > 0


def test_outputs_equal_on_a_sliding_window_model():
    """mistral_swa: window of 8 tokens, pages of 4, so windows straddle pages. Pages behind the
    window are freed (scheduler/window.py) after the prefix cache registered them, so a matched
    page holds exactly the K/V a recompute would write."""
    import checkpoints
    model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "mistral_swa", "float32")
    assert model.cfg.sliding_window == 8
    on, off, _ = on_and_off(model, byte_tokenizer(loaded.config.eos_token_ids), workload(4))
    assert on == off


def test_outputs_equal_under_tensor_parallelism():
    from tp_cases import tiny_tp_model
    on, off, eng = on_and_off(tiny_tp_model(), byte_tokenizer(), workload(5), tp=2)
    assert on == off and eng.runner.mesh.shape["tp"] == 2


def test_reset_and_num_cached_tokens(tiny_model):
    model, tok = tiny_model
    # The shapes of the first test's engines: their executable is in the session's cache.
    eng = make_engine(model, tok, token_buckets=(32,), page_size=PS, num_pages=20)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    p = SamplingParams(temperature=0.0, max_tokens=3)
    first = eng.add_request(prompt, p)
    drain(eng)
    assert eng.pop_finished(first).num_cached_tokens == 0
    again = eng.add_request(prompt, p)
    drain(eng)
    assert eng.pop_finished(again).num_cached_tokens == 16  # 4 full pages; the 20th token computed
    assert eng.reset_prefix_cache() > 0 and eng.prefix_cache_stats()["cached_pages"] == 0
    third = eng.add_request(prompt, p)
    drain(eng)
    assert eng.pop_finished(third).num_cached_tokens == 0
