"""The OpenAI-compatible HTTP API against a real loopback server, through the official `openai`
client (sync and async, streaming and not) and raw HTTP where the wire format itself is the
claim. Outputs are computed by hand (fake model) or by the same engine run offline."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from jaxserve.server.fake_engine import fake_generate, fake_tokenizer
from jaxserve.types import SamplingParams
from test_server_support import MODEL, base_url, http_server, offline, wait_idle

TOK = fake_tokenizer()


@pytest.fixture(scope="module")
def server():
    with http_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0)


def sse_events(resp: httpx.Response) -> list:
    """A finished SSE body as OpenAI sends it: `data: {json}` events separated by blank lines,
    the last one `data: [DONE]`."""
    body = resp.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


# ---- results -----------------------------------------------------------------------------------

def test_completion_matches_the_model_computed_by_hand(client, server):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, seed=5)
    ids, reason = fake_generate(TOK.encode("Hello"), 20, seed=5)
    assert r.choices[0].text == bytes(ids).decode() and r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 20, 25)
    assert r.model == MODEL and r.object == "text_completion"
    # Streamed, the same text arrives in pieces; include_usage adds one last chunk, choices empty.
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, seed=5,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == bytes(ids).decode()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    wait_idle(server)


def test_wire_format_of_a_stream(server):
    """Raw SSE: every event a `data:` line, [DONE] last; without include_usage no usage key."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True}
    r = httpx.post(base_url(server) + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"][0]["delta"] == {} and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e and e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1


def test_batch_of_prompts_n_samples_stop_and_logprobs_equal_the_engine_offline(client):
    params = SamplingParams(max_tokens=12, n=3, seed=9, temperature=1.0)
    r = client.completions.create(model=MODEL, prompt=[[72, 105], [72, 105, 33]], max_tokens=12, n=3,
                                  seed=9, temperature=1.0)
    refs = [offline({"prompt_token_ids": [72, 105]}, params), offline({"prompt_token_ids": [72, 105, 33]}, params)]
    assert [c.index for c in r.choices] == list(range(6))
    for p, ref in enumerate(refs):
        for c in ref.outputs:
            assert r.choices[p * 3 + c.index].text == c.text
    assert len({c.text for c in r.choices[:3]}) == 3  # seeded samples differ
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == sum(
        len(c.token_ids) for ref in refs for c in ref.outputs)

    ref = offline("Hi", SamplingParams(max_tokens=30, stop=("a", "b", "c"), temperature=1.0))
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=30, stop=["a", "b", "c"])
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason

    ref = offline("Hi", SamplingParams(max_tokens=6, logprobs=3, temperature=1.0))
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [TOK.decode([t], skip_special_tokens=False) for t in ref.outputs[0].token_ids]
    assert lp.token_logprobs == [x.logprob for x in ref.outputs[0].logprobs]
    assert [len(t) for t in lp.top_logprobs] == [3] * len(ref.outputs[0].token_ids)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_sync_and_async_streaming_and_not(client, server):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hé 🎉"}]
    ref = offline(msgs, SamplingParams(max_tokens=10, temperature=1.0, logprobs=2))
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, logprobs=True,
                                       top_logprobs=2)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert [t.logprob for t in r.choices[0].logprobs.content] == [x.logprob for x in ref.outputs[0].logprobs]
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)

    async def run():
        ac = openai.AsyncOpenAI(base_url=base_url(server) + "/v1", api_key="unused", max_retries=0)
        one = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10)
        text, usage = "", None
        async for ch in await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                                         stream=True,
                                                         stream_options={"include_usage": True}):
            text += "".join(c.delta.content or "" for c in ch.choices)
            usage = ch.usage or usage
        await ac.close()
        return one, text, usage
    one, text, usage = asyncio.run(run())
    assert one.choices[0].message.content == text == ref.outputs[0].text
    assert usage.completion_tokens == len(ref.outputs[0].token_ids) == one.usage.completion_tokens


def test_chat_without_max_tokens_runs_to_eos_or_the_context(client):
    # OpenAI's default: no max_tokens means up to the context (256 here), not 16.
    msgs = [{"role": "user", "content": "x"}]
    prompt = TOK.encode(TOK.apply_chat_template(msgs, add_generation_prompt=True))
    ids, reason = fake_generate(prompt, 256 - len(prompt))
    r = client.chat.completions.create(model=MODEL, messages=msgs)
    assert r.usage.completion_tokens == len(ids) and r.choices[0].finish_reason == reason


def test_models_tokenize_detokenize_health(server):
    b = base_url(server)
    models = httpx.get(b + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    t = httpx.post(b + "/tokenize", json={"prompt": "héllo"}).json()
    assert t["tokens"] == list("héllo".encode()) and t["count"] == 6
    assert httpx.post(b + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    chat = httpx.post(b + "/tokenize", json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert bytes(chat["tokens"]).decode() == "<user>a\n<assistant>"
    for path in ("/health", "/ready", "/live"):
        assert httpx.get(b + path).status_code == 200, path
    assert "jaxserve_num_requests_running" in httpx.get(b + "/metrics").text


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    ({"prompt": "x", "n": 65}, 400, "n"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, 999]]}, 400, "prompt_token_ids"),
    ({"prompt": "x", "stop": 7}, 400, "stop"),
    ({"prompt": "x", "logit_bias": {"5": 101.0}}, 400, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, 400, "stream_options.include_usage"),
    ({"prompt": "x", "model": 5}, 400, "model"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_errors_are_openai_shaped_and_name_the_field(server, body, status, param):
    r = httpx.post(base_url(server) + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    # The official client raises the matching exception class.
    cls = {400: openai.BadRequestError, 404: openai.NotFoundError}[status]
    with pytest.raises(cls):
        openai.OpenAI(base_url=base_url(server) + "/v1", api_key="x", max_retries=0).completions.create(
            **{"model": MODEL, "prompt": "x", **body})


def test_bad_bodies_and_chat_fields(server):
    b = base_url(server)
    r = httpx.post(b + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(b + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(b + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    r = httpx.post(b + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert httpx.get(b + "/v1/nothing").status_code == 404


# ---- fuzz: bodies drawn from the OpenAPI schema the server publishes ---------------------------

def _strategy(schema: dict, comps: dict, name: str = ""):
    """A Hypothesis strategy for the subset of JSON Schema FastAPI publishes, biased to the
    edges: numbers around the ranges SamplingParams checks, small and huge integers."""
    from hypothesis import strategies as st
    if "$ref" in schema:
        return st.deferred(lambda: _strategy(comps[schema["$ref"].rsplit("/", 1)[1]], comps, name))
    if "anyOf" in schema and "type" not in schema:  # beside a type: rules on its values, not members
        return st.one_of([_strategy(s, comps, name) for s in schema["anyOf"]])
    if name == "model":  # the schema's enum is the served model; a 404 for another
        return st.sampled_from([MODEL, MODEL, "other"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    t = schema.get("type")
    if t == "string":
        return st.text(max_size=12)
    if t == "integer":
        return st.one_of(st.integers(-2, 40), st.integers(-2**70, 2**70))
    if t == "number":
        # Finite only: JSON has no NaN or Infinity, and httpx refuses to encode them.
        return st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.integers(-3, 3))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        return st.lists(_strategy(schema.get("items", {}), comps, name),
                        min_size=schema.get("minItems", 0), max_size=4)
    if t == "object" and "properties" in schema:
        props = schema["properties"]
        req = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: _strategy(v, comps, k) for k, v in props.items() if k in req},
                                     optional={k: _strategy(v, comps, k) for k, v in props.items()
                                               if k not in req})
    if t == "object":
        return st.dictionaries(st.text(max_size=4), st.one_of(st.none(), st.integers(), st.text(max_size=4)),
                               max_size=3)
    return st.one_of(st.none(), st.integers(), st.text(max_size=4))


def test_fuzz_both_endpoints_never_5xx_and_the_server_stays_ready(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    b = base_url(server)
    comps = httpx.get(b + "/openapi.json").json()["components"]["schemas"]
    routes = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
    body = st.one_of([st.tuples(st.just(p), _strategy(comps[n], comps)) for p, n in routes.items()])
    client = httpx.Client(base_url=b, timeout=30)

    statuses = []

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body)
    def one(case):
        path, data = case
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(data.get(k), int) and data[k] > 16:
                data[k] = 16  # keep each call short; the huge ones are tested above
        if path.endswith("chat/completions") and data.get("max_tokens") is None:
            data["max_tokens"] = 8  # not "up to the context" (tested above), 250 tokens a call
        r = client.post(path, json=data)
        statuses.append(r.status_code)
        assert r.status_code < 500, (path, data, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        elif data.get("stream"):
            assert r.text.endswith("data: [DONE]\n\n")
    one()
    # Both outcomes were exercised: some bodies generated text, some were refused.
    assert 200 in statuses and 400 in statuses, statuses
    assert httpx.get(b + "/ready").status_code == 200
    wait_idle(server)


def test_tls_and_mutual_tls_take_the_grpc_flags(tmp_path):
    import ssl

    from test_server_support import make_certs
    c = make_certs(tmp_path)
    cfg = {"tls_cert": str(c["server.pem"]), "tls_key": str(c["server.key"]),
           "tls_client_ca": str(c["ca.pem"])}
    with http_server(server=cfg) as s:
        url = f"https://localhost:{s.server.http_port}/v1/models"
        ctx = ssl.create_default_context(cafile=str(c["ca.pem"]))
        ctx.load_cert_chain(str(c["client.pem"]), str(c["client.key"]))
        assert httpx.get(url, verify=ctx).json()["data"][0]["id"] == MODEL
        no_cert = ssl.create_default_context(cafile=str(c["ca.pem"]))
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(url, verify=no_cert)
        with pytest.raises(httpx.ConnectError):  # the system roots do not trust the test CA
            httpx.get(url, verify=True)


# ---- structured outputs over HTTP (the fake model picks among the grammar's allowed tokens) ----

def test_structured_outputs_over_http(client, server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "c": {"enum": ["red", "blue"]}},
              "required": ["n", "c"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    import jsonschema
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="pick", max_tokens=20, n=3, seed=1,
                                  extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert all(c.text in ("alpha", "beta", "gamma") for c in r.choices)
    r = client.completions.create(model=MODEL, prompt="id", max_tokens=20,
                                  extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "obj"}], max_tokens=60, stream=True,
        response_format={"type": "json_object"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("{")
    for body, param in (({"guided_regex": "(bad"}, "guided_regex"),
                        ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
                        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema")):
        rr = httpx.post(base_url(server) + "/v1/completions", json={"model": MODEL, "prompt": "x", **body})
        assert rr.status_code == 400 and rr.json()["error"]["param"] == param, rr.text
    wait_idle(server)


def test_structured_outputs_over_grpc(server):
    import grpc

    from jaxserve.server.proto import generation_pb2 as pb
    from test_server_support import code_and_field, gen_stub
    stub = gen_stub(server)
    r = stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=20, structured_outputs=pb.StructuredOutputs(
        choice=pb.ChoiceList(choices=["left", "right"]))))
    assert r.completions[0].text in ("left", "right")
    r = stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=20, structured_outputs=pb.StructuredOutputs(
        regex="[0-9]{4}")))
    assert re.fullmatch("[0-9]{4}", r.completions[0].text)
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateUnary(pb.GenerateRequest(prompt="x", structured_outputs=pb.StructuredOutputs(regex="(")))
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "structured_outputs.regex")


def test_http_callers_are_tenants_of_the_prefix_cache(server):
    """The HTTP door salts by the caller's Authorization header as gRPC does: a second caller
    with the same prompt never hits the first one's cached pages; the first caller does."""
    prompt = "A long shared prompt only this test sends, to be cached page by page. " * 2

    def hits_after(api_key: str) -> int:
        c = openai.OpenAI(base_url=base_url(server) + "/v1", api_key=api_key, max_retries=0)
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        wait_idle(server)
        return server.server.engine.prefix_cache_stats()["hits"]

    start = hits_after("tenant-a")
    assert hits_after("tenant-b") == start  # another tenant: no hit
    assert hits_after("tenant-a") > start  # its own pages: a hit
