"""Who is calling, for the prefix cache: every request's cache salt starts with its tenant's.

Cached prompt KV is shared only between requests of one salt (scheduler/prefix_cache.py), so a
tenant can never hit, and so can never time, another tenant's cached prompts (a hit answers
measurably faster: it would tell one caller what another sent). The tenant is what the
transport authenticated:

    mutual TLS        the client certificate's identities (subject alternative names / CN)
    bearer token      the token (hashed: the salt is kept in memory with every request)
    neither           one anonymous tenant: whoever can reach the server shares its cache

A request's own `cache_salt` narrows its namespace within its tenant, never widens it: the
tenant part comes first and is not the caller's to choose.
"""

from __future__ import annotations

import hashlib
import hmac

from jaxserve.server.messages import RequestSpec


def _digest(kind: bytes, value: bytes) -> str:
    # Keyed by the kind so a certificate name can never equal a token's digest.
    return hmac.new(kind, value, hashlib.sha256).hexdigest()[:32]


def tenant_from(identities, authorization) -> str:
    """The tenant of a caller that presented these certificate identities (None: no client
    certificate) and this authorization header value (None: none), as a short string with no
    secret in it."""
    parts = []
    if identities:
        parts.append("cert:" + _digest(b"cert", b"\0".join(sorted(identities))))
    if authorization:
        raw = authorization.encode() if isinstance(authorization, str) else authorization
        parts.append("token:" + _digest(b"token", raw))
    return "+".join(parts) or "anonymous"


def tenant_of(context) -> str:
    """The authenticated caller of a gRPC call."""
    return tenant_from(context.peer_identities(),  # None unless the client presented a certificate
                       dict(context.invocation_metadata() or ()).get("authorization"))


def tenant_of_http(headers) -> str:
    """The caller of an HTTP request (the OpenAI front door), by its Authorization header.
    uvicorn does not hand the client certificate to the application, so under mutual TLS
    without tokens every HTTP client is one tenant (server README, Prefix caching and tenants)."""
    return tenant_from(None, headers.get("authorization"))


def salt(spec: RequestSpec, tenant: str) -> RequestSpec:
    """`spec` with its tenant set and its SamplingParams' cache_salt set to tenant/client salt."""
    import dataclasses
    spec.tenant = tenant  # also the unit of fair sharing and quotas
    spec.params = dataclasses.replace(spec.params, cache_salt=tenant + "/" + (spec.client_cache_salt or ""))
    return spec


def salt_request(spec: RequestSpec, context) -> RequestSpec:
    """`spec` salted with its gRPC caller's tenant."""
    return salt(spec, tenant_of(context))
