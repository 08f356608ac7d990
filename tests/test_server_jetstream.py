"""The JetStream-compatible Orchestrator, checked against JetStream's own wire layout.

LAYOUT below records, field by field, JetStream's jetstream/core/proto/jetstream.proto
(AI-Hypercomputer/JetStream, package jetstream_proto). The client here is built from LAYOUT
alone, in a private descriptor pool, so it shares nothing with jaxserve's .proto: if a field
number or type drifted, its calls would break exactly as a JetStream client's would.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as F

from jaxserve.server.decoding import _twin_class
from jaxserve.server.fake_engine import fake_generate
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.server.proto import jetstream_pb2
from test_server_support import code_and_field, fake_server, gen_stub, wait_idle, wait_until

PKG = "jetstream_proto"
# message -> field -> (number, type, repeated, oneof, message type)
LAYOUT = {
    "DecodeRequest": {
        "max_tokens": (4, F.TYPE_INT32, False, None, None),
        "text_content": (5, F.TYPE_MESSAGE, False, "content", "DecodeRequest.TextContent"),
        "token_content": (6, F.TYPE_MESSAGE, False, "content", "DecodeRequest.TokenContent"),
        "metadata": (7, F.TYPE_MESSAGE, False, "metadata_optional", "DecodeRequest.Metadata"),
        "num_samples": (8, F.TYPE_INT32, False, None, None),
        "lora_adapter_id": (9, F.TYPE_STRING, False, None, None),
        "has_bos": (10, F.TYPE_BOOL, False, None, None),
    },
    "DecodeRequest.TextContent": {"text": (1, F.TYPE_STRING, False, None, None)},
    "DecodeRequest.TokenContent": {"token_ids": (1, F.TYPE_INT32, True, None, None)},
    "DecodeRequest.Metadata": {"start_time": (1, F.TYPE_FLOAT, False, None, None)},
    "DecodeResponse": {
        "initial_content": (2, F.TYPE_MESSAGE, False, "content", "DecodeResponse.InitialContent"),
        "stream_content": (3, F.TYPE_MESSAGE, False, "content", "DecodeResponse.StreamContent"),
    },
    "DecodeResponse.InitialContent": {},
    "DecodeResponse.StreamContent": {
        "samples": (1, F.TYPE_MESSAGE, True, None, "DecodeResponse.StreamContent.Sample")},
    "DecodeResponse.StreamContent.Sample": {
        "text": (1, F.TYPE_STRING, False, None, None),
        "token_ids": (2, F.TYPE_INT32, True, None, None),
    },
    "HealthCheckRequest": {},
    "HealthCheckResponse": {"is_live": (1, F.TYPE_BOOL, False, None, None)},
}
SERVICE = {"Decode": ("DecodeRequest", "DecodeResponse", True),
           "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse", False)}
RESERVED = {"DecodeRequest": {1, 2, 3}, "DecodeResponse": {1}}


def test_our_proto_has_jetstreams_layout():
    file = jetstream_pb2.DESCRIPTOR
    assert file.package == PKG
    for name, fields in LAYOUT.items():
        desc = file.message_types_by_name[name.split(".")[0]]
        for part in name.split(".")[1:]:
            desc = desc.nested_types_by_name[part]
        got = {}
        for f in desc.fields:
            got[f.name] = (f.number, f.type, f.is_repeated,
                           f.containing_oneof.name if f.containing_oneof else None,
                           f.message_type.full_name[len(PKG) + 1:] if f.message_type else None)
        assert got == fields, name
    svc = file.services_by_name["Orchestrator"]
    assert svc.full_name == f"{PKG}.Orchestrator"
    assert {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in svc.methods} == {
        k: (i.split(".")[-1], o.split(".")[-1], s) for k, (i, o, s) in SERVICE.items()}
    for msg, numbers in RESERVED.items():
        proto = descriptor_pb2.DescriptorProto()
        file.message_types_by_name[msg].CopyToProto(proto)
        assert {n for r in proto.reserved_range for n in range(r.start, r.end)} == numbers


def _client_classes() -> dict[str, type]:
    """Message classes built from LAYOUT only, in a pool of their own."""
    fdp = descriptor_pb2.FileDescriptorProto(name="jetstream_layout_client.proto", package=PKG, syntax="proto3")
    protos: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name in LAYOUT:  # parents come before their nested types in LAYOUT
        *parent, leaf = name.split(".")
        container = protos[".".join(parent)].nested_type if parent else fdp.message_type
        protos[name] = container.add(name=leaf)
    for name, fields in LAYOUT.items():
        m = protos[name]
        oneofs: list[str] = []
        for fname, (num, typ, rep, oneof, mtype) in fields.items():
            f = m.field.add(name=fname, number=num, type=typ,
                            label=F.LABEL_REPEATED if rep else F.LABEL_OPTIONAL)
            if mtype:
                f.type_name = f".{PKG}.{mtype}"
            if oneof:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    m.oneof_decl.add(name=oneof)
                f.oneof_index = oneofs.index(oneof)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PKG}.{name}"))
            for name in LAYOUT}


C = _client_classes()


class LayoutClient:
    def __init__(self, address):
        ch = grpc.insecure_channel(address)
        self.decode = ch.unary_stream(f"/{PKG}.Orchestrator/Decode",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=C["DecodeResponse"].FromString)
        self.health = ch.unary_unary(f"/{PKG}.Orchestrator/HealthCheck",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=C["HealthCheckResponse"].FromString)


@pytest.fixture(scope="module")
def server():
    with fake_server(step_delay_s=0.001) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return LayoutClient(server.address)


def _text_request(text, max_tokens, **kw):
    r = C["DecodeRequest"](max_tokens=max_tokens, **kw)
    r.text_content.text = text
    return r


def test_decode_text_streams_what_generate_gives_greedy(client, server):
    resps = list(client.decode(_text_request("JetStream", 24), timeout=10))
    assert resps and all(r.WhichOneof("content") == "stream_content" for r in resps)
    assert all(len(r.stream_content.samples) == 1 for r in resps)
    text = "".join(r.stream_content.samples[0].text for r in resps)
    ids = [t for r in resps for t in r.stream_content.samples[0].token_ids]
    ref = gen_stub(server).GenerateUnary(pb.GenerateRequest(prompt="JetStream", max_tokens=24), timeout=10)
    assert text == ref.completions[0].text and ids == list(ref.completions[0].token_ids)


def test_decode_token_content_answers_token_ids_only(client, server):
    req = C["DecodeRequest"](max_tokens=10)
    req.token_content.token_ids.extend([74, 101, 116])
    req.metadata.start_time = 123.5  # accepted and ignored
    resps = list(client.decode(req, timeout=10))
    assert all(s.text == "" for r in resps for s in r.stream_content.samples)
    ids = [t for r in resps for t in r.stream_content.samples[0].token_ids]
    ref = gen_stub(server).GenerateUnary(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[74, 101, 116]),
                                                            max_tokens=10), timeout=10)
    assert ids == list(ref.completions[0].token_ids)


def test_decode_num_samples(client):
    resps = list(client.decode(_text_request("two", 6, num_samples=2), timeout=10))
    assert all(len(r.stream_content.samples) == 2 for r in resps)
    for i in range(2):  # greedy: both samples are the same text
        assert sum(len(r.stream_content.samples[i].token_ids) for r in resps) == 6


def test_health_check_is_readiness(client):
    assert client.health(C["HealthCheckRequest"](), timeout=5).is_live is True


@pytest.mark.parametrize("make,field", [
    (lambda: _text_request("x", 0), "max_tokens"),
    (lambda: _text_request("x", -5), "max_tokens"),
    (lambda: C["DecodeRequest"](max_tokens=4), "content"),
    (lambda: _text_request("", 4), "text_content.text"),
    (lambda: _text_request("x", 4, num_samples=1000), "num_samples"),
    (lambda: _text_request("x", 300), "max_tokens"),  # beyond the 256-token context
])
def test_decode_errors_name_jetstreams_fields(client, server, make, field):
    with pytest.raises(grpc.RpcError) as e:
        list(client.decode(make(), timeout=10))
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, field), e.value.details()
    assert e.value.details().startswith(field + ":")


def test_decode_bad_token_ids_and_utf8(server, client):
    req = C["DecodeRequest"](max_tokens=4)
    req.token_content.token_ids.extend([5, -1])
    with pytest.raises(grpc.RpcError) as e:
        list(client.decode(req, timeout=10))
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "token_content.token_ids")
    twin = _twin_class(f"{PKG}.DecodeRequest", jetstream_pb2.DESCRIPTOR)
    raw = twin(max_tokens=3)
    raw.text_content.text = b"\xff"
    ch = grpc.insecure_channel(server.address)
    call = ch.unary_stream(f"/{PKG}.Orchestrator/Decode", request_serializer=lambda b: b,
                           response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw.SerializeToString(), timeout=10))
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "text_content.text")


def test_decode_cancel_aborts(server, client):
    # A prompt whose greedy continuation has no EOS for 200 tokens (the fake model, by hand).
    prompt = next(p for p in (f"cancel {i}" for i in range(1000))
                  if fake_generate(list(p.encode()), 200)[1] == "length")
    it = client.decode(_text_request(prompt, 200), timeout=20)
    next(it)
    rids = [r for r, _, _ in server.server.engine_loop.abort_log]
    it.cancel()
    wait_until(lambda: len(server.server.engine_loop.abort_log) > len(rids), 10, "the abort")
    _, asked, done = server.server.engine_loop.abort_log[-1]
    assert done - asked <= 1
    wait_idle(server)
