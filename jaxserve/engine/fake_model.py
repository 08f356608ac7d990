"""The one hash-based fake model: next tokens computable by hand, and a paged KV "cache" that
checks every plan it is given the way a real runner depends on it.

Used by the scheduler tests (tests/fake_model.py drives a bare Scheduler with it) and by the
fake runner (server/fake_engine.py: the real Engine over this model, for the server tests and
`jaxserve serve --fake-model`).

Next token: h = (seed * 7919 + 17) mod 1_000_003, then h = (h * 131 + t + 1) mod 1_000_003 for
each token t of the whole history (order-sensitive, so a token at the wrong position changes
the result, and without the fixed points a plain sum has); the token is `token_of(h)`, by
default h % vocab_size. Who picks the seed and `token_of` is the caller's business (the
scheduler tests and the fake runner document theirs).

The KV cache is two flat int32 arrays of pages * page_size slots, the position and token each
slot holds (-1 = never written), so its memory is fixed however long a server runs. For every scheduled sequence
`write(plan)` checks:
  - `token_ids` are the sequence's tokens at `start_pos ...` (its record: prompt + tokens
    sampled so far), and `start_pos` equals the tokens it has already computed (0 after a
    preemption; a jump from 0 is allowed only for a shared prefix, which the read-back below
    then proves is really in the cache);
  - the context before `start_pos` must already be in its pages (written in earlier steps);
  - it writes each token into slot `pos % page_size` of page `block_table[pos // page_size]`
    (never the null page, never two writes to one slot in a step), then reads the whole
    history back from the pages and asserts it equals the sequence's tokens.
So a wrong block table, a wrong start_pos, a page shared while still written, or a page
reused while still held shows up as an AssertionError in the step where it matters.
With `sliding_window` (a model whose sliding layers are a KV group of their own,
scheduler/window.py) each plan row's `sliding_table` is checked the same way against a second
cache of its own, reading back only the window's history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from array import array

from jaxserve.scheduler.plan import StepPlan
from jaxserve.scheduler.speculation import accept

_MOD = 1_000_003


def history_hash(history: Iterable[int], seed: int) -> int:
    h = (seed * 7919 + 17) % _MOD
    for t in history:
        h = (h * 131 + t + 1) % _MOD
    return h


def next_token(history: Iterable[int], seed: int, vocab_size: int) -> int:
    """The default model's next token: the hash modulo the vocabulary."""
    return history_hash(history, seed) % vocab_size


@dataclasses.dataclass
class SeqRecord:
    tokens: list[int]  # prompt + tokens sampled so far for the sequence
    seed: int
    seen: int = 0  # tokens computed so far (the fake's idea of num_computed_tokens)


class FakeModel:
    """`lookup(seq_id) -> (prompt_ids, seed)` is asked the first time a seq id shows up (or the
    caller `register`s it). `token_of(hash) -> token id`: h % vocab_size unless given."""

    def __init__(self, page_size: int, vocab_size: int = 64,
                 lookup: Callable[[int], tuple[tuple[int, ...], int]] | None = None,
                 token_of: Callable[[int], int] | None = None, num_pages: int = 64,
                 window: int | None = None, sliding_window: int | None = None):
        self.page_size = page_size
        # A sliding window whose pages the scheduler frees (scheduler/window.py): only the last
        # `window` positions before a chunk must be readable, the null page may stand before.
        self.window = window
        self.vocab_size = vocab_size
        self.lookup = lookup
        self.token_of = token_of or (lambda h: h % vocab_size)
        # Grown on demand when a plan names a page past the end (the scheduler tests do not
        # say how many pages their pool has).
        self.kv_pos = array("i", [-1]) * (num_pages * page_size)
        self.kv_tok = array("i", [-1]) * (num_pages * page_size)
        # The sliding group's cache (positions, tokens), grown on demand like the other.
        self.sliding_window = sliding_window
        self.s_pos, self.s_tok = array("i"), array("i")
        self.seqs: dict[int, SeqRecord] = {}
        self.max_refcount_seen = 0  # tests of prefix sharing look at this via the driver
        self.drafts_kept = 0  # speculative decoding: draft tokens this fake agreed with

    def next_token(self, history: Iterable[int], seed: int) -> int:
        return self.token_of(history_hash(history, seed))

    def register(self, seq_id: int, prompt_ids: Iterable[int], seed: int) -> None:
        self.seqs[seq_id] = SeqRecord(list(prompt_ids), seed)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop ended sequences' records (their pages' KV stays, for prefix matches)."""
        for sid in seq_ids:
            self.seqs.pop(sid, None)

    def clear_cache(self) -> None:
        """The KV cache was lost: nothing is computed any more."""
        self.kv_pos = array("i", [-1]) * len(self.kv_pos)
        self.kv_tok = array("i", [-1]) * len(self.kv_tok)
        self.s_pos, self.s_tok = array("i"), array("i")
        for rec in self.seqs.values():
            rec.seen = 0

    def step(self, plan: StepPlan) -> dict[int, int | list[int]]:
        """`write(plan)`, then answer each sampled seq with its token, or for a run with drafts
        with the tokens speculation.accept keeps given this fake's predictions after each of the
        run's tokens."""
        self.write(plan)
        sampled: dict[int, int | list[int]] = {}
        for s in plan.seqs:
            rec = self.seqs[s.seq_id]
            end = s.start_pos + len(s.token_ids) - s.draft_len
            if s.sample and s.draft_len == 0:
                t = self.next_token(rec.tokens[:end], rec.seed)
                rec.tokens.append(t)
                sampled[s.seq_id] = t
            elif s.sample:
                draft = list(s.draft)
                predicted = [self.next_token(rec.tokens[:end] + draft[:j], rec.seed)
                             for j in range(len(draft) + 1)]
                kept = accept(draft, predicted)
                rec.tokens += kept
                rec.seen += len(kept) - 1  # the kept drafts' KV is right where it was written
                self.drafts_kept += len(kept) - 1
                sampled[s.seq_id] = kept
        return sampled

    def write(self, plan: StepPlan) -> None:
        """Check the plan against the records, write its KV and read every history back."""
        ps = self.page_size
        for sid in plan.preempted:
            if sid in self.seqs:
                self.seqs[sid].seen = 0
        assert plan.num_tokens == sum(len(s.token_ids) for s in plan.seqs), "plan.num_tokens"
        assert len({s.seq_id for s in plan.seqs}) == len(plan.seqs), "a seq scheduled twice"
        written: set[int] = set()
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
            assert tuple(rec.tokens[start:end]) == tuple(s.token_ids[:end - start]), f"seq {s.seq_id}: wrong token_ids"
            assert len(s.block_table) == -(-(end + s.draft_len) // ps), (
                f"seq {s.seq_id}: {len(s.block_table)} pages for {end + s.draft_len} tokens")
            assert self.sliding_window is None or len(s.sliding_table) == len(s.block_table), (
                f"seq {s.seq_id}: sliding table {s.sliding_table} for block table {s.block_table}")
            assert s.sample == (end == len(rec.tokens)), f"seq {s.seq_id}: wrong sample flag"
            for table, window, kv, name in self._stores(s):
                live = table[_first_visible(window, start) // ps:]
                assert 0 not in live, f"seq {s.seq_id}: null page in {name}block table"
                assert len(set(live)) == len(live), f"seq {s.seq_id}: {name}page twice"
                # The context before start_pos must be in the cache from earlier steps: a plan
                # must not rely on another sequence writing it in this same step.
                self._check_history(s, rec, table, kv, _first_visible(window, start), start,
                                    f"{name}pages before this step")
        s_written: set[int] = set()
        for s in plan.seqs:
            rec = self.seqs[s.seq_id]
            for (table, _, kv, name), done in zip(self._stores(s), (written, s_written)):
                _grow(kv, (max(table) + 1) * ps)  # freed window pages are the null page, 0
                for pos, tok in enumerate(s.token_ids, start=s.start_pos):
                    i = table[pos // ps] * ps + pos % ps
                    assert i not in done, f"seq {s.seq_id}: {name}slot {divmod(i, ps)} written twice in one step"
                    done.add(i)
                    kv[0][i] = pos
                    kv[1][i] = tok
            rec.seen = s.start_pos + len(s.token_ids) - s.draft_len
        # Read everything back after all writes (attention runs after the cache update in every
        # layer): catches a write into a page another sequence still reads.
        for s in plan.seqs:
            rec = self.seqs[s.seq_id]
            end = s.start_pos + len(s.token_ids) - s.draft_len
            for table, window, kv, name in self._stores(s):
                self._check_history(s, rec, table, kv, _first_visible(window, s.start_pos), end,
                                    f"{name}pages after this step's writes")

    def _stores(self, s):
        """(block table, window, (positions, tokens) cache, name) of each KV group of row `s`."""
        out = [(s.block_table, self.window, (self.kv_pos, self.kv_tok), "")]
        if self.sliding_window is not None:
            out.append((s.sliding_table, self.sliding_window, (self.s_pos, self.s_tok), "sliding "))
        return out

    def _check_history(self, s, rec: SeqRecord, bt, kv, lo: int, hi: int, when: str) -> None:
        ps, (kp, kt), toks = self.page_size, kv, rec.tokens
        n = len(kp)
        for pos in range(lo, hi):
            i = bt[pos // ps] * ps + pos % ps
            assert i < n and kp[i] == pos and kt[i] == toks[pos], (
                f"seq {s.seq_id}: KV read back from its {when} differs from its tokens (position {pos})")


def _first_visible(window: int | None, start: int) -> int:
    """The first position a chunk starting at `start` attends to."""
    return 0 if window is None else max(0, start - window + 1)


def _grow(kv: tuple[array, array], slots: int) -> None:
    kp, kt = kv
    if slots > len(kp):
        extra = array("i", [-1]) * (max(slots, 2 * len(kp)) - len(kp))
        kp.extend(extra)
        kt.extend(extra)
