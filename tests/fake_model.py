"""The scheduler tests' view of the one fake model (jaxserve/engine/fake_model.py: the hash,
the paged KV checks) and a driver loop around a bare Scheduler.

Next token: jaxserve.engine.fake_model.next_token, h % vocab_size, with seed =
`(params.seed or 0) + sample_index`, so sample i of a request with seed s equals a
single-sample request with seed s + i (the n > 1 tests compare exactly that).

`run_to_completion(scheduler, fake)` drives schedule -> fake.step -> update, checking the
scheduler's invariants after every step and the idle invariant at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxserve.engine import fake_model
from jaxserve.engine.fake_model import next_token
from jaxserve.scheduler import Scheduler, SeqEvent, StepPlan
from jaxserve.types import FinishReason, SamplingParams

__all__ = ["FakeModel", "RunResult", "expected_output", "next_token", "run_to_completion", "sample_seed",
           "step_once"]


def sample_seed(params: SamplingParams, sample_index: int) -> int:
    return (params.seed or 0) + sample_index


def expected_output(prompt: Iterable[int], params: SamplingParams, sample_index: int = 0,
                    eos_token_ids: Iterable[int] = (), max_model_len: int = 1 << 30,
                    vocab_size: int = 64) -> tuple[list[int], FinishReason]:
    """The tokens and finish reason an unpreempted, unaborted run must produce."""
    hist = list(prompt)
    eos = set(eos_token_ids)
    seed = sample_seed(params, sample_index)
    out: list[int] = []
    while True:
        t = next_token(hist, seed, vocab_size)
        hist.append(t)
        out.append(t)
        if (t in eos and not params.ignore_eos) or t in params.stop_token_ids:
            return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(hist) >= max_model_len:
            return out, FinishReason.LENGTH


class FakeModel(fake_model.FakeModel):
    @classmethod
    def for_scheduler(cls, sched: Scheduler, vocab_size: int = 64) -> FakeModel:
        def lookup(seq_id: int):
            seq = sched.get_sequence(seq_id)
            return seq.prompt_ids, sample_seed(seq.params, seq.sample_index)
        return cls(sched.config.page_size, vocab_size, lookup, num_pages=sched.config.num_pages,
                   window=sched.kv_window, sliding_window=sched.config.sliding_window)


@dataclasses.dataclass
class RunResult:
    outputs: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # seq id -> tokens
    finish: dict[int, FinishReason] = dataclasses.field(default_factory=dict)
    steps: int = 0
    plans: list[StepPlan] = dataclasses.field(default_factory=list)

    def record(self, events: Iterable[SeqEvent]) -> None:
        for e in events:
            assert e.seq_id not in self.finish, f"event for seq {e.seq_id} after it finished"
            if e.token_id is not None:
                self.outputs.setdefault(e.seq_id, []).append(e.token_id)
            if e.finished:
                self.finish[e.seq_id] = e.finish_reason


def step_once(sched: Scheduler, fake: FakeModel, result: RunResult | None = None,
              keep_plans: bool = False) -> tuple[StepPlan, list[SeqEvent]]:
    plan = sched.schedule()
    if sched.has_unfinished():
        assert plan.seqs, "scheduler stalled: unfinished work but an empty plan"
    events = sched.update(plan, fake.step(plan))
    pool = sched.page_pool
    for s in plan.seqs:
        for p in s.block_table:
            fake.max_refcount_seen = max(fake.max_refcount_seen, pool.refcount(p))
    sched.check_invariants()
    if result is not None:
        result.steps += 1
        result.record(events)
        if keep_plans:
            result.plans.append(plan)
    return plan, events


def run_to_completion(sched: Scheduler, fake: FakeModel, max_steps: int = 100_000,
                      keep_plans: bool = False, result: RunResult | None = None) -> RunResult:
    """Step until nothing is unfinished; the idle invariant must then hold."""
    result = result if result is not None else RunResult()
    start = result.steps
    while sched.has_unfinished():
        assert result.steps - start < max_steps, f"not finished after {max_steps} steps"
        step_once(sched, fake, result, keep_plans)
    sched.check_idle_invariant()
    return result
