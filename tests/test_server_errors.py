"""Every bad input of docs reliability.md is answered INVALID_ARGUMENT naming the field, nothing
is allocated for it, and the next request succeeds; random requests (Hypothesis) and random bytes
never get INTERNAL or UNKNOWN.

The fake engine's context is 256 tokens and its vocabulary 257 ids. Rules where the anchors
disagree (types.py): temperature 0 is greedy, top_p 1.0 is valid, max_tokens must be >= 1.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxserve.server.decoding import _twin_class
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import (channel, check_stream, code_and_field, fake_server, find_request_id,
                                 gen_stub, wait_idle)

CTX = 256
V = 257


def ids(n):
    return pb.TokenIds(ids=[65 + i % 26 for i in range(n)])


def chat(*pairs):
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in pairs])


BAD = [
    (dict(), "prompt"),  # no prompt at all
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=ids(0)), "prompt_token_ids"),
    (dict(messages=chat()), "messages"),
    (dict(messages=chat(("", "hi"))), "messages[0].role"),
    (dict(prompt_token_ids=ids(CTX), max_tokens=1), "max_tokens"),  # context: no room to generate
    (dict(prompt_token_ids=ids(CTX + 1), max_tokens=1), "prompt_token_ids"),
    (dict(prompt_token_ids=ids(200), max_tokens=100), "max_tokens"),  # prompt + max_tokens > context
    (dict(prompt="x" * CTX, max_tokens=1), "max_tokens"),  # the same after tokenizing text
    (dict(prompt="x" * (CTX + 1), max_tokens=1), "prompt"),
    (dict(prompt="x" * (10 * 2**20)), "prompt"),  # 10 MB, refused before tokenizing
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", max_tokens=-1), "max_tokens"),
    (dict(prompt="a", max_tokens=2**31), "max_tokens"),
    (dict(prompt="a", temperature=-0.1), "temperature"),
    (dict(prompt="a", temperature=math.nan), "temperature"),
    (dict(prompt="a", temperature=math.inf), "temperature"),
    (dict(prompt="a", top_p=0.0), "top_p"),
    (dict(prompt="a", top_p=1.0001), "top_p"),
    (dict(prompt="a", top_p=math.nan), "top_p"),
    (dict(prompt="a", top_k=-2), "top_k"),
    (dict(prompt="a", min_p=1.5), "min_p"),
    (dict(prompt="a", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="a", presence_penalty=2.5), "presence_penalty"),
    (dict(prompt="a", frequency_penalty=-3.0), "frequency_penalty"),
    (dict(prompt="a", seed=-1), "seed"),
    (dict(prompt_token_ids=pb.TokenIds(ids=[65, -1])), "prompt_token_ids"),
    (dict(prompt_token_ids=pb.TokenIds(ids=[65, V])), "prompt_token_ids"),
    (dict(prompt_token_ids=pb.TokenIds(ids=[65, 2**31])), "prompt_token_ids"),
    (dict(prompt="a", stop_token_ids=[V]), "stop_token_ids"),
    (dict(prompt="a", stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt="a", n=0), "n"),
    (dict(prompt="a", n=10**6), "n"),
    (dict(prompt="a", stop=["s"] * 10**5), "stop"),
    (dict(prompt="a", stop=[""]), "stop"),
    (dict(prompt="a", stop=["x" * 1000]), "stop"),
    (dict(prompt="a", logprobs=21), "logprobs"),
    (dict(prompt="a", logprobs=-1), "logprobs"),
    (dict(prompt="a", request_id="x" * 300), "request_id"),
]

GOOD_EDGES = [  # the valid side of each boundary
    dict(prompt_token_ids=ids(CTX - 1), max_tokens=1),
    dict(prompt="a", top_p=1.0, temperature=0.0, top_k=0, max_tokens=2),
    dict(prompt="a", top_k=-1, logprobs=20, n=64, max_tokens=2, stop=["s"] * 64),
    dict(prompt="a", max_tokens=CTX - 1, ignore_eos=True),
]


@pytest.fixture(scope="module")
def server():
    with fake_server(num_pages=1024) as s:
        yield s


def _good(stub):
    msgs = list(stub.Generate(pb.GenerateRequest(prompt="next", max_tokens=3), timeout=10))
    check_stream(msgs)


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(server, kwargs, field):
    stub = gen_stub(server)
    eng = server.server.engine
    for rpc in (lambda r: list(stub.Generate(r, timeout=10)), lambda r: stub.GenerateUnary(r, timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            rpc(pb.GenerateRequest(**kwargs))
        code, got_field = code_and_field(e.value)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert got_field == field and e.value.details().startswith(field + ":"), e.value.details()
        # Nothing was allocated or queued for it.
        assert not eng.has_unfinished() and server.server.limiter.queued_samples == 0
        assert eng.scheduler.num_free_pages == eng.scheduler.num_total_pages - 1
        _good(stub)
    wait_idle(server)


def test_valid_edges_succeed(server):
    stub = gen_stub(server)
    for kwargs in GOOD_EDGES:
        req = pb.GenerateRequest(**kwargs)
        check_stream(list(stub.Generate(req, timeout=30)), req.n if req.HasField("n") else 1)
    wait_idle(server)


def _raw_call(server, data: bytes, method="/jaxserve.v1.Generation/GenerateUnary"):
    fn = channel(server).unary_unary(method, request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
    return fn(data, timeout=10)


def test_invalid_utf8_names_the_field(server):
    twin = _twin_class("jaxserve.v1.GenerateRequest", pb.GenerateRequest.DESCRIPTOR.file)
    cases = [(twin(prompt=b"ok \xff"), "prompt"), (twin(prompt=b"a", stop=[b"x", b"\xc3("]), "stop[1]"),
             (twin(request_id=b"\x80", prompt=b"a"), "request_id")]
    m = twin()
    m.messages.messages.add(role=b"user", content=b"\xed\xa0\x80")  # a UTF-16 surrogate, invalid
    cases.append((m, "messages.messages[0].content"))
    for msg, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(server, msg.SerializeToString())
        assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, field), e.value.details()
        assert "UTF-8" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server, b"\xff\xff\xff")
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "request")
    _good(gen_stub(server))


def test_duplicate_in_flight_request_id_is_refused_then_reusable(server):
    stub = gen_stub(server)
    el = server.server.engine_loop
    el.pause()
    try:
        first = stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=2, request_id="dup"))
        find_request_id(server, "dup")
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(pb.GenerateRequest(prompt="a", max_tokens=2, request_id="dup"), timeout=10)
        assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id")
    finally:
        el.resume()
    check_stream(list(first))
    check_stream(list(stub.Generate(pb.GenerateRequest(prompt="a", max_tokens=2, request_id="dup"))))


# ---- fuzzing ---------------------------------------------------------------------------------

_ints = st.one_of(st.integers(-3, 300), st.sampled_from([-2**63, -2**31, 2**31 - 1, 2**31, 2**63 - 1]))
_floats = st.one_of(st.floats(-5, 5), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1.0, 1e300]))
_text = st.text(max_size=40)


@st.composite
def generate_requests(draw):
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(_text)
    elif kind == "ids":
        req.prompt_token_ids.ids.extend(draw(st.lists(_ints, max_size=40)))
    elif kind == "messages":
        for role, content in draw(st.lists(st.tuples(_text, _text), max_size=3)):
            req.messages.messages.add(role=role, content=content)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if draw(st.booleans()):
            setattr(req, name, draw(_floats))
    for name in ("top_k", "seed", "logprobs"):
        if draw(st.booleans()):
            setattr(req, name, draw(_ints))
    if draw(st.booleans()):
        req.max_tokens = draw(st.one_of(st.integers(-2, 40), _ints))
    if draw(st.booleans()):
        req.n = draw(st.one_of(st.integers(-1, 4), _ints))
    req.stop.extend(draw(st.lists(_text, max_size=3)))
    req.stop_token_ids.extend(draw(st.lists(_ints, max_size=3)))
    req.ignore_eos = draw(st.booleans())
    req.priority = draw(st.integers(-2**31, 2**31 - 1))
    req.request_id = draw(st.text(max_size=8))
    if draw(st.booleans()):
        req.skip_special_tokens = draw(st.booleans())
    return req


_FUZZ_BUDGET_S = 20.0
_fuzz_started: list[float] = []


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(req=generate_requests())
def test_fuzz_generate_request_never_internal(server, req):
    # A bounded time, whatever max_examples allows.
    _fuzz_started or _fuzz_started.append(time.monotonic())
    if time.monotonic() - _fuzz_started[0] > _FUZZ_BUDGET_S:
        return
    stub = gen_stub(server)
    try:
        msgs = list(stub.Generate(req, timeout=20))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
        assert code_and_field(e)[1], e.details()  # the field is always named
        return
    check_stream(msgs, req.n if req.HasField("n") else 1)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.binary(max_size=64))
def test_fuzz_raw_bytes_never_internal(server, data):
    for method in ("/jaxserve.v1.Generation/GenerateUnary", "/jetstream_proto.Orchestrator/HealthCheck",
                   "/jaxserve.v1.Generation/Tokenize", "/jaxserve.v1.Generation/Detokenize"):
        try:
            _raw_call(server, data, method)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.code(), e.details())


def test_fuzzing_left_nothing_behind(server):
    wait_idle(server)
    assert server.server.engine.compiles_after_warmup == 0
