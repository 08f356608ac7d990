"""The priority policy on the real engine (tiny random model): a high-priority request that
preempts a running low-priority one leaves both outputs equal to unpreempted runs."""

from __future__ import annotations

import pytest

from conftest import drain, make_engine
from jaxserve.types import SamplingParams


def test_priority_preemption_keeps_outputs_identical(tiny_model):
    model, tok = tiny_model
    # make_engine's shapes (8 sequence slots), so the compiled steps are shared with the other
    # engine tests: 8 low-priority requests fill the slots, a ninth of high priority preempts one.
    eng = make_engine(model, tok, scheduling_policy="priority")
    prompts = [f"low priority request {i}" for i in range(8)] + ["urgent!"]
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=i) for i in range(9)]  # seeded sampling

    def run(prefix, priorities, steps_before_last):
        for i in range(8):
            eng.add_request(prompts[i], params[i], request_id=f"{prefix}{i}", priority=priorities[i])
        for _ in range(steps_before_last):
            eng.step()
        eng.add_request(prompts[8], params[8], request_id=f"{prefix}8", priority=priorities[8])
        drain(eng)
        return [eng.pop_finished(f"{prefix}{i}") for i in range(9)]

    alone = run("a", [0] * 9, 0)  # equal priority: the ninth waits for a slot, nothing preempted
    assert eng.scheduler.num_preemptions_total == 0
    mixed = run("m", [1] * 8 + [0], 3)
    assert eng.scheduler.preemptions_by_reason["priority"] >= 1
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    # the urgent request finished before the one it preempted (the newest low one)
    assert mixed[8].metrics.finished_time < mixed[7].metrics.finished_time
    for o in mixed:  # the latency breakdown adds up: queue + prefill = TTFT, TTFT + decode = last token
        m = o.metrics
        assert m.queue_time >= 0 and m.prefill_time > 0 and m.decode_time > 0
        assert m.queue_time + m.prefill_time == pytest.approx(m.ttft, abs=1e-9)
        assert m.first_token_time + m.decode_time == pytest.approx(m.last_token_time, abs=1e-9)
