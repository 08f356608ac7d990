"""Every per-request value that reaches a device array is range-checked at admission.

A property test drives random SamplingParams (in range and far outside: int32 / int64 / uint64
edges, NaN, inf, subnormals) through admission and one real engine step of the tiny model:
admission either refuses with an InvalidRequestError naming a field the request set, or the
step runs without a fault (an exception inside the step is now caught by engine/faults.py, so
"no fault" is checked on the engine's own fault counter) and samples ids inside the vocabulary.
The tiny model compiles one 8-token bucket once (~2 s); each example is one host-side step of a
2-layer model, so 150 examples cost a few seconds.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from conftest import make_engine
from jaxserve.types import INT32_MAX, InvalidRequestError, SamplingParams

EDGE_INTS = [-2**63, -2**31 - 1, -2**31, -2, -1, 0, 1, 2, 7, 255, 256, 257, 2**31 - 1, 2**31, 2**32,
             2**63 - 1, 2**63, 2**64]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, -1.0, -1e-300, 0.0, 5e-324, 1e-40, 1e-6, 1e-5, 0.5, 1.0,
               1.0001, 2.0, 10.0, 100.0, 1e38, 1e300]


VALID = {
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 300), "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 4), "logprobs": st.integers(0, 20),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3), "ignore_eos": st.booleans(),
}
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"}
EDGES = {name: st.sampled_from(EDGE_FLOATS if name in FLOAT_FIELDS else EDGE_INTS) for name in VALID}
EDGES["stop_token_ids"] = st.lists(st.sampled_from(EDGE_INTS), min_size=1, max_size=2)
EDGES["ignore_eos"] = st.booleans()


@st.composite
def sampling_kwargs(draw):
    """A valid set of fields, then up to two of them replaced by an edge of some dtype: most
    examples reach the step with one value at an edge (the case that used to break it)."""
    kw = draw(st.fixed_dictionaries({}, optional=VALID))
    for name in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=2, unique=True)):
        kw[name] = draw(EDGES[name])
    return kw


PARAMS = sampling_kwargs()
# Mostly valid ids; now and then one outside the vocabulary (-1, V, 2^31).
PROMPTS = st.lists(st.integers(0, 255), min_size=1, max_size=6) | st.lists(
    st.sampled_from([0, 5, -1, 256, 2**31]), min_size=1, max_size=3)
STEPPED = []


@pytest.fixture(scope="module")
def engine(tiny_model):
    model, tok = tiny_model
    return make_engine(model, tok, token_buckets=(8,), max_num_batched_tokens=8, max_model_len=64,
                       num_pages=64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kw=PARAMS, prompt=PROMPTS)
# The QA finding and its neighbours always run, whatever Hypothesis draws.
@example(kw={"top_k": 2**31, "temperature": 1.0}, prompt=[1, 2])
@example(kw={"top_k": 2**31 - 1, "temperature": 1.0}, prompt=[1, 2])
@example(kw={"top_k": 256, "temperature": 0.7, "seed": 2**63 - 1}, prompt=[3])
def test_random_params_are_refused_at_admission_or_step_cleanly(engine, kw, prompt):
    V = engine.model_config.vocab_size
    try:
        params = SamplingParams(**kw)
        rid = engine.add_request({"prompt_token_ids": prompt}, params)
    except InvalidRequestError as e:
        assert e.field in set(kw) | {"prompt_token_ids"}, (e.field, kw)
        return
    faults = engine.stats["step_faults"]
    STEPPED.append(kw)
    out = engine.step()
    assert engine.stats["step_faults"] == faults, f"the step failed for {kw}: {engine.last_step_fault}"
    assert not [d for d in out if d.finish_reason == "error"]
    assert all(0 <= t < V for d in out for t in d.token_ids)
    engine.abort_request(rid)
    engine.step()  # hands back the abort deltas; the engine is idle and checked so
    engine.pop_finished(rid)
    assert not engine.has_unfinished()


def test_the_property_test_reached_the_step_with_edge_values():
    """The strategy is not vacuous: many examples got past admission, top_k >= V among them."""
    assert len(STEPPED) >= 40, len(STEPPED)
    assert any(kw.get("top_k", 0) >= 256 for kw in STEPPED)  # at or above the vocabulary


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", 2**63), ("max_tokens", 2**31), ("seed", 2**63), ("seed", -1),
    ("temperature", 1e-6), ("temperature", 5e-324), ("repetition_penalty", 1e-40),
    ("stop_token_ids", [2**31]), ("logprobs", 21), ("presence_penalty", math.nan),
])
def test_values_beyond_their_dtype_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_top_k_at_the_int32_limit_is_valid_and_keeps_every_token(engine):
    """A top_k above the vocabulary truncates nothing: it samples as top_k off does."""
    V = engine.model_config.vocab_size
    outs = {}
    for k in (INT32_MAX, -1, V):
        rid = engine.add_request({"prompt_token_ids": [5, 6, 7]},
                                 SamplingParams(max_tokens=4, temperature=1.0, top_k=k, seed=3))
        while engine.has_unfinished():
            engine.step()
        outs[k] = engine.pop_finished(rid).outputs[0].token_ids
    assert outs[INT32_MAX] == outs[-1] == outs[V]


def test_generate_refuses_a_top_k_beyond_int32_in_one_line(capsys):
    """`jaxserve generate --top-k 2147483648` printed a traceback from the sampler and exited 1;
    it is refused before the model loads."""
    from jaxserve.cli import main
    assert main(["generate", "--prompt", "x", "--top-k", "2147483648"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxserve: error: top_k:"), err
