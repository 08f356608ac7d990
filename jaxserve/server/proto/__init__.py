"""The server's protobuf messages and gRPC client stubs, built at import from the compiled schema
committed beside this module (descriptors.py, made from the .proto files by `make protos`).

Why the schema and not protoc's `*_pb2.py`: generated code is tied to the protobuf and grpcio
versions that made it (it refuses an older runtime at import), while a serialized
FileDescriptorProto is plain data every protobuf runtime reads. So the installed server needs no
grpcio-tools and no protoc, and tests/test_proto_stubs.py fails when the committed schema drifts
from the .proto files. The modules built here have what the generated ones have and the code
uses: message classes, enums and their values, `DESCRIPTOR`, and a `<Service>Stub` per service
(the server registers its handlers from the service descriptors: server/calls.py).

    generation_pb2, generation_grpc   package jaxserve.v1      (generation.proto)
    jetstream_pb2, jetstream_grpc     package jetstream_proto  (jetstream.proto, JetStream's layout)

The descriptors land in protobuf's default pool, which is what server reflection serves.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.internal import builder

from jaxserve.server.proto.descriptors import FILES

_HERE = Path(__file__).resolve().parent


def _pb2(proto: str) -> types.ModuleType:
    """What protoc's `<name>_pb2.py` would be: the builder calls are the ones generated code makes."""
    name = f"{__name__}.{Path(proto).stem}_pb2"
    mod = types.ModuleType(name, f"Messages and enums of {proto} (jaxserve.server.proto).")
    mod.DESCRIPTOR = descriptor_pool.Default().AddSerializedFile(FILES[proto])
    builder.BuildMessageAndEnumDescriptors(mod.DESCRIPTOR, mod.__dict__)
    builder.BuildTopDescriptorsAndMessages(mod.DESCRIPTOR, name, mod.__dict__)
    sys.modules[name] = mod  # messages name this module: pickling and `import ..._pb2` find it
    return mod


def _stub(service) -> type:
    """A client stub class for a service descriptor: one multi-callable per method, as grpc's
    generated `<Service>Stub` has."""
    def __init__(self, channel: grpc.Channel):
        for m in service.methods:
            open_call = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                         (True, False): channel.stream_unary, (True, True): channel.stream_stream}
            request = message_factory.GetMessageClass(m.input_type)
            response = message_factory.GetMessageClass(m.output_type)
            setattr(self, m.name, open_call[m.client_streaming, m.server_streaming](
                f"/{service.full_name}/{m.name}", request_serializer=request.SerializeToString,
                response_deserializer=response.FromString))
    return type(f"{service.name}Stub", (), {"__init__": __init__, "__module__": __name__,
                                             "__doc__": f"Client stub of {service.full_name}."})


def _grpc(pb2: types.ModuleType) -> types.ModuleType:
    name = pb2.__name__.removesuffix("_pb2") + "_grpc"
    mod = types.ModuleType(name, f"Client stubs of {pb2.DESCRIPTOR.name}'s services.")
    for service in pb2.DESCRIPTOR.services_by_name.values():
        setattr(mod, f"{service.name}Stub", _stub(service))
    return mod


generation_pb2 = _pb2("generation.proto")
jetstream_pb2 = _pb2("jetstream.proto")
generation_grpc = _grpc(generation_pb2)
jetstream_grpc = _grpc(jetstream_pb2)

PROTO_FILES = {"generation": _HERE / "generation.proto", "jetstream": _HERE / "jetstream.proto"}
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
DISAGG_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Disagg"].full_name
JETSTREAM_SERVICE = jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name

__all__ = ["generation_pb2", "generation_grpc", "jetstream_pb2", "jetstream_grpc", "PROTO_FILES",
           "GENERATION_SERVICE", "ADMIN_SERVICE", "DISAGG_SERVICE", "JETSTREAM_SERVICE"]
