"""The server's committed protobuf schema (jaxserve/server/proto/descriptors.py, `make protos`)
is what the .proto files compile to, and the messages and stubs built from it need no
grpcio-tools (a dev dependency only)."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from jaxserve.server.proto.descriptors import FILES

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_protos", ROOT / "scripts" / "make_protos.py")
make_protos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_protos)


def test_committed_schema_is_what_the_proto_files_compile_to():
    fresh = make_protos.compile_descriptors()
    assert list(fresh) == list(FILES)
    for name in FILES:
        assert fresh[name] == FILES[name], f"{name} changed: run `make protos` and commit descriptors.py"


def test_an_edited_proto_is_seen_as_drift(tmp_path):
    # The comparison above can fail: one message more in a copy of the .proto files changes the
    # compiled schema; a comment does not (it is not part of the schema).
    proto_dir = tmp_path / make_protos.PROTO_DIR
    shutil.copytree(ROOT / make_protos.PROTO_DIR, proto_dir, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    gen = proto_dir / "generation.proto"
    gen.write_text(gen.read_text() + "\n// a comment only\n")
    assert make_protos.compile_descriptors(tmp_path) == FILES
    gen.write_text(gen.read_text() + "message DriftProbe { int64 x = 1; }\n")
    edited = make_protos.compile_descriptors(tmp_path)
    assert edited["generation.proto"] != FILES["generation.proto"]
    assert edited["jetstream.proto"] == FILES["jetstream.proto"]


def test_messages_and_stubs_build_without_grpcio_tools():
    # A fresh interpreter where grpc_tools cannot be imported: what an installed server has.
    code = """
import sys
sys.modules["grpc_tools"] = None  # import grpc_tools now raises ImportError
import grpc
from jaxserve.server.proto import generation_pb2 as pb, generation_grpc, jetstream_pb2, jetstream_grpc
req = pb.GenerateRequest(prompt="hi", max_tokens=3)
assert pb.GenerateRequest.FromString(req.SerializeToString()) == req
assert pb.FinishReason.Name(pb.FINISH_REASON_STOP) == "FINISH_REASON_STOP"
channel = grpc.insecure_channel("localhost:1")  # never called: stubs only
for pb2, stubs in ((pb, generation_grpc), (jetstream_pb2, jetstream_grpc)):
    for service in pb2.DESCRIPTOR.services_by_name.values():
        stub = getattr(stubs, service.name + "Stub")(channel)
        for m in service.methods:
            assert callable(getattr(stub, m.name)), (service.name, m.name)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
