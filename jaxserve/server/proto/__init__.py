"""The server's protobuf and gRPC stubs, generated from the .proto files beside this module when it
is first imported (grpcio-tools' in-process protoc, `grpc.protos_and_services`).

Why generate at import instead of committing `*_pb2.py`: the stubs can never drift from the
.proto (there is nothing to regenerate or hand-edit), and protobuf's generated code must match
the protobuf runtime it runs on; code generated here by the installed grpcio-tools always does,
whereas committed code made by another protoc can fail its runtime version check. The cost is
grpcio-tools as a runtime dependency of the server (the `serve` extra) and ~0.2 s at first import.

    generation_pb2, generation_grpc   package jaxserve.v1      (generation.proto)
    jetstream_pb2, jetstream_grpc     package jetstream_proto  (jetstream.proto, JetStream's layout)

The descriptors land in protobuf's default pool, which is what server reflection serves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

_HERE = Path(__file__).resolve().parent
# grpc's loader finds a .proto through sys.path, by the path relative to a sys.path entry; the
# folder above the `jaxserve` package is that entry (site-packages, or the checkout for an
# editable install, whose import hook does not put it on sys.path).
_ROOT = _HERE.parents[2]
_REL = _HERE.relative_to(_ROOT).as_posix()


def _load(name: str):
    added = str(_ROOT) not in sys.path
    if added:
        sys.path.append(str(_ROOT))
    try:
        return grpc.protos_and_services(f"{_REL}/{name}")
    finally:
        if added:
            sys.path.remove(str(_ROOT))


generation_pb2, generation_grpc = _load("generation.proto")
jetstream_pb2, jetstream_grpc = _load("jetstream.proto")

PROTO_FILES = {"generation": _HERE / "generation.proto", "jetstream": _HERE / "jetstream.proto"}
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
JETSTREAM_SERVICE = jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name

__all__ = ["generation_pb2", "generation_grpc", "jetstream_pb2", "jetstream_grpc", "PROTO_FILES",
           "GENERATION_SERVICE", "ADMIN_SERVICE", "JETSTREAM_SERVICE"]
