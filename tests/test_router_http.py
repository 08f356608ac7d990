"""The router's OpenAI HTTP door (jaxserve/disagg/router_http.py): the same HTTP calls to a
router over a --role prefill and a --role decode server and to a colocated server of the same
engine shape must answer the same (greedy and seeded outputs are exact: test_handover.py says
why), streamed and not, with logprobs, echo, stop reasons, chat's max_tokens-to-context and the
refusals' statuses; a stream cancelled mid-way leaves both engines idle. Plus the GenerateRequest
the door sends: messages.generate_request is spec_from_generate's inverse.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import byte_tokenizer, make_engine
from test_disagg_serving import BackgroundRouter, both_idle, role_server
from test_handover import SHAPE
from test_server_support import wait_until

from jaxserve.server import messages
from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.tokenizer import Tokenizer
from jaxserve.types import SamplingParams, StructuredOutputsParams

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def chat_tokenizer(eos) -> Tokenizer:
    """The byte tokenizer with a chat template (the router renders /tokenize's chats itself and
    counts every prompt's tokens: both must match the backends')."""
    return Tokenizer(byte_tokenizer()._hf, bos_token_id=1, eos_token_ids=eos, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def doors(tiny_model):
    """(router base URL, colocated base URL, prefill server, decode server, router)."""
    model, tok0 = tiny_model
    tok = chat_tokenizer(tok0.eos_token_ids)
    prefill = role_server(model, tok, "prefill")
    decode = role_server(model, tok, "decode")
    colocated = BackgroundServer(make_engine(model, tok, **SHAPE),
                                 ServerConfig(port=0, http_port=0, progress=False)).start()
    try:
        with BackgroundRouter([prefill.address], [decode.address], tokenizer=tok, http_port=0) as router:
            url = f"http://127.0.0.1:{router.router.http_port}"
            wait_until(lambda: httpx.get(url + "/health").status_code == 200, 30, "the router's HTTP door")
            yield url, f"http://127.0.0.1:{colocated.server.http_port}", prefill, decode, router
    finally:
        for s in (prefill, decode, colocated):
            s.stop()


MODEL = "unknown"  # BackgroundServer's default ModelDescription, on all three servers


def post(url: str, path: str, body: dict) -> httpx.Response:
    if path.startswith("/v1/"):
        body = {"model": MODEL, **body}
    return httpx.post(url + path, json=body, timeout=60)


def same_json(doors, path: str, body: dict) -> dict:
    """The JSON both doors answer, ids and clocks aside; asserted equal."""
    router_url, colocated_url, prefill, decode, _ = doors
    got, want = (post(u, path, body) for u in (router_url, colocated_url))
    assert (got.status_code, want.status_code) == (200, 200), (got.text, want.text)
    g, w = got.json(), want.json()
    for d in (g, w):
        d.pop("id"), d.pop("created")
    assert g == w
    both_idle(prefill, decode)
    return g


def test_completions_with_logprobs_and_n_equal_colocated(doors):
    out = same_json(doors, "/v1/completions", dict(prompt="The tiny model says", max_tokens=7, temperature=0,
                                                   logprobs=2, ignore_eos=True))
    assert len(out["choices"][0]["logprobs"]["tokens"]) == 7
    out = same_json(doors, "/v1/completions", dict(prompt=[5, 6, 7, 8, 9, 10], max_tokens=6, n=2, seed=11,
                                                   temperature=1.0, ignore_eos=True))
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 12


def test_a_stop_string_and_its_stop_reason_equal_colocated(doors):
    """The stop string is taken from the greedy output itself, so it is sure to be met: the
    router must report the text cut before it and vLLM's stop_reason, as colocated does."""
    _, colocated_url, *_ = doors
    body = dict(prompt="Where to stop", max_tokens=12, temperature=0, ignore_eos=True)
    text = post(colocated_url, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[4:6]
    assert len(stop) == 2
    out = same_json(doors, "/v1/completions", {**body, "stop": [stop]})
    c = out["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop)
    assert stop not in c["text"]


def test_echo_with_prompt_logprobs_equals_colocated(doors):
    out = same_json(doors, "/v1/completions", dict(prompt="echo me", max_tokens=3, temperature=0, echo=True,
                                                   logprobs=1, ignore_eos=True))
    lps = out["choices"][0]["logprobs"]
    assert lps["token_logprobs"][0] is None and len(lps["tokens"]) == len("echo me") + 3
    assert all(v is not None for v in lps["token_logprobs"][1:])
    same_json(doors, "/v1/completions", dict(prompt=[9, 8, 7, 6], max_tokens=2, temperature=0, echo=True,
                                             prompt_logprobs=2, ignore_eos=True))


def test_chat_fills_the_context_without_max_tokens_as_colocated(doors):
    """No max_tokens: the output runs to what the context leaves after the rendered prompt
    (max_model_len 256), which the prefill server decides (GenerateRequest.max_tokens_to_context)."""
    content = "x" * 230
    out = same_json(doors, "/v1/chat/completions", dict(messages=[{"role": "user", "content": content}],
                                                        temperature=0, ignore_eos=True, logprobs=True,
                                                        top_logprobs=1))
    # The room left (under the 16 a GenerateRequest defaults to, which this prompt could not fit),
    # used to the end.
    assert 1 < out["usage"]["completion_tokens"] < 16 and out["choices"][0]["finish_reason"] == "length"


def sse(resp: httpx.Response) -> list[dict]:
    events = [e[len("data: "):] for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_stream_joins_to_the_colocated_stream(doors):
    router_url, colocated_url, prefill, decode, _ = doors
    body = dict(prompt="stream this", max_tokens=9, n=2, seed=5, temperature=0.9, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, logprobs=0)
    joined = []
    for url in (router_url, colocated_url):
        chunks = sse(post(url, "/v1/completions", body))
        out = {}
        for ch in chunks[:-1]:
            for c in ch["choices"]:
                o = out.setdefault(c["index"], {"text": "", "tokens": [], "finish": None})
                o["text"] += c["text"]
                o["tokens"] += c["logprobs"]["tokens"] if c["logprobs"] else []
                o["finish"] = c["finish_reason"] or o["finish"]
        joined.append((out, chunks[-1]["usage"]))
    assert joined[0] == joined[1]
    assert joined[0][1]["completion_tokens"] == 18
    both_idle(prefill, decode)


def test_refusals_have_the_colocated_status_and_field(doors):
    router_url, colocated_url, prefill, decode, _ = doors
    for body in (dict(prompt="y" * 300, max_tokens=4),  # over max_model_len 256: the prefill server's check
                 dict(prompt="ok", max_tokens=4, logit_bias={"999": 1}),  # outside the vocabulary
                 dict(prompt="ok", max_tokens=4, stream=True, top_k=-7)):  # a stream refused before its body
        got, want = (post(u, "/v1/completions", body) for u in (router_url, colocated_url))
        assert got.status_code == want.status_code == 400, (got.text, want.text)
        assert got.json()["error"]["param"] == want.json()["error"]["param"]
    both_idle(prefill, decode)


def test_tokenize_detokenize_and_models_equal_colocated(doors):
    router_url, colocated_url, *_ = doors
    for path, body in (("/tokenize", {"prompt": "abc"}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/detokenize", {"tokens": [104, 105]})):
        assert post(router_url, path, body).json() == post(colocated_url, path, body).json()
    models = [httpx.get(u + "/v1/models").json()["data"][0] for u in (router_url, colocated_url)]
    for m in models:
        m.pop("created")
    assert models[0] == models[1]


def test_a_stream_closed_midway_frees_pages_on_both_sides(doors):
    router_url, _, prefill, decode, router = doors
    body = dict(model=MODEL, prompt="a long one", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    with httpx.stream("POST", router_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in: past the handover
        assert any(line.startswith("data: {") for line in got)
    both_idle(prefill, decode)
    wait_until(lambda: router.router.inflight == 0, 10, "the router's call to end")


def test_before_any_backend_serves_the_door_is_warming_up(tiny_model):
    with BackgroundRouter(["localhost:1"], ["localhost:2"], wait=False, tokenizer=byte_tokenizer(),
                          http_port=0) as router:
        url = f"http://127.0.0.1:{router.router.http_port}"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "warming_up"
        assert health.headers["retry-after"] == "1"
        assert post(url, "/v1/completions", {"prompt": "hi"}).status_code == 503
        assert httpx.get(url + "/live").status_code == 200


def test_generate_request_is_spec_from_generates_inverse():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=-0.3, seed=4, stop=("a", "bc"),
                            stop_token_ids=(3,), n=2, logprobs=3, skip_special_tokens=False,
                            min_tokens=2, logit_bias={5: 1.5}, prompt_logprobs=1,
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    for prompt in (dict(text="hello"), dict(token_ids=[1, 2, 3]),
                   dict(messages=[{"role": "user", "content": "hi"}])):
        spec = messages.RequestSpec(params, request_id="r1", priority=3, client_cache_salt="s", **prompt)
        back = messages.spec_from_generate(messages.generate_request(spec))
        assert back == spec
    filled = messages.RequestSpec(params, text="x", max_tokens_to_context=True)
    back = messages.spec_from_generate(messages.generate_request(filled))
    assert back.max_tokens_to_context and back.params.max_tokens == params.min_tokens  # until tokenized
    with pytest.raises(messages.InvalidRequestError, match="max_tokens_to_context"):
        req = messages.generate_request(filled)
        req.max_tokens = 5
        messages.spec_from_generate(req)
    with pytest.raises(messages.InvalidRequestError, match="add_bos"):
        messages.generate_request(messages.RequestSpec(params, text="x", add_bos=False))
