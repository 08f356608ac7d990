"""What one step runs (`StepPlan`, made by `Scheduler.schedule`) and what came of it
(`SeqEvent`, returned by `Scheduler.update`).

The runner turns a `StepPlan` into one flat ragged token batch: each `ScheduledSeq` adds its
`token_ids` at positions `start_pos ...`, writes their K/V into the slots its `block_table`
names, and attends to positions `0 .. start_pos + len(token_ids) - 1`. Where `sample` is True
the logits of its last token are sampled and the token goes back in `update`'s `sampled` map.
With speculative decoding a decode also carries `draft_len` draft tokens at the end of
`token_ids`: the logits of its last draft_len + 1 tokens are all sampled, and `sampled` gets
the tokens speculation.accept keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxserve.types import FinishReason

if TYPE_CHECKING:
    from jaxserve.scheduler.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    token_ids: tuple[int, ...]  # a prefill chunk, or the one decode token (the last sampled one)
    start_pos: int  # position of token_ids[0] = tokens already in the cache before this step
    block_table: tuple[int, ...]  # exactly ceil((start_pos + len(token_ids)) / page_size) pages
    sample: bool  # after this step every token is computed: sample the next one
    draft_len: int = 0  # the last draft_len of token_ids are speculative drafts (sample is True)
    # The sliding layers' block table (window.py: a KV group of their own), as long as
    # block_table, the null page behind the window; () for one-group models.
    sliding_table: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.draft_len:]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    num_tokens: int  # sum of len(token_ids), <= max_num_batched_tokens
    preempted: tuple[int, ...]  # seq ids preempted (KV dropped) while making this plan

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def sampled_seq_ids(self) -> tuple[int, ...]:
        return tuple(s.seq_id for s in self.seqs if s.sample)


def with_drafts(plan: StepPlan, drafts: Mapping[int, tuple[int, ...]]) -> StepPlan:
    """`plan` with a draft model's tokens in the draft slots of the seqs `drafts` names (seq id ->
    exactly draft_len tokens); the rest as they were."""
    seqs = []
    for s in plan.seqs:
        d = drafts.get(s.seq_id)
        if d is not None:
            if len(d) != s.draft_len:
                raise ValueError(f"seq {s.seq_id}: {len(d)} draft tokens for {s.draft_len} draft slots")
            s = dataclasses.replace(s, token_ids=s.token_ids[:len(s.token_ids) - s.draft_len] + tuple(d))
        seqs.append(s)
    return dataclasses.replace(plan, seqs=tuple(seqs))


@dataclasses.dataclass(frozen=True)
class SeqEvent:
    seq_id: int
    request_id: str
    sample_index: int
    # A token sampled this step (one event per token, in order, when speculation keeps
    # several). `update` always sets it; None is for events an engine makes itself for ends
    # without a token (abort, stop string).
    token_id: int | None
    finished: bool
    finish_reason: FinishReason | None


class StepBuilder:
    """A plan under construction (scheduler-internal): chunk size by seq, the token budget left,
    the preempted ids. Token slices and block tables are read in `build`, once pages are final."""

    def __init__(self, budget: int, page_size: int):
        self.budget = budget
        self.page_size = page_size
        self.chunks: dict[int, tuple[Sequence, int]] = {}
        self.drafts: dict[int, list[int]] = {}
        self.preempted: list[int] = []

    def add(self, seq: Sequence, n: int) -> None:
        self.chunks[seq.seq_id] = (seq, n)
        self.budget -= n

    def add_draft(self, seq: Sequence, draft: list[int]) -> None:
        """Append speculative tokens after `seq`'s decode token (already added)."""
        self.drafts[seq.seq_id] = draft
        self.budget -= len(draft)

    def drop(self, seq: Sequence) -> None:
        """`seq` was preempted: give back its tokens if it was already in the plan."""
        entry = self.chunks.pop(seq.seq_id, None)
        if entry is not None:
            self.budget += entry[1] + len(self.drafts.pop(seq.seq_id, ()))
        self.preempted.append(seq.seq_id)

    def build(self) -> StepPlan:
        seqs = []
        for seq, n in self.chunks.values():
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            draft = tuple(self.drafts.get(seq.seq_id, ()))
            # A sequence can hold more pages than this chunk needs (after a discarded plan, or
            # drafts that were not kept); the runner gets exactly the ones it addresses.
            num_pages = -(-(end + len(draft)) // self.page_size)
            seqs.append(ScheduledSeq(
                seq_id=seq.seq_id, token_ids=seq.token_slice(start, end) + draft, start_pos=start,
                block_table=tuple(seq.pages[:num_pages]), sample=end == seq.num_tokens,
                draft_len=len(draft), sliding_table=tuple(seq.sliding_pages[:num_pages])))
        return StepPlan(seqs=tuple(seqs), num_tokens=sum(s.num_tokens for s in seqs),
                        preempted=tuple(self.preempted))
