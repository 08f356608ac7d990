"""Per-tenant limits (scheduler/quotas.py) on a hand-driven clock: each refuses exactly what
exceeds it, names itself, and hints when to retry."""

from __future__ import annotations

import pytest

from jaxserve.scheduler.quotas import TenantLimits, TenantQuotas


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_concurrency_and_queue_limits_refuse_exactly_the_excess():
    q = TenantQuotas(TenantLimits(max_concurrent=3, max_queued=2))
    assert q.check_and_reserve("a", 10, 5) is None
    assert q.check_and_reserve("a", 10, 5) is None
    r = q.check_and_reserve("a", 10, 5)  # 2 queued already
    assert r.limit == "max_queued" and "max_queued=2" in r.message and r.retry_after_s
    q.started("a")
    assert q.check_and_reserve("a", 10, 5) is None  # 3 live, 2 queued
    r = q.check_and_reserve("a", 10, 5)
    assert r.limit == "max_concurrent" and "max_concurrent=3" in r.message
    assert q.check_and_reserve("b", 10, 5) is None  # another tenant is not affected
    q.ended("a", 0, was_queued=False)
    assert q.snapshot("a")[:2] == (2, 2)
    q.started("a")
    assert q.check_and_reserve("a", 10, 5) is None
    assert q.snapshot("a")[:2] == (3, 2)


def test_token_bucket_refuses_exactly_what_exceeds_it_and_refills():
    clock = Clock()
    q = TenantQuotas(TenantLimits(tokens_per_minute=600), clock)  # 10 tokens a second
    assert q.check_and_reserve("a", 100, 200) is None  # 300 of 600
    assert q.check_and_reserve("a", 100, 200) is None  # 600 of 600
    r = q.check_and_reserve("a", 1, 0)
    assert r.limit == "tokens_per_minute" and r.retry_after_s == pytest.approx(0.1)
    clock.t += 5.0  # +50 tokens
    assert q.check_and_reserve("a", 20, 30) is None  # exactly the 50 there
    r = q.check_and_reserve("a", 1, 0)
    assert r is not None and r.retry_after_s == pytest.approx(0.1)
    # a request that used 20 of its 200 output tokens gives 180 back when it ends
    q.ended("a", 180, was_queued=True)
    assert q.check_and_reserve("a", 80, 100) is None
    assert q.check_and_reserve("a", 1, 0).limit == "tokens_per_minute"
    clock.t += 3600  # a long idle tenant refills to one minute's worth, not more
    assert q.snapshot("a")[2] == 600


def test_requests_that_can_never_pass_have_no_retry_hint():
    q = TenantQuotas(TenantLimits(tokens_per_minute=100, max_prompt_tokens=50, max_output_tokens=40))
    for args, limit in (((51, 1), "max_prompt_tokens"), ((10, 41), "max_output_tokens"),
                        ((30, 40, 2), "tokens_per_minute")):
        r = q.check_and_reserve("a", *args)
        assert r.limit == limit and limit in r.message and r.retry_after_s is None
    assert q.check_and_reserve("a", 50, 40) is None
    assert q.snapshot("a")[:2] == (1, 1)


def test_limits_validate():
    with pytest.raises(ValueError, match="max_queued"):
        TenantLimits(max_queued=-1)
    assert not TenantLimits().any and TenantLimits(max_concurrent=1).any


def test_state_of_many_one_shot_tenants_stays_bounded():
    """Without --auth-token any client can name a new tenant: 10,000 tenants of one request
    each leave no state behind once their buckets have refilled. A tenant is forgotten only
    when neutral (nothing live, a full bucket: what a tenant never seen gets), so returning
    early cannot refill a bucket."""
    clock = Clock()
    q = TenantQuotas(TenantLimits(max_concurrent=2, tokens_per_minute=6000), clock)
    peak = 0
    for i in range(10_000):
        assert q.check_and_reserve(f"t{i}", 10, 20) is None
        q.started(f"t{i}")
        q.ended(f"t{i}", 15, was_queued=False)
        clock.t += 0.1  # 10 new tenants a second
        peak = max(peak, len(q))
    # Held: the tenants idle for less than the minute a bucket takes to refill (600 of them).
    assert peak <= 601, peak
    clock.t += 60.0
    assert q.snapshot("t0") == (0, 0, 6000.0) and len(q) == 0
    # A tenant back before its bucket refilled finds it as it left it.
    assert q.check_and_reserve("a", 3000, 3000) is None
    q.ended("a", 0, was_queued=True)
    clock.t += 30.0  # half refilled
    r = q.check_and_reserve("a", 3001, 3000)
    assert r.limit == "tokens_per_minute" and len(q) == 1
    clock.t += 30.0
    assert q.check_and_reserve("b", 1, 1) is None and len(q) == 1  # a forgotten, b live
    # Without a token bucket a tenant is neutral as soon as its last request ends, and a
    # refused request leaves nothing either.
    q = TenantQuotas(TenantLimits(max_concurrent=1, max_prompt_tokens=5))
    for i in range(10_000):
        assert q.check_and_reserve(f"t{i}", 1, 1) is None
        assert q.check_and_reserve(f"t{i}", 1, 1).limit == "max_concurrent"
        q.ended(f"t{i}", 0, was_queued=True)
        assert len(q) == 0
