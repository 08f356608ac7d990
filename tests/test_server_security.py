"""TLS, mutual TLS and the bearer token, with good and bad credentials. Certificates are made at
test time (the cryptography package if installed, else the openssl command)."""

from __future__ import annotations

import grpc
import pytest

from jaxserve.server.client import connect
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.server.security import bearer_metadata, channel_credentials
from test_server_support import SERVING, check_stream, fake_server, health, make_certs

REQ = pb.GenerateRequest(prompt="secret", max_tokens=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return {k: str(v) for k, v in make_certs(tmp_path_factory.mktemp("certs")).items()}


def _secure_stub(address, certs, client: str | None = None):
    creds = channel_credentials(certs["ca.pem"], certs.get(f"{client}.pem") if client else None,
                                certs.get(f"{client}.key") if client else None)
    return generation_grpc.GenerationStub(grpc.secure_channel(address, creds))


def _fails_handshake(call) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()


def test_tls(certs):
    with fake_server(server={"tls_cert": certs["server.pem"], "tls_key": certs["server.key"]}) as s:
        check_stream(list(_secure_stub(s.address, certs).Generate(REQ, timeout=10)))
        with connect(s.address, tls_ca=certs["ca.pem"]) as c:  # the CLI's client
            assert c.generate(REQ, timeout=10).completions[0].text
        plain = generation_grpc.GenerationStub(grpc.insecure_channel(s.address))
        _fails_handshake(lambda: plain.GenerateUnary(REQ, timeout=5))
        assert s.server.frontend.stats["accepted"] == 2


def test_mutual_tls(certs):
    cfg = {"tls_cert": certs["server.pem"], "tls_key": certs["server.key"], "tls_client_ca": certs["ca.pem"]}
    with fake_server(server=cfg) as s:
        check_stream(list(_secure_stub(s.address, certs, "client").Generate(REQ, timeout=10)))
        _fails_handshake(lambda: _secure_stub(s.address, certs).GenerateUnary(REQ, timeout=5))  # no cert
        _fails_handshake(lambda: _secure_stub(s.address, certs, "other_client").GenerateUnary(REQ, timeout=5))
        assert s.server.frontend.stats["accepted"] == 1


def test_bearer_token(certs):
    token = "s3cret-token-123"
    with fake_server(server={"auth_token": token}) as s:
        stub = generation_grpc.GenerationStub(grpc.insecure_channel(s.address))
        check_stream(list(stub.Generate(REQ, timeout=10, metadata=bearer_metadata(token))))
        for md in ((), bearer_metadata("wrong-token-456"), (("authorization", token),)):
            for call in (lambda: list(stub.Generate(REQ, timeout=5, metadata=md)),
                         lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=5, metadata=md)):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        # Refused before any work: nothing was admitted or tokenized for the refused calls.
        assert s.server.frontend.stats["accepted"] == 1 and s.server.frontend.stats["tokenized"] == 1
        reg = s.server.metrics.registry
        assert reg.get_sample_value("jaxserve_rejected_requests_total", {"reason": "unauthenticated"}) == 6
        assert health(s) == SERVING  # probes need no token


def test_token_over_mutual_tls(certs):
    token = "another-token-789"
    cfg = {"tls_cert": certs["server.pem"], "tls_key": certs["server.key"], "tls_client_ca": certs["ca.pem"],
           "auth_token": token}
    with fake_server(server=cfg) as s:
        with connect(s.address, token=token, tls_ca=certs["ca.pem"], tls_cert=certs["client.pem"],
                     tls_key=certs["client.key"]) as c:
            check_stream(list(c.stream(REQ, timeout=10)))
        with connect(s.address, tls_ca=certs["ca.pem"], tls_cert=certs["client.pem"],
                     tls_key=certs["client.key"]) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.generate(REQ, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
