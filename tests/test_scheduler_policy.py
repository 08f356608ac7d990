"""Scheduling policy (scheduler/policy.py): priority with preemption, aging's bound on waiting,
tenant fair sharing. Fake model of tests/fake_model.py, steps not wall time (milliseconds)."""

from __future__ import annotations

import pytest

from jaxserve.config import ConfigError, SchedulerConfig
from jaxserve.scheduler import Scheduler, SeqStatus
from jaxserve.types import InvalidRequestError, SamplingParams

from fake_model import FakeModel, RunResult, expected_output, run_to_completion, step_once

VOCAB = 64


def make(**kw) -> tuple[Scheduler, FakeModel]:
    kw.setdefault("num_pages", 64)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("page_size", 4)
    sched = Scheduler(SchedulerConfig(**kw))
    return sched, FakeModel.for_scheduler(sched, VOCAB)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 1) % VOCAB for i in range(length)]


def expect(sched, prompt, params):
    return expected_output(prompt, params, 0, (), sched.config.max_model_len, VOCAB)


@pytest.mark.parametrize("kw, field", [
    (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(priority_aging_rate=0.5), "priority_aging_rate"),  # needs the priority policy
    (dict(scheduling_policy="priority", priority_aging_rate=-1), "priority_aging_rate"),
    (dict(scheduling_policy="priority", priority_aging_rate=float("inf")), "priority_aging_rate"),
    (dict(fair_share=1), "fair_share"),
    (dict(tenant_weights=(("a", 0),)), "tenant_weights"),
    (dict(tenant_weights=(("a",),)), "tenant_weights"),
])
def test_policy_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(num_pages=8, max_model_len=64, **kw)


def test_priority_argument_errors_name_the_field():
    sched, _ = make(scheduling_policy="priority")
    for bad in (1.5, True, 2**40, "1"):
        with pytest.raises(InvalidRequestError, match="priority"):
            sched.add_request("r", [1, 2], SamplingParams(max_tokens=2), priority=bad)
    with pytest.raises(InvalidRequestError, match="tenant"):
        sched.add_request("r", [1, 2], SamplingParams(max_tokens=2), tenant=3)
    assert not sched.has_unfinished()


def admitted_order(policy):
    sched, fake = make(scheduling_policy=policy, max_num_seqs=1, max_num_batched_tokens=16)
    for i, prio in enumerate([5, 3, 0, 3]):
        sched.add_request(f"r{i}", prompt_of(4, i), SamplingParams(max_tokens=2, seed=i), priority=prio)
    order, res = [], RunResult()
    while sched.has_unfinished():
        plan, _ = step_once(sched, fake, res)
        for s in plan.seqs:
            rid = sched.get_sequence(s.seq_id).request_id if s.seq_id in sched._seqs else None
            if rid and rid not in order:
                order.append(rid)
    return order, sched


def test_fcfs_default_ignores_priority_and_priority_policy_orders_by_it():
    order, sched = admitted_order("fcfs")
    assert order == ["r0", "r1", "r2", "r3"] and sched.num_preemptions_total == 0
    # All four wait before the first step: lowest value first, ties by arrival.
    order, _ = admitted_order("priority")
    assert order == ["r2", "r1", "r3", "r0"]


@pytest.mark.parametrize("short_of", ["slots", "pages"])
def test_higher_priority_preempts_lower_and_outputs_are_unchanged(short_of):
    # "slots": one sequence slot. "pages": 8 usable pages of 4 tokens, the low request holds
    # 6 of them (20 + 3 tokens) when the high one (needing 3) arrives.
    kw = dict(max_num_seqs=1) if short_of == "slots" else dict(num_pages=9, max_num_seqs=4)
    sched, fake = make(scheduling_policy="priority", max_num_batched_tokens=32,
                       enable_prefix_caching=False, **kw)
    p_lo, p_hi = SamplingParams(max_tokens=12, seed=1), SamplingParams(max_tokens=6, seed=2)
    (lo,) = sched.add_request("lo", prompt_of(20, 1), p_lo, priority=1)
    res = RunResult()
    for _ in range(4):
        step_once(sched, fake, res)
    assert sched.get_sequence(lo).status is SeqStatus.RUNNING
    (hi,) = sched.add_request("hi", prompt_of(12, 2), p_hi, priority=0)
    plan, _ = step_once(sched, fake, res)
    assert plan.preempted == (lo,) and hi in {s.seq_id for s in plan.seqs}
    assert sched.preemptions_by_reason == {"kv": 0, "priority": 1}
    r = run_to_completion(sched, fake, result=res)
    assert (r.outputs[lo], r.finish[lo]) == expect(sched, prompt_of(20, 1), p_lo)
    assert (r.outputs[hi], r.finish[hi]) == expect(sched, prompt_of(12, 2), p_hi)


def test_equal_or_lower_priority_never_preempts():
    sched, fake = make(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=16)
    sched.add_request("a", prompt_of(4), SamplingParams(max_tokens=8), priority=1)
    step_once(sched, fake)
    sched.add_request("b", prompt_of(4, 1), SamplingParams(max_tokens=8), priority=1)
    sched.add_request("c", prompt_of(4, 2), SamplingParams(max_tokens=8), priority=2)
    run_to_completion(sched, fake)
    assert sched.num_preemptions_total == 0


def waiting_of_low_priority(aging_rate, steps=250):
    """A stream of priority-0 requests (one a step, 4 tokens each, 2 slots: more than the
    server can do) and one priority-10 request that arrives at step 5. Returns (the step the
    low one got its first token or None, the bound aging promises)."""
    policy = dict(scheduling_policy="priority", priority_aging_rate=aging_rate)
    sched, fake = make(max_num_seqs=2, max_num_batched_tokens=16, **policy)
    res, low, first_token, k = RunResult(), None, None, 0
    max_tokens = 4
    for step in range(steps):
        if step == 5:
            (low,) = sched.add_request("low", prompt_of(3, 99), SamplingParams(max_tokens=max_tokens),
                                       priority=10)
            low_arrival = sched.num_steps
        sched.add_request(f"h{k}", prompt_of(3, k), SamplingParams(max_tokens=max_tokens, seed=k), priority=0)
        k += 1
        _, events = step_once(sched, fake, res)
        if first_token is None and any(e.seq_id == low for e in events):
            first_token = step
    if not aging_rate:
        return first_token, None
    # Only requests that arrived before low_arrival + 10 / rate outrank it (policy.py); each
    # takes max_tokens steps (1 prefill + 3 decodes) on one of 2 slots, so they are all served
    # within (their number / 2 + 1) * max_tokens steps of the stream starting.
    ahead = low_arrival + 10 / aging_rate + 1
    bound = (ahead / 2 + 1) * max_tokens
    return first_token, bound


def test_aging_bounds_the_wait_of_a_low_priority_request():
    first, _ = waiting_of_low_priority(0.0)
    assert first is None  # without aging the stream starves it
    for rate in (0.5, 0.1):
        first, bound = waiting_of_low_priority(rate)
        assert first is not None and first <= bound, (rate, first, bound)


def flood(fair: bool):
    """Tenant A queues 100 requests, then tenant B 5; 4 slots. B's TTFT in steps, per request."""
    sched, fake = make(max_num_seqs=4, max_num_batched_tokens=32, num_pages=200, fair_share=fair)
    for i in range(100):
        sched.add_request(f"a{i}", prompt_of(8, i), SamplingParams(max_tokens=8, seed=i), tenant="A")
    b_ids = {}
    for i in range(5):
        (sid,) = sched.add_request(f"b{i}", prompt_of(8, 200 + i), SamplingParams(max_tokens=8), tenant="B")
        b_ids[sid] = i
    ttft, step, res = {}, 0, RunResult()
    while sched.has_unfinished():
        step += 1
        _, events = step_once(sched, fake, res)
        for e in events:
            if e.seq_id in b_ids and e.seq_id not in ttft:
                ttft[e.seq_id] = step
    return sorted(ttft.values()), sched


def test_a_flooding_tenant_cannot_push_another_past_its_fair_share():
    unfair, _ = flood(False)
    fair, sched = flood(True)
    # Each request lives 8 steps (one prefill step, 7 decodes). With two active tenants of equal
    # weight B is owed 2 of the 4 slots: its 5 requests need ceil(5 / 2) = 3 rounds of 8 steps,
    # plus up to 8 steps for A's first requests to leave their slots.
    assert max(fair) <= 3 * 8 + 8, fair
    assert min(unfair) > 100 * 8 / 4 - 8, unfair  # FCFS: B waits behind all of A
    # Fairness is per token: B gets no more than its share either (A is never starved).
    assert sched.num_preemptions_total == 0


def test_tenant_weights_split_admissions():
    # Two flooding tenants, weight 3 : 1, 4 slots: over the run A gets ~3 of every 4 admissions.
    sched, fake = make(max_num_seqs=4, max_num_batched_tokens=32, num_pages=200, fair_share=True,
                       tenant_weights=(("A", 3.0),))
    for i in range(40):
        for t in "AB":
            # distinct prompts: a prefix-cache hit would make one tenant's requests cheaper
            salt = i + (100 if t == "B" else 0)
            sched.add_request(f"{t}{i}", prompt_of(8, salt), SamplingParams(max_tokens=8, seed=i), tenant=t)
    done = {"A": 0, "B": 0}
    for _ in range(60):  # well before either runs dry
        _, events = step_once(sched, fake)
        for e in events:
            if e.finished:
                done[e.request_id[0]] += 1
    assert 2.5 <= done["A"] / done["B"] <= 3.5, done


def test_fair_share_state_of_one_shot_tenants_stays_bounded():
    """Without --auth-token clients can name new tenants at will: 10,000 tenants of one request
    each, beside one busy tenant, leave FairShare holding only the active tenants and the few
    idle ones still in debt (policy.py's module docstring), and nothing once all are done."""
    sched, fake = make(max_num_seqs=8, max_num_batched_tokens=32, num_pages=200, fair_share=True)
    a_live, a_next, peak, res = set(), 0, 0, RunResult()
    for i in range(10_000 // 4):
        while len(a_live) < 2:  # tenant A always has two requests running
            sched.add_request(f"a{a_next}", prompt_of(4, a_next), SamplingParams(max_tokens=50), tenant="A")
            a_live.add(f"a{a_next}")
            a_next += 1
        for j in range(4):  # four new one-shot tenants a step
            n = 4 * i + j
            sched.add_request(f"t{n}", prompt_of(4, 1000 + n), SamplingParams(max_tokens=1), tenant=f"t{n}")
        _, events = step_once(sched, fake, res)
        a_live -= {e.request_id for e in events if e.finished}
        peak = max(peak, len(sched._fair.service))
    assert peak <= 64, peak  # a number, not growing with the 10,000 tenants
    while sched.has_unfinished():
        step_once(sched, fake, res)
    assert sched._fair.service == {} and sched._fair.live == {}


def test_fair_share_keeps_an_idle_tenants_debt_while_others_are_active():
    """Forgetting may only drop what changes no decision: a tenant that went idle owing service
    returns owing it (else coming and going would wipe its debt), and only when no tenant is
    active at all does every counter restart from zero."""
    from jaxserve.scheduler.policy import FairShare
    fair = FairShare()
    fair.activate("A", 1)
    fair.activate("B", 1)
    fair.charge("B", 100)
    fair.retire("B")
    fair.activate("B", 1)  # back while A is active: still 100 ahead of A
    assert fair.service == {"A": 0.0, "B": 100.0}
    fair.retire("B")
    fair.retire("A")
    assert fair.service == {} and fair.live == {}
