"""The engine/runner seam (engine/runner_protocol.py): Engine builds its runner from a factory,
the fake runner is the one fake model plugged into the real Engine and checks every plan's
pages, FaultInjectingRunner wraps any runner, and the engine's own clean-up verbs."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.engine.faults import FaultInjectingRunner
from jaxserve.engine.runner_protocol import Runner
from jaxserve.server.fake_engine import FakeRunner, fake_generate, make_fake_engine
from jaxserve.types import SamplingParams


def run(engine, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError(f"not finished after {max_steps} steps")


def test_the_engine_builds_its_runner_from_the_factory_with_its_scheduler_config():
    seen = []

    def factory(sched, buckets):
        seen.append(sched)
        return FakeRunner(sched, buckets)

    eng = make_fake_engine(runner=factory, page_size=8, num_pages=40)
    assert seen == [eng.scheduler_config] and isinstance(eng.runner, Runner)
    assert eng.runner.model.page_size == 8
    rid = eng.add_request("hello", SamplingParams(max_tokens=5, ignore_eos=True))
    run(eng)
    assert eng.pop_finished(rid).outputs[0].token_ids == fake_generate(list(b"hello"), 5, ignore_eos=True)[0]


def test_a_runner_that_lacks_part_of_the_protocol_is_refused_naming_what_is_missing():
    with pytest.raises(TypeError, match=r"lacks \['buckets', 'mask_words'.*'forget'\]"):
        make_fake_engine(runner=lambda sched, buckets: object())


def test_fault_injecting_runner_wraps_any_runner_and_is_one():
    eng = make_fake_engine()
    inner = eng.runner
    eng.runner = FaultInjectingRunner(inner, lambda step, plan, rows: step == 0)
    assert isinstance(eng.runner, Runner) and eng.runner.buckets == inner.buckets
    rid = eng.add_request("abc", SamplingParams(max_tokens=3, ignore_eos=True))
    run(eng)
    out = eng.pop_finished(rid).outputs[0]
    assert eng.runner.injected == 1 and out.finish_reason == "error" and "injected fault" in out.error


def test_the_fake_runner_refuses_a_plan_whose_pages_do_not_hold_the_context():
    """The fake model's KV record is wired in: a block table pointing at pages the context was
    never written to fails the step (a real model would read garbage)."""
    eng = make_fake_engine(max_num_batched_tokens=8, max_num_seqs=8)  # 12-token prompt: 2 chunks
    schedule = eng.scheduler.schedule
    calls = []

    def corrupt():
        plan = schedule()
        calls.append(plan)
        if len(calls) == 2:  # the second chunk: its context is pages 0..1 of the first
            s = plan.seqs[0]
            bad = dataclasses.replace(s, block_table=tuple(reversed(s.block_table)))
            plan = dataclasses.replace(plan, seqs=(bad,))
            eng.scheduler._pending_plan = plan  # the scheduler hands out this plan (test only)
        return plan

    eng.scheduler.schedule = corrupt
    rid = eng.add_request("twelve bytes", SamplingParams(max_tokens=2, ignore_eos=True))
    run(eng)
    out = eng.pop_finished(rid).outputs[0]
    assert out.finish_reason == "error" and "KV read back from its pages before this step" in out.error


def test_a_lost_kv_cache_takes_the_cached_prefixes_with_it():
    """Fails on the old engine: after a fault that lost the cache, a prompt matching a cached
    prefix reused pages whose content had gone (the fake model's read-back catches it)."""
    eng = make_fake_engine()
    prompt = "sixteen byte pre" + "fix and more"
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = eng.add_request(prompt, params)
    run(eng)
    assert eng.prefix_cache_stats()["cached_pages"] > 0
    eng.runner = FaultInjectingRunner(eng.runner, lambda step, plan, rows: step == 0, lose_cache=True)
    b = eng.add_request("another prompt", params)
    run(eng)
    assert eng.pop_finished(b).outputs[0].finish_reason == "error" and eng.runner.inner.cache_resets == 1
    c = eng.add_request(prompt, params)
    run(eng)
    want = eng.pop_finished(a).outputs[0].token_ids
    got = eng.pop_finished(c).outputs[0]
    assert got.finish_reason == "length" and got.token_ids == want, got.error


def test_abort_all_cleans_up_after_a_step_that_raised_with_its_plan_pending():
    eng = make_fake_engine()
    ids = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in ("one", "two")]
    eng.step()
    get = eng.scheduler.get_sequence
    eng.scheduler.get_sequence = lambda seq_id: (_ for _ in ()).throw(RuntimeError("a bug mid-step"))
    with pytest.raises(RuntimeError, match="a bug mid-step"):
        eng.step()  # raised between schedule() and the runner: the plan is still pending
    eng.scheduler.get_sequence = get
    assert sorted(eng.abort_all()) == sorted(ids)
    assert not eng.has_unfinished() and all(eng.pop_finished(i) is None for i in ids)
    eng.scheduler.check_idle_invariant()
    rid = eng.add_request("three", SamplingParams(max_tokens=3, ignore_eos=True))  # still serves
    run(eng)
    assert eng.pop_finished(rid).outputs[0].finish_reason == "length"
