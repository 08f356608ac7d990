"""The on-device sampler: filters and penalties checked by hand on tiny vocabularies."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.sampler import (PenaltyArrays, _filtered_logits, apply_penalties, argmax,
                                    host_sampling_arrays, logprobs_of, sample)
from jaxserve.types import InvalidRequestError, SamplingParams


def rows(n, **kw):
    base = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, step=0)
    base.update(kw)
    return host_sampling_arrays([dict(base, seed=base["seed"] + i) for i in range(n)])


def draws(logits, n=400, **kw):
    """Sample the same logits with n different seeds; returns the set of tokens seen."""
    lg = jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))
    return set(np.asarray(sample(lg, rows(n, **kw))).tolist())


def test_greedy_is_argmax():
    lg = jnp.array([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert np.asarray(sample(lg, rows(2, temperature=0.0))).tolist() == [1, 0]


@pytest.mark.parametrize("v", [1000, 1024])  # a padded last chunk, and whole chunks of 128
def test_argmax_is_jnp_argmax_ties_and_nan_included(v):
    # Chunk maxima, then the first hit inside one chunk, in place of argmax's (value, index)
    # reduce: the same first index on ties (within a chunk and across chunks), at -inf, and on
    # the first NaN (which wins over a larger value before it), as jnp.argmax gives.
    rng = np.random.default_rng(0)
    lg = rng.standard_normal((9, v)).astype(np.float32)
    lg[1, [7, 500]] = 9.0  # a tie across chunks: the first
    lg[2, :] = -np.inf
    lg[3, [40, 900]] = np.nan  # the first NaN
    lg[4, :] = 1.0
    lg[5, -1] = 99.0
    lg[6, [3, 5]] = 9.0  # a tie inside one chunk
    lg[7, 2] = 50.0
    lg[7, 300] = np.nan  # a NaN in a later chunk than the max
    lg[8, 130] = 7.0
    lg[8, 129] = np.nan  # a NaN just before the max, in the same chunk
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(lg))), np.argmax(lg, axis=-1))
    assert np.asarray(argmax(jnp.asarray(lg))).tolist()[1:] == [7, 0, 40, 0, v - 1, 3, 300, 129]
    # leading dims are kept
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(lg.reshape(3, 3, v)))),
                                  np.argmax(lg, axis=-1).reshape(3, 3))


def _sorted_reference_keep(lg, top_k, top_p, min_p):
    """The filters by a sort, in float64 (the definition the bisections must meet): top-k by
    rank, then top-p keeps a token while the mass ranked before it is below top_p, then
    min-p against the most likely."""
    V = lg.shape[-1]
    order = np.argsort(-lg, kind="stable")
    srt = lg[order].astype(np.float64)
    keep = np.arange(V) < (top_k if top_k > 0 else V)
    srt = np.where(keep, srt, -np.inf)
    probs = np.exp(srt - srt.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep &= (np.cumsum(probs) - probs) < top_p
    keep &= probs >= min_p * probs[0]
    keep[0] = True
    out = np.zeros(V, bool)
    out[order] = keep
    return out


@pytest.mark.parametrize("top_k,top_p,min_p", [(-1, 1.0, 0.0), (1, 1.0, 0.0), (50, 1.0, 0.0), (-1, 0.9, 0.0),
                                               (-1, 0.3, 0.0), (40, 0.8, 0.05), (-1, 1.0, 0.1), (4000, 0.95, 0.0)])
def test_filters_keep_what_a_sort_keeps(top_k, top_p, min_p):
    # The bisection thresholds (no sort) against the sorted definition, on 4 rows of 4,000
    # distinct logits at two temperatures' spreads; margins keep float rounding of the
    # cumulative mass off the decision (a token whose mass-before sits within 1e-4 of top_p
    # may fall either way).
    rng = np.random.default_rng(top_k + int(100 * top_p) + int(1000 * min_p))
    lg = (rng.standard_normal((4, 4000)) * np.array([[0.5], [2.0], [4.0], [8.0]])).astype(np.float32)
    arrays = rows(4, top_k=top_k, top_p=top_p, min_p=min_p)
    got = np.asarray(_filtered_logits(jnp.asarray(lg), arrays)) > -1e29
    for r in range(4):
        want = _sorted_reference_keep(lg[r], top_k, top_p, min_p)
        if top_p < 1.0:  # decisions within rounding of the top_p boundary are not compared
            order = np.argsort(-lg[r], kind="stable")
            srt = np.where(np.arange(4000) < (top_k if top_k > 0 else 4000), lg[r][order].astype(np.float64), -np.inf)
            p = np.exp(srt - srt.max())
            p /= p.sum()
            near = np.zeros(4000, bool)
            near[order] = np.abs(np.cumsum(p) - p - top_p) < 1e-4
            got[r] &= ~near
            want &= ~near
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")
        assert want.sum() >= 1


def test_top_k_keeps_k_best():
    assert draws([0.0, 1.0, 2.0, 3.0], top_k=2) == {2, 3}


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs of logits ln[5, 3, 1, 1] / 10 = [0.5, 0.3, 0.1, 0.1]: top_p 0.7 -> {0, 1}
    lg = np.log([5.0, 3.0, 1.0, 1.0])
    assert draws(lg, top_p=0.7) == {0, 1}
    assert draws(lg, top_p=0.5) == {0}  # the first token alone reaches 0.5


def test_min_p_drops_unlikely_tokens():
    # probs [0.5, 0.3, 0.1, 0.1]; min_p 0.4 -> keep p >= 0.2 -> {0, 1}
    assert draws(np.log([5.0, 3.0, 1.0, 1.0]), min_p=0.4) == {0, 1}


def test_all_tokens_reachable_without_filters():
    assert draws(np.zeros(4)) == {0, 1, 2, 3}


def test_same_seed_same_token_regardless_of_row():
    lg = jnp.tile(jnp.zeros(50)[None], (3, 1))
    a = sample(lg, host_sampling_arrays([dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
                                              seed=s, step=4) for s in (9, 123, 9)]))
    assert int(a[0]) == int(a[2])


def test_penalties_by_hand():
    lg = jnp.array([[2.0, -2.0, 1.0, 0.5]])
    p = PenaltyArrays(repetition=jnp.array([2.0]), presence=jnp.array([0.5]), frequency=jnp.array([0.25]),
                      prompt_ids=jnp.array([[1, -1, -1]]), output_ids=jnp.array([[0, 0, 2]]))
    out = np.asarray(apply_penalties(lg, p))[0]
    # token 0: seen, positive -> 2/2 = 1; output twice -> -0.25*2 - 0.5 = 0.0
    # token 1: in prompt only, negative -> -2*2 = -4; no output penalties
    # token 2: seen once in output -> 1/2 - 0.25 - 0.5 = -0.25; token 3 untouched
    np.testing.assert_allclose(out, [0.0, -4.0, -0.25, 0.5])


def test_logprobs_of():
    lg = jnp.array([[0.0, math.log(3.0)]])
    chosen, ids, lps = logprobs_of(lg, jnp.array([0]), 2)
    assert float(chosen[0]) == pytest.approx(math.log(0.25))
    assert np.asarray(ids).tolist() == [[1, 0]]
    np.testing.assert_allclose(lps, [[math.log(0.75), math.log(0.25)]], rtol=1e-6)


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=2**31), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.0001), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n"), (dict(n=10**6), "n"),
    (dict(stop=("",)), "stop"), (dict(stop=tuple("x" * i for i in range(1, 10**5))), "stop"),
    (dict(logprobs=21), "logprobs"), (dict(seed=-1), "seed"), (dict(stop_token_ids=(-1,)), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_documented_edge_values_are_valid():
    SamplingParams(temperature=0.0, top_p=1.0, max_tokens=1, top_k=0, logprobs=20)


# vLLM's SamplingParams defaults for the fields both classes have, transcribed from vLLM's
# vllm/sampling_params.py (the msgspec Struct's field defaults; top_k 0, which vLLM's docs call
# "0 (or -1)": off). Not compared: stop / stop_token_ids, vLLM's None and our () (frozen,
# hashable params keep tuples; both mean none; README "Where the offline API differs").
VLLM_DEFAULTS = dict(n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                     temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, ignore_eos=False,
                     max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None,
                     skip_special_tokens=True, structured_outputs=None, logit_bias=None)


def test_default_sampling_params_are_vllms():
    p = SamplingParams()
    assert {k: getattr(p, k) for k in VLLM_DEFAULTS} == VLLM_DEFAULTS
    assert not p.greedy and p.stop == () and p.stop_token_ids == ()


def test_each_front_door_keeps_its_documented_default_temperature(capsys):
    """SamplingParams() samples (vLLM's 1.0) and so does the HTTP API (OpenAI's 1.0), while
    gRPC's GenerateRequest (unset is proto3's 0), JetStream's Decode and `jaxserve generate`
    stay greedy."""
    from jaxserve.cli import build_parser, generate_params
    from jaxserve.server import messages
    from jaxserve.server.openai_api import protocol
    from jaxserve.server.proto import generation_pb2 as pb
    from jaxserve.server.proto import jetstream_pb2 as js

    assert messages.spec_from_generate(pb.GenerateRequest(prompt="x")).params.temperature == 0.0
    assert messages.spec_from_generate(pb.GenerateRequest(prompt="x", temperature=0.7)).params.temperature == 0.7
    decode = js.DecodeRequest(max_tokens=3, text_content=js.DecodeRequest.TextContent(text="x"))
    assert messages.spec_from_decode(decode).params.temperature == 0.0
    (spec,) = protocol.completion_specs(protocol.CompletionRequest(model="m", prompt="x"))
    assert spec.params.temperature == 1.0
    spec, _ = protocol.chat_spec(protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]))
    assert spec.params.temperature == 1.0
    parser = build_parser()
    assert generate_params(parser.parse_args(["generate", "--prompt", "x"])).greedy
    assert generate_params(parser.parse_args(["generate", "--prompt", "x", "--temperature", "0.5"])).temperature == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    assert "0 = greedy, the default here" in " ".join(capsys.readouterr().out.split())
