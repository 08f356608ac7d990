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


def test_tpot_target_caps_prefill_chunks_but_not_decodes():
    from jaxserve.scheduler.slo import SloAdmission, tokens_within
    m = StepCostModel((1, 8, 32, 64))
    for b in m.buckets:
        m.observe(b, step_cost(b))
    assert tokens_within(m, 0.0075, 1) == 8  # 5.8 ms fits, 8.2 ms (32 tokens) does not
    assert tokens_within(m, 0.001, 3) == 3  # decodes always get their token
    eng = make_fake_engine(max_num_seqs=16, max_num_batched_tokens=64, num_pages=256)
    slo = SloAdmission(None, (1, 8, 32, 64), 64, tpot_s=0.0075)
    slo.model = m
    for i in range(3):
        eng.add_request({"prompt_token_ids": [50 + i] * 40}, SamplingParams(max_tokens=4, ignore_eos=True))
    sizes = []
    while eng.has_unfinished():
        slo.size_steps(eng.scheduler)
        before = eng.stats["computed_tokens"]
        eng.step()
        sizes.append(eng.stats["computed_tokens"] - before)
    assert max(sizes) == 8 and len(sizes) >= 120 // 8  # 120 prompt tokens in chunks of at most 8
    eng.scheduler.step_token_cap = None  # uncapped, the same work goes in 64-token steps
    for i in range(3):
        eng.add_request({"prompt_token_ids": [70 + i] * 40}, SamplingParams(max_tokens=4, ignore_eos=True))
    before = eng.stats["computed_tokens"]
    eng.step()
    assert eng.stats["computed_tokens"] - before == 64
    assert slo.refusal(eng.scheduler, 10, 0.0) is None  # no TTFT target: never refuses


def test_batch_cap_admits_one_until_measured_and_grows_one_bucket_past_what_it_measured():
    from jaxserve.scheduler.slo import rows_within, tokens_within
    m = StepCostModel((1, 2, 4, 8, 16, 24, 32))
    assert rows_within(m, 1.0) == 1 and tokens_within(m, 1.0, 3) is None  # nothing measured
    m.observe(8, 0.010)
    # Beyond bucket 8 a step is taken as proportional to its tokens (16: 20 ms), and only the
    # next bucket is within reach, however generous the target: 24 and 32 wait to be measured.
    assert rows_within(m, 0.025) == 16 and rows_within(m, 1.0) == 16
    assert rows_within(m, 0.015) == 8 and tokens_within(m, 0.015, 12) == 12  # decodes keep their token
    m.observe(16, 0.012)  # measured cheaper than the proportional guess: 24 is 18 ms, within reach
    assert rows_within(m, 0.020) == 24
