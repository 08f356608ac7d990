"""The paged engine against the dense reference, and its sampling, stop, n > 1, logprob,
abort and compile-count contracts."""

import jax
import numpy as np
import pytest
from conftest import assert_dense_greedy, dense_forward, drain, make_engine
from tolerances import fp32_logprobs_atol

from jaxserve.types import InvalidRequestError, SamplingParams


def test_engine_matches_dense_on_smollm2_with_chunking_and_preemption(smollm2):
    """16 requests of mixed lengths arriving at different steps, prompts chunked (budget 32
    tokens), a pool of 40 pages of 4 tokens for up to 8 running sequences: preemptions happen,
    and every greedy output still equals the dense model's, token for token."""
    lm = smollm2
    rng = np.random.default_rng(0)
    texts = ["The capital of France is", "Once upon a time, there was a little",
             "def fibonacci(n):", "The three primary colours are"]
    prompts = [lm.tokenizer.encode(t) for t in texts]
    prompts += [rng.integers(3, 49152, size=int(n)).tolist() for n in rng.integers(1, 90, size=12)]
    eng = make_engine(lm.model, lm.tokenizer, lm.eos_token_ids, max_model_len=256, page_size=4,
                      num_pages=41, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(1, 8, 32))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for wave in range(4):  # arrivals spread over the run
        for i in range(wave * 4, wave * 4 + 4):
            eng.add_request({"prompt_token_ids": prompts[i]}, params, request_id=str(i))
        for _ in range(3):
            outputs += eng.step()
    outputs += drain(eng)
    assert eng.stats["preemptions"] > 0, "the pool was meant to force preemption"
    assert eng.compiles_after_warmup == 0
    got = [eng.pop_finished(str(i)).outputs[0] for i in range(len(prompts))]
    assert_dense_greedy(lm.model, prompts, [g.token_ids for g in got], params.max_tokens, lm.eos_token_ids)
    for i, g in enumerate(got):
        assert "".join(d.text for d in outputs if d.request_id == str(i)) == g.text


def test_no_compilation_after_warmup_over_200_random_requests(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok, max_num_seqs=8, num_pages=64)
    rng = np.random.default_rng(1)
    for i in range(200):
        n = int(rng.integers(1, 120))
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 24)), temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_k=int(rng.choice([-1, 5])), top_p=float(rng.choice([1.0, 0.8])),
            min_p=float(rng.choice([0.0, 0.1])), seed=int(rng.integers(0, 2**40)),
            repetition_penalty=float(rng.choice([1.0, 1.3])), presence_penalty=float(rng.choice([0.0, 0.5])),
            logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None,
            n=int(rng.choice([1, 1, 2])), stop=("ab",) if rng.random() < 0.2 else ())
        eng.add_request({"prompt_token_ids": rng.integers(0, 256, n).tolist()}, params, request_id=str(i))
        if i % 10 == 9:
            for _ in range(4):
                eng.step()
        if i % 37 == 0:
            eng.abort_request(str(i))
    drain(eng)
    assert eng.compiles_after_warmup == 0  # strict_compiles would also have raised inside step()
    eng.scheduler.check_idle_invariant()


def _run(eng, requests):
    for rid, prompt, params in requests:
        eng.add_request(prompt, params, request_id=rid)
    drain(eng)
    return {rid: eng.pop_finished(rid) for rid, _, _ in requests}


def test_seeded_sample_does_not_depend_on_batch_mates(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok)
    prompt = {"prompt_token_ids": [5, 17, 99, 3, 200, 41]}
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _run(eng, [("a", prompt, params)])["a"].outputs[0].token_ids
    rng = np.random.default_rng(2)
    mates = [(f"m{i}", {"prompt_token_ids": rng.integers(0, 256, int(rng.integers(1, 30))).tolist()},
              SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True)) for i in range(7)]
    batch = _run(eng, mates[:3] + [("a", prompt, params)] + mates[3:])
    assert batch["a"].outputs[0].token_ids == alone
    other_seed = _run(eng, [("b", prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                          seed=4321, ignore_eos=True))])
    assert other_seed["b"].outputs[0].token_ids != alone  # the seed matters (could only tie by chance)


def test_n_samples_share_prefill_and_match_independent_requests(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok)
    prompt = {"prompt_token_ids": list(range(10, 40))}  # 30 tokens: 7 full pages shared
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=77, n=3, ignore_eos=True)
    out = _run(eng, [("n3", prompt, params)])["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    single = _run(eng, [("n1", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=77,
                                                       ignore_eos=True))])["n1"]
    assert out.outputs[0].token_ids == single.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    greedy = _run(eng, [("g", prompt, SamplingParams(temperature=0.0, max_tokens=10, n=2, ignore_eos=True))])["g"]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_logprobs_equal_log_softmax_of_dense_logits(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok)
    prompt = [7, 8, 9, 100, 150, 3]
    out = _run(eng, [("lp", {"prompt_token_ids": prompt},
                      SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True))])["lp"].outputs[0]
    seq = prompt + out.token_ids
    logits = dense_forward(model)([seq])[0][:len(seq)]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    # Paged attention and bucketed steps against one dense pass: fp32 summation order only.
    atol = fp32_logprobs_atol(model.cfg, len(seq), logits)
    for j, entry in enumerate(out.logprobs):
        row = lp[len(prompt) - 1 + j]
        assert entry.token_id == out.token_ids[j]
        assert entry.logprob == pytest.approx(row[entry.token_id], abs=atol)
        assert [t for t, _ in entry.top] == list(np.argsort(-row)[:5])
        np.testing.assert_allclose([v for _, v in entry.top], np.sort(row)[::-1][:5], atol=atol)


def test_stop_strings_cut_exactly_across_token_boundaries(smollm2):
    lm = smollm2
    eng = make_engine(lm.model, lm.tokenizer, lm.eos_token_ids, page_size=16, num_pages=32,
                      max_num_batched_tokens=32, token_buckets=(1, 8, 32))
    prompt = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 ..."
    cases = {"digits": ("2018",), "words": ("answer is",), "two": ("zzz", ".\n\nThe")}
    reqs = [(k, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=v)) for k, v in cases.items()]
    for rid, p, sp in reqs:
        eng.add_request(p, sp, request_id=rid)
    deltas = drain(eng)
    want = {"digits": " Paris.\n\nThe answer is: ", "words": " Paris.\n\nThe ", "two": " Paris"}
    for rid, text in want.items():
        out = eng.pop_finished(rid).outputs[0]
        assert out.text == text and out.finish_reason == "stop", rid
        assert "".join(d.text for d in deltas if d.request_id == rid) == text


def test_abort_in_each_phase_frees_pages_at_once(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok, num_pages=40, max_num_seqs=2, max_num_batched_tokens=8,
                      token_buckets=(1, 8))
    total = eng.scheduler.num_free_pages
    long_prompt = {"prompt_token_ids": list(range(1, 60))}  # 59 tokens: 8 chunks of 8
    eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="decoding")
    for _ in range(9):
        eng.step()  # prefill done, now decoding
    eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="prefilling")
    eng.step()
    eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="waiting")
    assert eng.scheduler.num_waiting >= 1
    for rid in ("waiting", "prefilling", "decoding"):
        assert eng.abort_request(rid)
    assert eng.scheduler.num_free_pages == total  # freed within the same call, not a step later
    deltas = eng.step()
    assert sorted(d.request_id for d in deltas if d.finished) == ["decoding", "prefilling", "waiting"]
    assert all(d.finish_reason == "abort" for d in deltas)
    assert not eng.has_unfinished()
    eng.scheduler.check_idle_invariant()
    # The ids are reusable at once.
    eng.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=2), request_id="decoding")
    drain(eng)


def test_bad_requests_rejected_before_allocation(tiny_model):
    model, tok = tiny_model
    eng = make_engine(model, tok)
    free = eng.scheduler.num_free_pages
    cases = [({"prompt_token_ids": []}, SamplingParams(), "prompt_token_ids"),
             ({"prompt_token_ids": [256]}, SamplingParams(), "prompt_token_ids"),
             ({"prompt_token_ids": [-1]}, SamplingParams(), "prompt_token_ids"),
             ({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=10), "max_tokens"),
             ("x" * 2_000_000, SamplingParams(), "prompt"),
             ({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=(999,)), "stop_token_ids")]
    for prompt, params, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request(prompt, params)
        assert e.value.field == field
        assert eng.scheduler.num_free_pages == free and not eng.has_unfinished()
    eng.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0.0, max_tokens=2))
    drain(eng)


def test_dense_greedy_check_refuses_a_wrong_token_or_length(tiny_model):
    """The check the SmolLM2 engine tests rest on (conftest.assert_dense_greedy) agrees with the
    dense generator and fails on any other token or length."""
    from jaxserve.engine.dense_generator import DenseGenerator
    model, _ = tiny_model
    prompt = [5, 6, 7, 8, 9]
    want = list(DenseGenerator(model).generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    assert_dense_greedy(model, [prompt], [want], 10)
    wrong = want[:4] + [(want[4] + 1) % 256] + want[5:]
    with pytest.raises(AssertionError, match="output token 4"):
        assert_dense_greedy(model, [prompt], [wrong], 10)
    with pytest.raises(AssertionError, match="stopped after 9 of 10"):
        assert_dense_greedy(model, [prompt], [want[:9]], 10)
    with pytest.raises(AssertionError, match="went on past stop token"):
        assert_dense_greedy(model, [prompt], [want], 10, stop_ids=[want[2]])
