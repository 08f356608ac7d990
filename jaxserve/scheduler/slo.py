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


def tokens_within(model: StepCostModel, seconds: float, floor: int) -> int | None:
    """The largest bucket whose modelled step time is at most `seconds` (at least `floor`, the
    tokens the running decodes need); None while nothing is measured."""
    if not model.mean:
        return None
    fits = [b for b in model.buckets if (model.cost(b) or 0.0) <= seconds]
    return max(max(fits, default=floor), floor)


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
        """Hold the TPOT target: cap the step's tokens (prefill chunks) at what the cost model
        says fits in tpot_s, never below one token per running decode."""
        if self.tpot_s is not None:
            scheduler.step_token_cap = tokens_within(self.model, self.tpot_s, scheduler.num_running)

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
