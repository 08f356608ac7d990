"""Tenants through the server (fake model, loopback gRPC): per-tenant limits refuse with a
status naming the limit and a retry hint, count per tenant in metrics, and give back what they
reserved; the tenant (bearer token) reaches the scheduler's fair sharing."""

from __future__ import annotations

import grpc
import pytest

from jaxserve.scheduler.quotas import TenantLimits
from jaxserve.server import tenancy
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import FIELD_KEY, fake_server, gen_stub, wait_idle, wait_until


def md(token):
    return (("authorization", f"Bearer {token}"),)


def req(max_tokens=6, prompt="hello tenants"):
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)


def test_tenant_limits_refuse_name_the_limit_and_release():
    limits = TenantLimits(max_concurrent=2, max_output_tokens=8, tokens_per_minute=10_000)
    # slow steps keep two of tenant a's requests in flight while the third arrives
    with fake_server(step_delay_s=0.05, server={"tenant_limits": limits},
                     fair_share=True) as s:
        stub = gen_stub(s)
        a1 = stub.GenerateUnary.future(req(8), metadata=md("tenant-a"), timeout=30)
        a2 = stub.GenerateUnary.future(req(8), metadata=md("tenant-a"), timeout=30)
        quotas = s.server.frontend.quotas
        ta, tb = (tenancy._digest(b"token", f"Bearer {t}".encode()) for t in ("tenant-a", "tenant-b"))
        ta, tb = "token:" + ta, "token:" + tb
        wait_until(lambda: quotas.snapshot(ta)[0] == 2, what="two requests of a in flight")
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(req(), metadata=md("tenant-a"), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_concurrent=2" in e.value.details() and "retry after" in e.value.details()
        assert dict(e.value.trailing_metadata())[FIELD_KEY] == "max_concurrent"
        assert len(stub.GenerateUnary(req(), metadata=md("tenant-b"), timeout=30).completions[0].token_ids) == 6
        with pytest.raises(grpc.RpcError) as e:  # can never pass: not a retry-later
            stub.GenerateUnary(req(9), metadata=md("tenant-b"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_output_tokens=8" in e.value.details()
        a1.result(), a2.result()
        wait_idle(s)
        assert quotas.snapshot(ta)[:2] == (0, 0) and quotas.snapshot(tb)[:2] == (0, 0)
        assert quotas.snapshot(tb)[2] > 10_000 - 2 * 20  # the unused reservations came back
        text = s.server.metrics.exposition().decode()
        assert f'jaxserve_tenant_rejected_requests_total{{limit="max_concurrent",tenant="{ta}"}} 1.0' in text
        assert f'jaxserve_tenant_rejected_requests_total{{limit="max_output_tokens",tenant="{tb}"}} 1.0' in text
        # the tenants reached the scheduler's fair sharing
        assert {ta, tb} <= set(s.server.engine.scheduler._fair.service)
