"""vLLM's offline API extras on the fake model (no compilation): LLM.chat, LLM.get_tokenizer,
CompletionOutput.stop_reason and cumulative_logprob, and stop_reason over HTTP."""

from __future__ import annotations

import httpx

from jaxserve.engine.llm import LLM
from jaxserve.server.fake_engine import EOS_ID, fake_generate, fake_tokenizer, make_fake_engine
from jaxserve.types import SamplingParams
from test_server_support import base_url, http_server

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


def test_generate_without_params_samples_as_vllms_does(tiny_model):
    """`llm.generate(prompts)` gets SamplingParams(): temperature 1.0 (vLLM's default), so two
    unseeded requests differ from each other and from greedy, while a seed reproduces a sample.
    A real (tiny, random) model: the fake one ignores temperature. The engine's base seed is
    fixed, so the seeds drawn for unseeded requests, and this test, are the same every run."""
    from conftest import make_engine
    model, tok = tiny_model
    llm = LLM.__new__(LLM)
    # make_engine's default shapes, as test_engine.py's: in the suite they load from the XLA cache.
    llm.engine = make_engine(model, tok, seed=0)
    llm.tokenizer = tok
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def tokens(outs):
        return [o.outputs[0].token_ids for o in outs]

    a, b = tokens(llm.generate([prompt, prompt], use_tqdm=False))
    (greedy,) = tokens(llm.generate(prompt, SamplingParams(temperature=0.0), use_tqdm=False))
    s1, s1_again, s2 = tokens(llm.generate([prompt] * 3, [SamplingParams(seed=1), SamplingParams(seed=1),
                                                          SamplingParams(seed=2)], use_tqdm=False))
    assert a != b and greedy not in (a, b), (a, b, greedy)
    assert s1 == s1_again != s2


def test_vllms_basic_example_runs_unchanged(monkeypatch, capsys):
    """examples/offline_inference_basic.py, vLLM's example with only the import and the model
    line changed, runs as it is: its SamplingParams(temperature=0.8, top_p=0.95) and its
    generate / output fields are this API's. LLM() is swapped for the fake engine's (loading
    SmolLM2 and compiling would be the only cost; what is tested is the API the script uses)."""
    import importlib.util
    from conftest import ROOT
    spec = importlib.util.spec_from_file_location("offline_inference_basic", ROOT / "examples" / "offline_inference_basic.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(example, "LLM", fake_llm)
    example.main()
    out = capsys.readouterr().out
    assert example.sampling_params.temperature == 0.8 and example.sampling_params.top_p == 0.95
    assert out.count("Prompt:    ") == 4 and out.count("Output:    ") == 4
    for p in example.prompts:
        assert f"Prompt:    {p!r}" in out
