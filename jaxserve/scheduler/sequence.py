"""One sample stream of a request, as the scheduler tracks it.

A request with `n` samples becomes `n` `Sequence`s that share the request id and differ in
`sample_index`. A sequence's tokens are its prompt followed by its outputs; the first
`num_computed_tokens` of them have K/V in the pages of `pages` (its block table: token at
position `i` lives in slot `i % page_size` of page `pages[i // page_size]`).

Life cycle: WAITING -> RUNNING -> FINISHED, with RUNNING -> WAITING on preemption (pages
freed, `num_computed_tokens` back to 0, outputs kept so the re-prefill recomputes the same
history, or re-matches the pages it left in the prefix cache). A WAITING sequence never holds
pages.
"""

from __future__ import annotations

import dataclasses
import enum

from jaxserve.scheduler.speculation import DraftControl
from jaxserve.types import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity semantics: two sequences are never "equal"
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_index: int  # order of add_request calls; the FCFS key
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    # The sliding layers' block table when they are a KV group of their own (window.py): the
    # same length and positions as `pages`, pages from the sliding pool, the null page behind
    # the window. Empty for one-group models.
    sliding_pages: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # Prefix sharing (n > 1): a follower waits for `share_from` (its request's leader) to compute
    # the first `shared_len` prompt tokens, then holds those pages too. None once attached, when
    # there is nothing to share, or after a preemption (a preempted follower recomputes alone).
    share_from: Sequence | None = None
    shared_len: int = 0
    # Prefix caching (prefix_cache.py): the root of this sequence's page hashes (None = its pages
    # are never hashed), the hashes of its full pages so far (tokens never change, so they
    # survive preemption), how many of `pages` were offered to the cache, and the prompt
    # tokens found cached at its first admission (None until admitted).
    hash_root: bytes | None = None
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_hashed_pages: int = 0
    num_cached_tokens: int | None = None
    # Speculative decoding: this sequence's adaptive draft length (speculation.DraftControl),
    # made at its first draft; kept across preemption (it is about the text, not the cache).
    drafts: DraftControl | None = None
    # Scheduling policy inputs (policy.py): the request's priority (lower first), the scheduler
    # step it arrived in (aging), and its tenant (fair sharing, quotas).
    request_priority: int = 0
    arrival_step: int = 0
    tenant: str = ""
    # Sort key of the waiting and running lists, kept current by the scheduler (policy.sort_key).
    priority: tuple = (1, 0, 0, 0)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.output_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + outputs without building the whole history."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return tuple(self.output_ids[start - p:end - p])
        return self.prompt_ids[start:] + tuple(self.output_ids[:end - p])

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def set_priority(self, key: tuple) -> None:
        self.priority = key

    def stop_reason(self, token: int, max_model_len: int) -> FinishReason | None:
        """Why the sequence ends now that `token` is its last output, or None.

        A natural stop (EOS unless ignore_eos, or a stop token id) wins over a length cap
        reached by the same token."""
        params = self.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return FinishReason.STOP
        if len(self.output_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
