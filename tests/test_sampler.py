"""The on-device sampler: filters and penalties checked by hand on tiny vocabularies."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.sampler import (PenaltyArrays, apply_penalties,
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
