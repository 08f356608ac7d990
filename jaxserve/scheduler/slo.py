"""SLO-aware admission: predict a new request's TTFT from the scheduler's state and a step-cost
model, so a request that would miss its TTFT target is refused at once (with a retry hint)
instead of being admitted to fail late. Off unless the server gets --slo-ttft-ms.

Step-cost model (`StepCostModel`): the runner pads every step to a token bucket, so a step's
time is a function of its bucket; the model keeps, per bucket, an exponentially weighted mean
of measured step times (the engine loop feeds it every step; `observe` can also be fed at
warm-up). A bucket never measured is interpolated linearly in tokens from the measured ones (above
the largest measured: proportional to the tokens).
No prediction (None) until at least one bucket is measured.

TTFT prediction (`predict_ttft`): the engine schedules decodes first (one token each), then
prefill chunks in order, under `max_num_batched_tokens` per step. A new request, which ranks
after everything waiting (FCFS), gets its first token once the prefill tokens ahead of it
(running prefills' remainders + waiting sequences' uncomputed tokens) and its own prompt are
through, at `budget - decodes` prefill tokens per step. So

    steps = ceil((tokens_ahead + prompt) / max(1, budget - decodes))
    TTFT  = waited so far + steps * cost(bucket of min(budget, decodes + prefill tokens))

It assumes the decode count stays as it is and that slots and KV pages do not bind (then the
real TTFT is longer: the prediction is a lower bound there, so what it refuses would miss
anyway). tests/test_slo.py checks it within 10% of a simulated run.

TPOT target (`--slo-tpot-ms`, `SloAdmission.size_steps`, before every step): a running request
gets one token per step, so its TPOT is the mean time of the steps it is in; holding every
step under the target holds TPOT. Two caps on the scheduler, from the cost model:
  - `step_token_cap`: the step's tokens (prefill chunks shrink; each running decode still gets
    its token, so a step is never cut below the running batch);
  - `running_cap`: the decode batch. A waiting request is admitted only while the running
    batch plus it stays within the largest step the model says fits (`rows_within`). Nothing
    running is ever preempted for the target: if the model learns that steps are slower than
    it thought, the batch shrinks as requests finish.
"Fits" is judged pessimistically where nothing was measured: before the first measured step
the cap is one request (the first step measures the cost); above the largest measured bucket
a step's time is taken as proportional to its tokens (an over-estimate when a step has a fixed
cost), so the batch grows one bucket beyond what was measured at a time, each step measuring
the next. A request that does not fit waits in the scheduler's queue (it is not refused for
TPOT): the cap trades queueing (TTFT) for TPOT. With --slo-ttft-ms too, the TTFT prediction
uses the capped step budget but not the wait for a batch slot, so it stays a lower bound and
refuses only what would miss anyway. The model is per token bucket: a decode step at long
contexts (KV reads per row) can cost more than a prefill chunk of the same bucket, which the
running mean of that bucket averages over.
"""

from __future__ import annotations

import bisect
import math

from jaxserve.scheduler.sequence import SeqStatus


class StepCostModel:
    def __init__(self, buckets: tuple[int, ...], alpha: float = 0.2):
        self.buckets = tuple(buckets)
        self.alpha = alpha  # weight of the newest sample
        self.mean: dict[int, float] = {}

    def bucket_for(self, tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, max(1, tokens))
        return self.buckets[min(i, len(self.buckets) - 1)]

    def observe(self, tokens: int, seconds: float) -> None:
        b = self.bucket_for(tokens)
        old = self.mean.get(b)
        self.mean[b] = seconds if old is None else old + self.alpha * (seconds - old)

    def cost(self, tokens: int) -> float | None:
        b = self.bucket_for(tokens)
        if b in self.mean:
            return self.mean[b]
        known = sorted(self.mean)
        if not known:
            return None
        if len(known) == 1:
            return self.mean[known[0]]
        if b > known[-1]:  # beyond what was measured: time proportional to the tokens
            return self.mean[known[-1]] * b / known[-1]
        if b < known[0]:
            return self.mean[known[0]]
        lo = max(k for k in known if k < b)
        hi = min(k for k in known if k > b)
        return self.mean[lo] + (self.mean[hi] - self.mean[lo]) * (b - lo) / (hi - lo)


def queue_state(scheduler) -> tuple[int, int]:
    """(prefill tokens ahead of a new arrival, running decodes) of a Scheduler, read on the
    thread that steps it."""
    decodes, ahead = 0, 0
    for seq in scheduler._running:
        if seq.num_uncomputed_tokens <= 1:
            decodes += 1
        else:
            ahead += seq.num_uncomputed_tokens
    for seq in scheduler._waiting:
        if seq.status is SeqStatus.WAITING:
            ahead += seq.num_uncomputed_tokens
    return ahead, decodes


def predict_ttft(model: StepCostModel, budget: int, tokens_ahead: int, decodes: int,
                 prompt_tokens: int, waited_s: float = 0.0) -> float | None:
    per_step = max(1, budget - decodes)
    steps = math.ceil((tokens_ahead + prompt_tokens) / per_step)
    cost = model.cost(min(budget, decodes + min(per_step, tokens_ahead + prompt_tokens)))
    return None if cost is None else waited_s + steps * cost


def step_upper_cost(model: StepCostModel, tokens: int) -> float | None:
    """The model's cost for a step of `tokens`, but proportional to the tokens above the largest
    measured bucket whatever else is known (what `cost` does only with two buckets measured):
    an over-estimate for a step with a fixed cost, so a cap from it errs towards fitting."""
    if not model.mean:
        return None
    top = max(model.mean)
    b = model.bucket_for(tokens)
    return model.mean[top] * b / top if b > top else model.cost(b)


def _fitting_buckets(model: StepCostModel, seconds: float) -> list[int]:
    """Buckets whose step `step_upper_cost` puts within `seconds`, looking at most one bucket
    beyond the largest measured (the next step measures it)."""
    top = max(model.mean)
    reach = [b for b in model.buckets if b <= top] + [b for b in model.buckets if b > top][:1]
    return [b for b in reach if step_upper_cost(model, b) <= seconds]


def tokens_within(model: StepCostModel, seconds: float, floor: int) -> int | None:
    """The largest bucket that fits `seconds` (at least `floor`, the tokens the running decodes
    need); None while nothing is measured."""
    if not model.mean:
        return None
    return max(max(_fitting_buckets(model, seconds), default=floor), floor)


def rows_within(model: StepCostModel, seconds: float) -> int:
    """The most running requests whose decode step (one token each: the bucket of that many
    tokens) fits `seconds`; 1 while nothing is measured (the first step measures)."""
    if not model.mean:
        return 1
    return max(_fitting_buckets(model, seconds), default=1)


class SloAdmission:
    """The engine thread's check before a request enters the scheduler (server/engine_loop.py):
    refuse what would miss `ttft_s`, learning step costs from every step it is told about."""

    def __init__(self, ttft_s: float | None, buckets: tuple[int, ...], budget: int,
                 tpot_s: float | None = None):
        self.ttft_s = ttft_s
        self.tpot_s = tpot_s
        self.budget = budget
        self.model = StepCostModel(buckets)

    def observe_step(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.model.observe(tokens, seconds)

    def size_steps(self, scheduler) -> None:
        """Hold the TPOT target (module docstring): cap the step's tokens (prefill chunks) and
        the decode batch at what the cost model says fits in tpot_s; a step never drops below
        one token per running decode, and nothing running is preempted."""
        if self.tpot_s is not None:
            scheduler.step_token_cap = tokens_within(self.model, self.tpot_s, scheduler.num_running)
            scheduler.running_cap = rows_within(self.model, self.tpot_s)

    def refusal(self, scheduler, prompt_tokens: int, waited_s: float) -> tuple[str, float] | None:
        """(message, retry-after seconds) if the request would miss the target, else None."""
        if self.ttft_s is None:
            return None
        cap = scheduler.step_token_cap
        budget = self.budget if cap is None else min(self.budget, cap)
        ahead, decodes = queue_state(scheduler)
        pred = predict_ttft(self.model, budget, ahead, decodes, prompt_tokens, waited_s)
        if pred is None or pred <= self.ttft_s:
            return None
        retry = pred - self.ttft_s  # roughly when the work ahead of it has gone
        return (f"predicted time to first token {pred * 1000:.0f} ms (waited {waited_s * 1000:.0f} ms, "
                f"{ahead} prompt tokens queued ahead) exceeds slo_ttft_ms={self.ttft_s * 1000:g}; "
                f"retry after {retry:.1f} s", retry)
