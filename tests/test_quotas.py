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
