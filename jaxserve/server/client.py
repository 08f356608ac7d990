"""A small synchronous client for jaxserve.v1.Generation (the `jaxserve client` command).

    with connect("localhost:50051") as client:
        for piece in client.stream(GenerateRequest(prompt="Hello", max_tokens=32)):
            print(piece.text, end="")
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.server.security import bearer_metadata, channel_credentials


class Client:
    def __init__(self, channel: grpc.Channel, token: str | None = None):
        self.channel = channel
        self.stub = generation_grpc.GenerationStub(channel)
        self.metadata = bearer_metadata(token)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> pb.GenerateUnaryResponse:
        return self.stub.GenerateUnary(request, timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str, *, token: str | None = None, tls_ca: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None, tls: bool = False,
            max_message_bytes: int = 32 * 2**20) -> Client:
    """Plaintext unless `tls` or a CA / client certificate is given (then TLS, mTLS with a cert)."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if tls or tls_ca or tls_cert:
        channel = grpc.secure_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), options)
    else:
        channel = grpc.insecure_channel(address, options)
    return Client(channel, token)
