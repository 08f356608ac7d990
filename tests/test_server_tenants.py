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
    ta, tb = (tenancy._digest(b"token", f"Bearer {t}".encode()) for t in ("tenant-a", "tenant-b"))
    ta, tb = "token:" + ta, "token:" + tb

    def hold_at_two(loop):
        # The engine stops once a's two requests are in the scheduler's fair sharing, so they
        # are still in flight when the third comes (their 8 slow steps take 0.4 s, which a loaded
        # machine could spend before the third call); set before any request is sent.
        if loop.engine.scheduler._fair.live.get(ta) == 2:
            loop.pause()
    with fake_server(step_delay_s=0.05, server={"tenant_limits": limits}, fair_share=True,
                     on_step=hold_at_two) as s:
        stub = gen_stub(s)
        a1 = stub.GenerateUnary.future(req(8), metadata=md("tenant-a"), timeout=30)
        a2 = stub.GenerateUnary.future(req(8), metadata=md("tenant-a"), timeout=30)
        quotas = s.server.frontend.quotas
        fair = s.server.engine.scheduler._fair
        el = s.server.engine_loop
        wait_until(lambda: el.paused, what="a's two requests in the scheduler")
        assert quotas.snapshot(ta)[0] == 2
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(req(), metadata=md("tenant-a"), timeout=30)
        el.on_step = None
        el.resume()
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
        # and, all idle, it keeps no per-tenant state (policy.py: forgotten once neutral)
        assert fair.service == {} and fair.live == {}


def _sample(text: str, name: str, labels: str = "") -> float:
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    line = next(l for l in text.splitlines() if l.startswith(prefix))
    return float(line.split()[-1])


def test_priority_preemption_and_latency_breakdown_in_metrics():
    # One sequence slot and the priority policy: a priority-0 request preempts a running
    # priority-5 one; the breakdown histograms and the per-reason/tenant counter see it.
    with fake_server(step_delay_s=0.02, max_num_seqs=1, max_num_batched_tokens=64,
                     scheduling_policy="priority") as s:
        stub = gen_stub(s)
        lo = stub.GenerateUnary.future(pb.GenerateRequest(prompt="low", max_tokens=40, ignore_eos=True,
                                                          priority=5), metadata=md("t-low"), timeout=30)
        sched = s.server.engine.scheduler
        wait_until(lambda: sched.num_running == 1 and s.server.engine.stats["steps"] > 3, what="low runs")
        hi = stub.GenerateUnary(pb.GenerateRequest(prompt="high", max_tokens=3, ignore_eos=True,
                                                   priority=0), metadata=md("t-high"), timeout=30)
        assert len(hi.completions[0].token_ids) == 3
        assert len(lo.result().completions[0].token_ids) == 40
        wait_idle(s)
        assert sched.preemptions_by_reason["priority"] == 1
        text = s.server.metrics.exposition().decode()
        t_low = tenancy._digest(b"token", b"Bearer t-low")
        assert _sample(text, "jaxserve_preemptions_by_reason_total",
                       f'reason="priority",tenant="token:{t_low}"') == 1.0
        for h in ("request_queue_time", "request_prefill_time", "request_decode_time",
                  "time_to_first_token"):
            assert _sample(text, f"jaxserve_{h}_seconds_count") == 2.0, h
        assert _sample(text, "jaxserve_engine_step_tokens_count") == s.server.engine.stats["steps"]
        assert 0 < _sample(text, "jaxserve_kv_cache_usage_peak_fraction") <= 1
        assert _sample(text, "jaxserve_kv_cache_usage_fraction") == 0.0  # idle: nothing held


def test_slo_admission_refuses_what_would_miss_its_ttft():
    # 30 ms steps of at most 64 tokens: a 1920-token prompt needs 30 steps (~900 ms) to its first
    # token, more than the 300 ms target; a short one needs one step (of the size measured, so
    # a loaded machine's slower steps still leave it well inside the target).
    with fake_server(step_delay_s=0.03, max_num_batched_tokens=64, max_model_len=2048,
                     num_pages=1024, server={"slo_ttft_ms": 300}) as s:
        stub = gen_stub(s)
        assert len(stub.GenerateUnary(req(3, "warm"), timeout=30).completions[0].token_ids) == 3  # learns the cost
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(req(3, "x" * 1920), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "slo_ttft_ms=300" in e.value.details() and "retry after" in e.value.details()
        assert dict(e.value.trailing_metadata())[FIELD_KEY] == "slo_ttft_ms"
        assert len(stub.GenerateUnary(req(3, "mraw"), timeout=30).completions[0].token_ids) == 3
        wait_idle(s)
        text = s.server.metrics.exposition().decode()
        assert _sample(text, "jaxserve_rejected_requests_total", 'reason="slo_ttft"') == 1.0


def _tenant(token: str) -> str:
    return "token:" + tenancy._digest(b"token", f"Bearer {token}".encode())


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_queue_full_refusals_count_by_tenant_with_a_bounded_label_set(door):
    # The engine held, a waiting queue of 2: tenant a's first two requests wait, every later
    # request (a's third, then b's, c's and d's) is refused queue-full. Three tenant labels at
    # most: a, b, c are named; d, the fourth tenant, is counted as "other".
    import httpx

    from jaxserve.server.metrics import OTHER_TENANTS
    with fake_server(server={"max_queued_requests": 2, "http_port": 0}) as s:
        s.server.metrics.max_tenant_labels = 3
        el = s.server.engine_loop
        el.pause()
        stub = gen_stub(s)
        held = [stub.GenerateUnary.future(req(2), metadata=md("a"), timeout=30) for _ in range(2)]
        wait_until(lambda: el.num_waiting_here == 2, what="two requests of a queued")
        codes, http = [], f"http://127.0.0.1:{s.server.http_port}"
        model = httpx.get(http + "/v1/models", timeout=30).json()["data"][0]["id"]
        for token in ("a", "b", "c", "d", "d"):
            if door == "grpc":
                with pytest.raises(grpc.RpcError) as e:
                    stub.GenerateUnary(req(2), metadata=md(token), timeout=30)
                codes.append(e.value.code().name)
            else:
                r = httpx.post(http + "/v1/completions", timeout=30, headers={"authorization": f"Bearer {token}"},
                               json={"model": model, "prompt": "x", "max_tokens": 2})
                codes.append(r.status_code)
        el.resume()
        assert all(len(f.result().completions[0].token_ids) == 2 for f in held)
        wait_idle(s)
        count = s.server.metrics.registry.get_sample_value
        name = "jaxserve_tenant_rejected_requests_total"
    assert codes == (["RESOURCE_EXHAUSTED"] * 5 if door == "grpc" else [429] * 5)
    for tenant, n in ((_tenant("a"), 1), (_tenant("b"), 1), (_tenant("c"), 1), (OTHER_TENANTS, 2)):
        assert count(name, {"tenant": tenant, "limit": "max_queued_requests"}) == n, tenant
    assert count(name, {"tenant": _tenant("d"), "limit": "max_queued_requests"}) is None


def test_tenant_label_cap_keeps_named_tenants_and_folds_the_rest():
    from jaxserve.server.metrics import ServerMetrics
    m = ServerMetrics(max_tenant_labels=2)
    assert [m.tenant_label(t) for t in ("x", "y", "z", "x", "w", "y")] == ["x", "y", "other", "x", "other", "y"]


def test_tokenizer_pool_refusals_count_by_tenant_on_both_doors():
    """A busy tokenizer pool refuses RESOURCE_EXHAUSTED / 429 and counts against the caller's
    tenant as a full waiting queue does (limit "max_pool_backlog"). Its bound is set to 0 here,
    so every job for the pool is refused: a text prompt's tokenizing (gRPC and HTTP), a grammar
    request's conversion (HTTP), and Tokenize (gRPC and HTTP). Nothing is held afterwards."""
    import httpx
    with fake_server(server={"http_port": 0}) as s:
        s.server.frontend.pool.max_backlog = 0
        stub = gen_stub(s)
        http = f"http://127.0.0.1:{s.server.http_port}"
        model = httpx.get(http + "/v1/models", timeout=30).json()["data"][0]["id"]
        for call in (lambda: stub.GenerateUnary(req(2), metadata=md("a"), timeout=30),
                     lambda: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md("a"), timeout=30)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "tokenizer pool is busy" in e.value.details()
        bearer = {"authorization": "Bearer b"}
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "guided_regex": "[0-9]+"}),
                           ("/tokenize", {"prompt": "hi"})):
            r = httpx.post(http + path, timeout=30, headers=bearer, json={"model": model, **body})
            assert r.status_code == 429 and "tokenizer pool is busy" in r.text, (path, r.text)
        count = s.server.metrics.registry.get_sample_value
        name = "jaxserve_tenant_rejected_requests_total"
        assert count(name, {"tenant": _tenant("a"), "limit": "max_pool_backlog"}) == 2
        assert count(name, {"tenant": _tenant("b"), "limit": "max_pool_backlog"}) == 3
        assert s.server.frontend.limiter.queued_samples == 0  # the refusals gave back their reservations
        s.server.frontend.pool.max_backlog = 1024
        assert len(stub.GenerateUnary(req(2), metadata=md("a"), timeout=30).completions[0].token_ids) == 2
        wait_idle(s)
