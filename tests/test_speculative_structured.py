"""Structured outputs speculate with n-gram drafts: each draft slot is masked with the grammar's
state after the drafts before it (engine/grammar.py draft_masks), so a draft the grammar refuses
is refused, and the correction or bonus token obeys the grammar. Greedy outputs equal those
without speculation; sampled ones stay inside the grammar."""

import re

from conftest import drain, make_engine

from jaxserve.types import SamplingParams, StructuredOutputsParams

REGEX = "[ab]{6}c[ab]{6}c[ab]{6}"  # repeats, so n-gram lookup finds drafts; the c's force the grammar's hand
PROMPT = "abcabcabc ab ba c"


def _text(tok, out):
    """The output's text without the EOS that ends it (the test tokenizer does not mark it special)."""
    ids = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] in tok.eos_token_ids else out.token_ids
    return tok.decode(ids)


def _run(model, tok, k, params):
    eng = make_engine(model, tok, tok.eos_token_ids, token_buckets=(32,), num_speculative_tokens=k)
    for i, p in enumerate(params):
        eng.add_request({"prompt_token_ids": tok.encode(PROMPT)}, p, request_id=str(i))
    drain(eng)
    return [eng.pop_finished(str(i)).outputs[0] for i in range(len(params))], eng.stats


def test_greedy_structured_outputs_with_drafts_equal_those_without(tiny_model):
    model, tok = tiny_model
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    plain, _ = _run(model, tok, 0, params)
    spec, st = _run(model, tok, 4, params)
    assert st["draft_tokens"] > 0 and st["accepted_draft_tokens"] > 0, st
    assert spec[0].token_ids == plain[0].token_ids
    assert re.fullmatch(REGEX, _text(tok, spec[0])), spec[0].text


def test_sampled_structured_outputs_with_drafts_stay_in_the_grammar(tiny_model):
    model, tok = tiny_model
    params = [SamplingParams(temperature=1.5, seed=i, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=REGEX)) for i in range(16)]
    outs, st = _run(model, tok, 4, params)
    assert st["draft_tokens"] > 0 and 0 < st["accepted_draft_tokens"] < st["draft_tokens"], st
    for o in outs:
        assert re.fullmatch(REGEX, _text(tok, o)), o.text
