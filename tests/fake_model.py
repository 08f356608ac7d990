"""A fake model whose next token is computable by hand, and a driver loop around a Scheduler.

The fake keeps its own paged KV "cache": a dict from (page, slot) to (position, token). For
every scheduled sequence it checks the plan the way a real runner would depend on it:
  - `token_ids` are the sequence's tokens at `start_pos ...` (its own record: prompt + the
    tokens it sampled for that sequence), and `start_pos` equals the tokens it has already
    computed for it (0 after a preemption; a jump from 0 is allowed only for a shared prefix,
    which the read-back below then proves is really in the cache);
  - the context before `start_pos` must already be in its pages (written in earlier steps);
  - it writes each token into slot `pos % page_size` of page `block_table[pos // page_size]`
    (never the null page, never two writes to one slot in a step), then reads the whole
    history back from the pages and asserts it equals the sequence's tokens.
So a wrong block table, a wrong start_pos, a page shared while still written, or a page
reused while still held shows up as an AssertionError in the step where it matters.

Next token: h = seed * 7919 + 17, then h = (h * 131 + t + 1) % 1_000_003 for each token t of
the history; the token is h % vocab_size. seed = `(params.seed or 0) + sample_index`, so sample
i of a request with seed s equals a single-sample request with seed s + i (the n > 1 tests
compare exactly that).

`run_to_completion(scheduler, fake)` drives schedule -> fake.step -> update, checking the
scheduler's invariants after every step and the idle invariant at the end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from jaxserve.scheduler import Scheduler, SeqEvent, StepPlan
from jaxserve.scheduler.speculation import accept
from jaxserve.types import FinishReason, SamplingParams


def next_token(history: Iterable[int], seed: int, vocab_size: int) -> int:
    # A polynomial hash of the whole history: order-sensitive (a token at the wrong position
    # changes the result) and without the fixed points a plain sum has.
    h = seed * 7919 + 17
    for t in history:
        h = (h * 131 + t + 1) % 1_000_003
    return h % vocab_size


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


@dataclasses.dataclass
class _SeqRecord:
    tokens: list[int]  # prompt + tokens this fake sampled for the sequence
    seed: int
    seen: int = 0  # tokens computed so far (the fake's idea of num_computed_tokens)


class FakeModel:
    """`lookup(seq_id) -> (prompt_ids, seed)` is asked the first time a seq id shows up."""

    def __init__(self, page_size: int, vocab_size: int = 64,
                 lookup: Callable[[int], tuple[tuple[int, ...], int]] | None = None,
                 window: int | None = None):
        self.page_size = page_size
        # A sliding window whose pages the scheduler frees (scheduler/window.py): only the last
        # `window` positions before a chunk must be readable, the null page may stand before.
        self.window = window
        self.vocab_size = vocab_size
        self.lookup = lookup
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (page, slot) -> (pos, token)
        self.seqs: dict[int, _SeqRecord] = {}
        self.max_refcount_seen = 0  # tests of prefix sharing look at this via the driver
        self.drafts_kept = 0  # speculative decoding: draft tokens this fake agreed with

    @classmethod
    def for_scheduler(cls, sched: Scheduler, vocab_size: int = 64) -> FakeModel:
        def lookup(seq_id: int):
            seq = sched.get_sequence(seq_id)
            return seq.prompt_ids, sample_seed(seq.params, seq.sample_index)
        return cls(sched.config.page_size, vocab_size, lookup, window=sched.kv_window)

    def register(self, seq_id: int, prompt_ids: Iterable[int], seed: int) -> None:
        self.seqs[seq_id] = _SeqRecord(list(prompt_ids), seed)

    def step(self, plan: StepPlan) -> dict[int, int | list[int]]:
        """Check the plan against the fake's records, write its KV, and answer each sampled
        seq with its token, or for a run with drafts with the tokens speculation.accept keeps
        given this fake's predictions after each of the run's tokens."""
        ps = self.page_size
        for sid in plan.preempted:
            if sid in self.seqs:
                self.seqs[sid].seen = 0
        assert plan.num_tokens == sum(len(s.token_ids) for s in plan.seqs), "plan.num_tokens"
        assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs), "a seq scheduled twice"
        written: set[tuple[int, int]] = set()
        sampled: dict[int, int | list[int]] = {}
        for s in plan.seqs:
            if s.seq_id not in self.seqs:
                assert self.lookup is not None, f"unknown seq {s.seq_id}"
                self.register(s.seq_id, *self.lookup(s.seq_id))
            rec = self.seqs[s.seq_id]
            start, end = s.start_pos, s.start_pos + len(s.token_ids) - s.draft_len  # drafts after end
            assert s.token_ids, f"seq {s.seq_id}: empty chunk"
            assert s.draft_len == 0 or (s.sample and end - start == 1), f"seq {s.seq_id}: drafts off a decode"
            assert start == rec.seen or (rec.seen == 0 and start % ps == 0), (
                f"seq {s.seq_id}: start_pos {s.start_pos}, but {rec.seen} tokens were computed")
            assert end <= len(rec.tokens), f"seq {s.seq_id}: chunk past the known tokens"
            assert tuple(rec.tokens[start:end]) == s.token_ids[:end - start], f"seq {s.seq_id}: wrong token_ids"
            assert len(s.block_table) == -(-(end + s.draft_len) // ps), (
                f"seq {s.seq_id}: {len(s.block_table)} pages for {end + s.draft_len} tokens")
            live = s.block_table[self._first_visible(start) // ps:]
            assert 0 not in live, f"seq {s.seq_id}: null page in block table"
            assert len(set(live)) == len(live), f"seq {s.seq_id}: page twice"
            assert s.sample == (end == len(rec.tokens)), f"seq {s.seq_id}: wrong sample flag"
            # The context before start_pos must be in the cache from earlier steps: a plan must
            # not rely on another sequence writing it in this same step.
            self._check_history(s, rec, self._first_visible(start), start, "before this step")
        for s in plan.seqs:
            rec = self.seqs[s.seq_id]
            for pos, tok in enumerate(s.token_ids, start=s.start_pos):
                key = (s.block_table[pos // ps], pos % ps)
                assert key not in written, f"seq {s.seq_id}: slot {key} written twice in one step"
                written.add(key)
                self.kv[key] = (pos, tok)
            rec.seen = s.start_pos + len(s.token_ids) - s.draft_len
        # Read everything back after all writes (attention runs after the cache update in every
        # layer): catches a write into a page another sequence still reads.
        for s in plan.seqs:
            rec = self.seqs[s.seq_id]
            end = s.start_pos + len(s.token_ids) - s.draft_len
            self._check_history(s, rec, self._first_visible(s.start_pos), end, "after this step's writes")
            if s.sample and s.draft_len == 0:
                t = next_token(rec.tokens[:end], rec.seed, self.vocab_size)
                rec.tokens.append(t)
                sampled[s.seq_id] = t
            elif s.sample:
                draft = list(s.draft)
                predicted = [next_token(rec.tokens[:end] + draft[:j], rec.seed, self.vocab_size)
                             for j in range(len(draft) + 1)]
                kept = accept(draft, predicted)
                rec.tokens += kept
                rec.seen += len(kept) - 1  # the kept drafts' KV is right where it was written
                self.drafts_kept += len(kept) - 1
                sampled[s.seq_id] = kept
        return sampled

    def _first_visible(self, start: int) -> int:
        """The first position a chunk starting at `start` attends to."""
        return 0 if self.window is None else max(0, start - self.window + 1)

    def _check_history(self, s, rec: _SeqRecord, lo: int, hi: int, when: str) -> None:
        ps = self.page_size
        got = [self.kv.get((s.block_table[pos // ps], pos % ps)) for pos in range(lo, hi)]
        want = [(pos, rec.tokens[pos]) for pos in range(lo, hi)]
        assert got == want, (f"seq {s.seq_id}: KV read back from its pages {when} differs "
                             f"from its tokens")


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
