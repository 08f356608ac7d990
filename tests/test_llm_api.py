"""vLLM's offline API extras on the fake model (no compilation): LLM.chat, LLM.get_tokenizer,
CompletionOutput.stop_reason and cumulative_logprob, and stop_reason over HTTP."""

from __future__ import annotations

import httpx

from jaxserve.engine.llm import LLM
from jaxserve.server.fake_engine import EOS_ID, fake_generate, fake_tokenizer, make_fake_engine
from jaxserve.types import SamplingParams
from test_openai_api import base_url, http_server

TOK = fake_tokenizer()


def fake_llm() -> LLM:
    """LLM's own generate / chat code over the fake engine (LLM() itself would load weights)."""
    llm = LLM.__new__(LLM)
    llm.engine = make_fake_engine()
    llm.tokenizer = llm.engine.tokenizer
    return llm


def test_stop_reason_and_cumulative_logprob():
    llm = fake_llm()
    ids, _ = fake_generate(TOK.encode("Hi"), 40, ignore_eos=True)
    text = bytes(t for t in ids if t != EOS_ID).decode()
    # A stop string from the middle of the known output, a stop token id, and plain length.
    stop_str = text[5:7]
    stop_tok = next(t for t in ids[3:] if t != EOS_ID)
    outs = llm.generate(["Hi"] * 3, [SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop_str,)),
                                     SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_tok,)),
                                     SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)],
                        use_tqdm=False)
    a, b, c = (o.outputs[0] for o in outs)
    assert a.finish_reason == "stop" and a.stop_reason == stop_str and a.text == text[:text.index(stop_str)]
    assert b.finish_reason == "stop" and b.stop_reason == stop_tok and b.token_ids[-1] == stop_tok
    assert c.finish_reason == "length" and c.stop_reason is None
    assert c.cumulative_logprob == sum(lp.logprob for lp in c.logprobs) and a.cumulative_logprob is None


def test_chat_and_get_tokenizer():
    llm = fake_llm()
    conv = [{"role": "user", "content": "hello"}]
    one = llm.chat(conv, SamplingParams(max_tokens=6), use_tqdm=False)
    two = llm.chat([conv, [{"role": "user", "content": "bye"}]], SamplingParams(max_tokens=6), use_tqdm=False)
    prompt = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True)
    ref = llm.generate(prompt, SamplingParams(max_tokens=6), use_tqdm=False)
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert len(two) == 2 and llm.get_tokenizer() is llm.tokenizer


def test_stop_reason_over_http():
    with http_server() as s:
        ids, _ = fake_generate(TOK.encode("Hi"), 40, ignore_eos=True)
        stop = bytes(ids[5:7]).decode()
        r = httpx.post(base_url(s) + "/v1/completions",
                       json={"model": "fake", "prompt": "Hi", "max_tokens": 40, "ignore_eos": True,
                             "stop": [stop]}).json()
        assert r["choices"][0]["stop_reason"] == stop and r["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_masks_eos_until_then():
    llm = fake_llm()
    # A prompt whose fake continuation hits EOS within 3 tokens, found by hand.
    prompt = next(p for p in (f"q{i}" for i in range(2000)) if len(fake_generate(TOK.encode(p), 40)[0]) <= 3)
    assert fake_generate(TOK.encode(prompt), 40)[1] == "stop"
    plain, held = llm.generate([prompt, prompt], [SamplingParams(max_tokens=40),
                                                  SamplingParams(max_tokens=40, min_tokens=10)],
                               use_tqdm=False)
    assert len(plain.outputs[0].token_ids) <= 3
    got = held.outputs[0].token_ids
    assert len(got) >= 10 and EOS_ID not in got[:10]
    with __import__("pytest").raises(ValueError):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_min_tokens_over_http():
    with http_server() as s:
        prompt = next(p for p in (f"q{i}" for i in range(2000)) if len(fake_generate(TOK.encode(p), 40)[0]) <= 3)
        r = httpx.post(base_url(s) + "/v1/completions",
                       json={"model": "fake", "prompt": prompt, "max_tokens": 40, "min_tokens": 12}).json()
        assert r["usage"]["completion_tokens"] >= 12


def test_new_params_survive_lockstep_json_round_trip():
    """engine/lockstep.py sends SamplingParams as json(dataclasses.asdict(...)) to other hosts."""
    import dataclasses
    import json

    from jaxserve.types import StructuredOutputsParams
    p = SamplingParams(max_tokens=5, min_tokens=2, structured_outputs=StructuredOutputsParams(choice=("a", "b")))
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))) == p
