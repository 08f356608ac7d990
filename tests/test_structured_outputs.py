"""Structured outputs on the tiny random model (real sampler, real compiled step): generated JSON
schemas' outputs parse and validate, regex and choice outputs match, the grammar never compiles
anything after warm-up, a constrained row leaves its unconstrained batch mates' greedy tokens
alone, and the on-device bitmask equals llguidance's own numpy masking."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from conftest import byte_tokenizer, make_engine
from json_schemas import control_byte_eos, schemas
from jaxserve.types import InvalidRequestError, SamplingParams
from jaxserve.types import StructuredOutputsParams as SO


@pytest.fixture(scope="module")
def engine(tiny_model):
    model, _ = tiny_model
    eos = (control_byte_eos(),)
    # One token bucket: one compile (the tiny model steps in microseconds, so padding costs nothing).
    return make_engine(model, byte_tokenizer(eos), eos=eos, token_buckets=(32,))


def run(engine, prompts_params):
    ids = [engine.add_request(p, sp) for p, sp in prompts_params]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i).outputs for i in ids]


def text_of(engine, c) -> str:
    """The output without its EOS (the tiny model's byte tokenizer has no special tokens)."""
    ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
    return engine.tokenizer.decode(ids)


def test_generated_json_schemas_parse_and_validate(engine):
    cases = []
    for i, schema in enumerate(schemas(6, seed=1)):
        sop = SO(json=json.dumps(schema))
        # Greedy and sampled, all in one batch (the mask is per row).
        cases += [("Data:", SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=sop)),
                  ("Data:", SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=sop))]
    outs = run(engine, cases)
    for (_, sp), (c,) in zip(cases, outs):
        assert c.finish_reason == "stop", (sp.structured_outputs.json, c.text)
        jsonschema.validate(json.loads(text_of(engine, c)), json.loads(sp.structured_outputs.json))
    assert engine.compiles_after_warmup == 0


def test_regex_choice_and_json_object(engine):
    cases = [("a", SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=r"[a-c]{3}-[0-9]{2,4}"))),
             ("b", SamplingParams(max_tokens=30, temperature=1.0, seed=4, n=3,
                                  structured_outputs=SO(regex=r"(foo|bar){1,3}!"))),
             ("c", SamplingParams(max_tokens=30, temperature=1.0, seed=5, n=4,
                                  structured_outputs=SO(choice=("yes", "no", "maybe so")))),
             ("d", SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(json_object=True)))]
    a, b, c, d = run(engine, cases)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", text_of(engine, a[0]))
    assert all(re.fullmatch(r"(foo|bar){1,3}!", text_of(engine, x)) for x in b)
    assert all(text_of(engine, x) in ("yes", "no", "maybe so") for x in c)
    if d[0].finish_reason == "stop":  # an object can nest past max_tokens; parse it when it ended
        assert isinstance(json.loads(text_of(engine, d[0])), dict)
    assert text_of(engine, d[0]).startswith("{")


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(engine):
    free = SamplingParams(temperature=0.0, max_tokens=12)
    (alone,), = run(engine, [("The quick brown fox", free)])
    mixed = run(engine, [("The quick brown fox", free),
                         ("x", SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(regex="[0-9]+")))])
    assert mixed[0][0].token_ids == alone.token_ids


def test_bad_grammars_name_the_field(engine):
    for sop, field in ((SO(json="{not json"), "structured_outputs.json"),
                       (SO(json='{"type": "frobnicate"}'), "structured_outputs.json"),
                       (SO(regex="(unclosed"), "structured_outputs.regex")):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", SamplingParams(structured_outputs=sop))
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        SO(json="{}", regex="a")
    assert e.value.field == "structured_outputs"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))
    assert e.value.field == "ignore_eos"
    assert not engine.has_unfinished()


def test_device_bitmask_equals_llguidance_numpy_masking():
    import jax.numpy as jnp
    from llguidance.numpy import apply_token_bitmask_inplace

    from jaxserve.model.sampler import apply_token_bitmask
    rng = np.random.default_rng(0)
    B, V = 3, 77  # V not a multiple of 32: the last word's high bits must be ignored
    logits = rng.standard_normal((B, V)).astype(np.float32)
    words = rng.integers(-2**31, 2**31, size=(B, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    ref = logits.copy()
    apply_token_bitmask_inplace(ref, words)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words)))
    assert np.array_equal(np.isinf(ref), got <= -1e30)  # the same tokens masked
    assert np.array_equal(got[~np.isinf(ref)], ref[~np.isinf(ref)])  # the rest untouched, exactly


def test_min_tokens_masks_stop_token_ids_on_device(engine):
    (free,), = run(engine, [("Hello", SamplingParams(temperature=0.0, max_tokens=4))])
    first = free.token_ids[0]
    # Stopping on the greedy first token ends at once; min_tokens=3 masks it for three tokens.
    (stopped,), (held,) = run(engine, [("Hello", SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(first,))),
                                       ("Hello", SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(first,),
                                                                min_tokens=3))])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
