"""logit_bias (OpenAI's) on the tiny random model: checked against the dense model's logits plus
the bias, greedy step by step; the rows without a bias are unchanged bit for bit; no compilation
after warm-up (make_engine's strict_compiles raises inside step()); validation names the field
on SamplingParams, HTTP and gRPC."""

from __future__ import annotations

import dataclasses
import json

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_forward, drain, make_engine

from jaxserve.model.sampler import BiasArrays, apply_logit_bias
from jaxserve.scheduler.scheduler import _speculates
from jaxserve.types import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine(tiny_model):
    model, tok = tiny_model
    # No prefix cache: the bit-for-bit comparison below needs both runs to compute the same
    # prompt tokens in the same steps (a cached prefix would change the step's layout).
    return make_engine(model, tok, token_buckets=(8, 32), enable_prefix_caching=False)


def run(eng, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
    drain(eng)
    return [eng.pop_finished(str(i)).outputs[0] for i in range(len(prompts))]


def biased_greedy_reference(model, prompt, bias, steps):
    """The dense model's greedy continuation with `bias` added to its fp32 logits, one full
    forward per token (an independent path: no paged cache, no on-device bias)."""
    fwd = dense_forward(model)
    add = np.zeros(model.cfg.vocab_size, np.float32)
    for t, b in (bias or {}).items():
        add[t] = b
    out = []
    for _ in range(steps):
        seq = list(prompt) + out
        out.append(int(np.argmax(fwd([seq])[0, len(seq) - 1].astype(np.float32) + add)))
    return out


def test_bias_forces_bans_and_shifts_greedy_tokens_as_the_dense_reference(engine, tiny_model):
    model, _ = tiny_model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 11, 17, 23)]
    plain = run(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)] * 4)
    forced = int(next(t for t in range(3, 256) if t not in plain[0].token_ids))
    biases = [
        None,  # unbiased, batched with the biased rows below
        {forced: 100.0},  # +100 outweighs any logit of this model: every token is `forced`
        {t: -100.0 for t in set(plain[2].token_ids)},  # every token the plain run chose is banned
        # Moderate biases on a third of the vocabulary: the argmax moves only where they tip it.
        {int(t): float(b) for t, b in zip(rng.choice(256, 85, replace=False), rng.uniform(-3, 3, 85))},
    ]
    got = run(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
                                               logit_bias=b) for b in biases])
    assert engine.compiles_after_warmup == 0  # (the dense reference below compiles its own)
    assert got[1].token_ids == [forced] * MAX_TOKENS
    assert not set(got[2].token_ids) & set(plain[2].token_ids)
    assert got[3].token_ids != plain[3].token_ids, "the moderate bias was meant to change the path"
    for p, b, g in zip(prompts, biases, got):
        assert g.token_ids == biased_greedy_reference(model, p, b, MAX_TOKENS)
    # The unbiased row is bit for bit what it was in a batch without biases; logprobs stay those
    # of the raw model (as vLLM and OpenAI report them), so they are exact too.
    assert got[0].token_ids == plain[0].token_ids
    assert [(lp.logprob, lp.top) for lp in got[0].logprobs] == [(lp.logprob, lp.top) for lp in plain[0].logprobs]


def test_bias_forces_a_sampled_token_too(engine):
    forced = 77
    out = run(engine, [[5, 6, 7]], [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                                   ignore_eos=True, logit_bias={forced: 100})])
    assert out[0].token_ids == [forced] * MAX_TOKENS


def test_apply_logit_bias_adds_each_pair_and_drops_padding():
    V = 10
    logits = np.arange(2 * V, dtype=np.float32).reshape(2, V)
    ids = np.full((2, 4), V, np.int32)  # V = padding
    vals = np.zeros((2, 4), np.float32)
    ids[0, :2], vals[0, :2] = (3, 9), (1.5, -100.0)
    want = logits.copy()
    want[0, 3] += 1.5
    want[0, 9] += -100.0
    np.testing.assert_array_equal(np.asarray(apply_logit_bias(jnp.asarray(logits), BiasArrays(ids, vals))), want)


@pytest.mark.parametrize("bias, needle", [
    ({1: 100.5}, "[-100, 100]"), ({1: float("nan")}, "[-100, 100]"), ({-1: 1.0}, "token ids"),
    ({"7": 1.0}, "token ids"), ({True: 1.0}, "token ids"), ({1: "x"}, "[-100, 100]"),
    ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
    ([(1, 1.0), (1, 2.0)], "given twice"), ("1:5", "must be a dict"),
])
def test_bad_logit_bias_names_the_field(bias, needle):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.field == "logit_bias" and needle in str(e.value)


def test_logit_bias_normal_form_round_trip_and_no_speculation():
    p = SamplingParams(temperature=0.0, logit_bias={9: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (9, 1.0)) and hash(p) == hash(SamplingParams(temperature=0.0, logit_bias=[(9, 1), (2, -3.5)]))
    assert SamplingParams(logit_bias={}).logit_bias is None
    # engine/lockstep.py sends params to other hosts as json(dataclasses.asdict(...)).
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))) == p
    # Draft tokens are verified against the unbiased argmax, so a biased request never drafts.
    assert _speculates(SamplingParams(temperature=0.0)) and not _speculates(p)


def test_token_outside_the_vocabulary_is_refused_at_add_request(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0.0, logit_bias={256: 1.0}))
    assert e.value.field == "logit_bias" and "outside [0, 256)" in str(e.value)


def test_logit_bias_over_http_and_grpc():
    from jaxserve.server.messages import spec_from_generate
    from jaxserve.server.proto import generation_pb2 as pb
    from test_server_support import base_url, http_server

    spec = spec_from_generate(pb.GenerateRequest(prompt="x", logit_bias={5: 2.5, 3: -100}))
    assert spec.params.logit_bias == ((3, -100.0), (5, 2.5))
    with http_server() as s:
        url = base_url(s) + "/v1/completions"
        ok = httpx.post(url, json={"model": "fake", "prompt": "Hi", "max_tokens": 3, "logit_bias": {"65": 5}})
        assert ok.status_code == 200, ok.text
        for bias, needle in (({"a": 1}, "token ids"), ({"1": 101}, "[-100, 100]"), ({"7": 1, "07": 1}, "twice"),
                             ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}")):
            r = httpx.post(url, json={"model": "fake", "prompt": "Hi", "logit_bias": bias})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "logit_bias" and needle in err["message"], r.text


def test_dense_generator_refuses_what_it_cannot_apply(tiny_model):
    from jaxserve.engine.dense_generator import DenseGenerator
    gen = DenseGenerator(tiny_model[0])
    for kw in ({"logit_bias": {1: 1.0}}, {"prompt_logprobs": 1}):
        with pytest.raises(InvalidRequestError) as e:
            next(gen.generate([1, 2], SamplingParams(**kw)))  # raised before anything compiles
        assert e.value.field == next(iter(kw))
