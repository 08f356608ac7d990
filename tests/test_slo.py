"""SLO-aware admission (scheduler/slo.py): the TTFT the step-cost model predicts for a queued
request is within 10% of what the real engine (fake runner) takes in a virtual-time run with a
known step cost."""

from __future__ import annotations

import pytest

from jaxserve.scheduler.slo import StepCostModel, predict_ttft, queue_state
from jaxserve.server.fake_engine import make_fake_engine
from jaxserve.types import SamplingParams


def step_cost(tokens: int) -> float:
    return 0.005 + 0.0001 * tokens  # the known cost model: 5 ms + 0.1 ms per token of the bucket


def test_cost_model_interpolates_and_extrapolates():
    m = StepCostModel((1, 8, 32, 64))
    assert m.cost(5) is None  # nothing measured: no prediction, no refusal
    m.observe(8, 0.010)
    assert m.cost(1) == m.cost(30) == 0.010
    m.observe(32, 0.020)
    assert m.cost(20) == pytest.approx(0.020)  # bucket 32, measured
    m.observe(64, 0.040)
    m.observe(64, 0.050)  # exponentially weighted: 0.04 + 0.2 * 0.01
    assert m.cost(40) == pytest.approx(0.042)


@pytest.mark.parametrize("long_prompt", [400, 150])
def test_predicted_ttft_within_10_percent_of_simulated(long_prompt):
    budget = 64
    eng = make_fake_engine(max_num_seqs=16, max_num_batched_tokens=budget, num_pages=1024,
                           max_model_len=1024)
    model = StepCostModel(eng.runner.buckets)
    for b in eng.runner.buckets:  # warm-up: one measured step per bucket
        model.observe(b, step_cost(b))
    now = 0.0

    def step():
        nonlocal now
        before = eng.stats["computed_tokens"]
        deltas = eng.step()
        tokens = eng.stats["computed_tokens"] - before
        now += step_cost(model.bucket_for(tokens))
        model.observe(tokens, step_cost(model.bucket_for(tokens)))
        return deltas

    for i in range(4):  # four long decodes
        eng.add_request({"prompt_token_ids": [40 + i] * 8}, SamplingParams(max_tokens=300, ignore_eos=True))
    for _ in range(3):
        step()
    for i in range(3):  # a queue of long prompts
        eng.add_request({"prompt_token_ids": [60 + i] * long_prompt}, SamplingParams(max_tokens=50, ignore_eos=True))
    ahead, decodes = queue_state(eng.scheduler)
    assert (ahead, decodes) == (3 * long_prompt, 4)
    predicted = predict_ttft(model, budget, ahead, decodes, 200)
    eng.add_request({"prompt_token_ids": [90] * 200}, SamplingParams(max_tokens=5, ignore_eos=True),
                    request_id="probe")
    t0 = now
    while not any(d.request_id == "probe" and d.token_ids for d in step()):
        pass
    simulated = now - t0
    assert predicted == pytest.approx(simulated, rel=0.10), (predicted, simulated)
