"""TLS / mutual TLS credentials and the bearer-token check.

The token check is a server interceptor, so a call without the right
`authorization: Bearer <token>` metadata is answered UNAUTHENTICATED before its request is
even deserialized. The health service is exempt: orchestrators' gRPC probes cannot send
metadata, and health reveals nothing (JetStream's `HealthCheck` is a health probe too). Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from jaxserve.server.config import ServerConfig

# Health probes of both kinds: the standard service and JetStream's own HealthCheck.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/jetstream_proto.Orchestrator/HealthCheck")


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """None = plaintext. With tls_client_ca, clients must present a certificate it signed."""
    if cfg.tls_cert is None:
        return None
    ca = _read(cfg.tls_client_ca)
    return grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))],
                                       root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(ca: str | None = None, cert: str | None = None,
                        key: str | None = None) -> grpc.ChannelCredentials:
    """Client side: trust `ca` (None = the system roots); present cert/key for mutual TLS."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_problem(expected_token: str, got: str | bytes | None) -> str | None:
    """The one bearer-token rule of both front doors (gRPC metadata, HTTP header): None if `got`
    (the whole `authorization` value) is right, else why not. Compared in constant time."""
    got_bytes = got.encode() if isinstance(got, str) else (got or b"")
    if hmac.compare_digest(got_bytes, f"Bearer {expected_token}".encode()):
        return None
    return f"{'missing' if got is None else 'wrong'} bearer token: send 'authorization: Bearer <token>'"


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only refuses. Requests stay raw bytes."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable; makes this an async generator for streaming methods

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.stream_stream_rpc_method_handler(refuse_stream)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, on_reject=None):
        self._token = token
        self._on_reject = on_reject

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(EXEMPT_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization")
        problem = bearer_problem(self._token, got)
        if problem is None:
            return handler
        if self._on_reject is not None:
            self._on_reject()
        return _deny(handler, problem + " (metadata)")
