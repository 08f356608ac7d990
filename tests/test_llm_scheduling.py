"""The server's scheduling policies through the offline API: `LLM.generate(priority=[...])`
(vLLM's argument) and `LLM.generate(tenant=...)` reach the same Engine.add_request path and
scheduler policy (jaxserve/scheduler/policy.py) as the server's calls. Fake model (no
compilation); order is read from the per-request metrics the engine stamps."""

from __future__ import annotations

import pytest

from jaxserve.engine.llm import LLM
from jaxserve.server.fake_engine import make_fake_engine
from jaxserve.types import InvalidRequestError, SamplingParams

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)


def fake_llm(**engine_config) -> LLM:
    """LLM's own generate code over the fake engine built with these engine options."""
    llm = LLM.__new__(LLM)
    llm.engine = make_fake_engine(**engine_config)
    llm.tokenizer = llm.engine.tokenizer
    return llm


def finish_order(outs) -> list[int]:
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.finished_time)


def test_priority_orders_service_lower_first():
    prompts = [f"request {i}" for i in range(6)]
    # One slot: the list order is the arrival order, the last prompt is the most urgent.
    fcfs = fake_llm(max_num_seqs=1).generate(prompts, PARAMS, use_tqdm=False)
    assert finish_order(fcfs) == [0, 1, 2, 3, 4, 5]
    llm = fake_llm(max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, priority=[5, 4, 3, 2, 1, 0])
    assert finish_order(outs) == [5, 4, 3, 2, 1, 0]
    # Outputs come back in the prompts' order and are what FCFS computed.
    assert [o.prompt for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    # Ties keep arrival order; negative priorities are valid.
    outs = llm.generate(prompts[:4], PARAMS, use_tqdm=False, priority=[1, -1, 1, -1])
    assert finish_order(outs) == [1, 3, 0, 2]


def test_a_later_high_priority_request_preempts_running_low_priority_ones():
    llm = fake_llm(max_num_seqs=2, scheduling_policy="priority")
    eng = llm.engine
    long = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    for i in range(2):  # two low-priority requests fill both slots and run ...
        eng.add_request(f"background {i}", long, request_id=f"low{i}", priority=5)
    for _ in range(3):
        eng.step()
    assert eng.scheduler.num_preemptions_total == 0
    # ... then an urgent prompt through LLM.generate takes a slot from one of them.
    (urgent,) = llm.generate(["urgent!"], PARAMS, use_tqdm=False, priority=[0])
    assert eng.scheduler.preemptions_by_reason["priority"] >= 1
    lows = [eng.pop_finished(f"low{i}") for i in range(2)]
    assert all(len(o.outputs[0].token_ids) == 60 for o in lows)  # preempted, recomputed, finished
    assert urgent.metrics.finished_time < min(o.metrics.finished_time for o in lows)
    assert len(urgent.outputs[0].token_ids) == 6

    # Without the policy the same urgent prompt waits for a free slot: nothing is preempted.
    llm = fake_llm(max_num_seqs=2)
    eng = llm.engine
    for i in range(2):
        eng.add_request(f"background {i}", long, request_id=f"low{i}")
    for _ in range(3):
        eng.step()
    (urgent,) = llm.generate(["urgent!"], PARAMS, use_tqdm=False)
    assert eng.scheduler.num_preemptions_total == 0
    lows = [eng.pop_finished(f"low{i}") for i in range(2)]
    assert urgent.metrics.first_scheduled_time > min(o.metrics.finished_time for o in lows)


def admissions(outs) -> list[str]:
    """The outputs' tenants in the order they were first scheduled (ties: prompt order)."""
    order = sorted(range(len(outs)), key=lambda i: (outs[i].metrics.first_scheduled_time, i))
    return [outs[i].prompt.split()[0] for i in order]


def test_fair_share_interleaves_two_tenants_instead_of_first_come_first_served():
    # Tenant a floods the list with 8 prompts before b's 4; two slots, same lengths.
    prompts = [f"a {i}" for i in range(8)] + [f"b {i}" for i in range(4)]
    tenants = ["a"] * 8 + ["b"] * 4
    fcfs = fake_llm(max_num_seqs=2).generate(prompts, PARAMS, use_tqdm=False)
    assert admissions(fcfs) == ["a"] * 8 + ["b"] * 4  # b waits behind all of a
    fair = fake_llm(max_num_seqs=2, fair_share=True).generate(prompts, PARAMS, use_tqdm=False, tenant=tenants)
    order = admissions(fair)
    assert order[:8].count("b") == 4, order  # b gets its half while both are active
    assert all(order[2 * k:2 * k + 2].count("b") == 1 for k in range(4)), order  # one a, one b per pair
    assert [o.outputs[0].token_ids for o in fair] == [o.outputs[0].token_ids for o in fcfs]


def test_tenant_weights_and_one_tenant_for_all():
    prompts = [f"a {i}" for i in range(8)] + [f"b {i}" for i in range(8)]
    llm = fake_llm(max_num_seqs=2, fair_share=True, tenant_weights=(("a", 3.0),))
    order = admissions(llm.generate(prompts, PARAMS, use_tqdm=False, tenant=["a"] * 8 + ["b"] * 8))
    assert order[:8].count("a") == 6, order  # 3 : 1 while both are active
    # One str names the tenant of every prompt: then it is arrival order again.
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, tenant="solo")
    assert admissions(outs) == ["a"] * 8 + ["b"] * 8


def test_priority_and_tenant_reach_chat():
    llm = fake_llm(max_num_seqs=1, scheduling_policy="priority")
    convs = [[{"role": "user", "content": f"hello {i}"}] for i in range(3)]
    outs = llm.chat(convs, PARAMS, use_tqdm=False, priority=[2, 1, 0])
    assert finish_order(outs) == [2, 1, 0]


@pytest.mark.parametrize("engine,kw,field,words", [
    (dict(scheduling_policy="priority"), dict(priority=[0, 1]), "priority", "2 entries for 3 prompts"),
    (dict(scheduling_policy="priority"), dict(priority=[0, 1, 2, 3]), "priority", "4 entries for 3 prompts"),
    (dict(scheduling_policy="priority"), dict(priority=1), "priority", "list of ints"),
    (dict(scheduling_policy="priority"), dict(priority=[0, 1.5, 2]), "priority[1]", "integer"),
    (dict(scheduling_policy="priority"), dict(priority=[0, True, 2]), "priority[1]", "integer"),
    (dict(scheduling_policy="priority"), dict(priority=[0, 2**40, 2]), "priority[1]", "integer"),
    (dict(), dict(priority=[0, 1, 0]), "priority", "scheduling_policy='fcfs'"),
    (dict(fair_share=True), dict(tenant=["a", "b"]), "tenant", "2 entries for 3 prompts"),
    (dict(fair_share=True), dict(tenant=["a", 7, "b"]), "tenant[1]", "must be a str"),
    (dict(fair_share=True), dict(tenant=5), "tenant", "str or a list of str"),
    (dict(), dict(tenant="a"), "tenant", "fair_share=True"),
])
def test_bad_arguments_are_refused_naming_the_field_before_anything_runs(engine, kw, field, words):
    llm = fake_llm(**engine)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x", "y", "z"], PARAMS, use_tqdm=False, **kw)
    assert e.value.field == field and str(e.value).startswith(field + ": ") and words in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)  # vLLM raises ValueError
    assert not llm.engine.has_unfinished()  # nothing was added


def test_zero_priorities_and_empty_tenants_pass_under_any_policy():
    # As vLLM: an all-zero priority list is what every request has anyway.
    outs = fake_llm().generate(["x", "y"], PARAMS, use_tqdm=False, priority=[0, 0], tenant=["", ""])
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
