"""scripts/step_roofline.py's cost model, against counts written out by hand for the tiny
model: FLOPs and bytes of a mixed step (a prefill chunk after cached tokens, a decode with
drafts), and the per-bucket summary's sums. No compilation: the model is only inspected."""

import sys

import numpy as np
import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from step_roofline import StepCost, StepRecorder  # noqa: E402

from jaxserve.scheduler.plan import ScheduledSeq, StepPlan  # noqa: E402


def FakeCache(nbytes):
    """Stands in for the KV cache (a pytree): only its arrays' sizes matter."""
    return {"k": np.zeros(nbytes // 8, np.float32), "v": np.zeros(nbytes // 8, np.float32)}


def test_step_cost_counts_by_hand(tiny_model):
    model, _ = tiny_model
    c = model.cfg
    D, F, N, K, H, V, L = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           c.vocab_size, c.num_layers)
    slots = 64
    per_pos = 2 * L * K * H * 4  # K and V, fp32, every layer
    cost = StepCost(model, FakeCache(per_pos * slots), slots)
    plan = StepPlan((ScheduledSeq(0, (1, 2, 3), 5, (0, 1), sample=True),  # 3 tokens after 5 cached
                     ScheduledSeq(1, (7, 8, 9), 10, (2, 3, 4), sample=True, draft_len=2)), 6, ())
    flops, nbytes = cost.of(plan)
    matmul = L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)  # q, k, v, o; gate, up, down
    # Token at position p attends to p + 1 positions: 6, 7, 8 and 11, 12, 13.
    attended = (6 + 7 + 8) + (11 + 12 + 13)
    logit_rows = 1 + (1 + 2)  # one per sequence, plus the drafts
    assert flops == 2 * matmul * 6 + 4 * L * N * H * attended + 2 * D * V * logit_rows
    head = V * D * 4  # read once per step, tied or not
    weights = (matmul + L * 2 * D + D) * 4 + head + (L * (N * H + 2 * K * H) * 4 if c.attention_bias else 0)
    assert nbytes == pytest.approx(weights + per_pos * ((5 + 3) + (10 + 3)))


def test_recorder_summary_sums_per_bucket(tiny_model):
    model, _ = tiny_model

    class Runner:
        def execute(self, plan, rows):
            return "out"

        def bucket_for(self, n):
            return 8 if n <= 8 else 32

    class Sched:
        num_pages, page_size = 16, 4

    class Engine:
        runner, scheduler_config = Runner(), Sched()

    Engine.runner.cache = FakeCache(1 << 12)
    rec = StepRecorder(Engine, model)
    one = StepPlan((ScheduledSeq(0, (1,), 3, (0,), sample=True),), 1, ())
    big = StepPlan((ScheduledSeq(0, tuple(range(20)), 0, tuple(range(5)), sample=True),), 20, ())
    for p in (one, one, big):
        assert Engine.runner.execute(p, []) == "out"
    rec.stop()
    s = rec.summary({"gemm_gflops": 1.0, "read_gbs": 1.0, "read_gbs_sum": 1.0, "read_gbs_gemv": 1.0}, 10.0)
    by = {b["bucket"]: b for b in s["buckets"]}
    assert (by[8]["steps"], by[8]["tokens"], by[32]["steps"], by[32]["tokens"]) == (2, 2, 1, 20)
    roof = sum(max(f / 1e9, b / 1e9) for f, b in (rec.cost.of(one), rec.cost.of(one), rec.cost.of(big)))
    assert s["roofline_s"] == pytest.approx(roof, abs=1e-3)
    assert s["roofline_fraction"] == pytest.approx(roof / 10.0, abs=1e-3)
