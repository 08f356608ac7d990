"""Draft tokens for speculative decoding by n-gram lookup ("prompt lookup decoding"), or draft
slots a draft model fills in the step (engine/self_draft.py).

A decode proposes the tokens that followed the last place its own history (prompt and
outputs) repeated its latest n tokens; the step then runs the decode token and the drafts as
one short run and verifies them on device: a greedy row keeps the longest prefix of drafts the
model's argmax agrees with plus the model's own next token (see `accept`), a sampled row keeps
each draft x with probability p(x) and otherwise draws from p without x
(model/rejection_sampler.verify_slots). The output is what one token per step would give (the
same tokens for greedy rows, the same distribution for sampled ones); only the number of steps
changes. N-gram lookup needs no draft model: its cost is the wider step, which is nearly free
while decode is memory-bound, and it pays off when text repeats itself (quoting the prompt,
code edits, lists; or a small model looping).

Pure host Python, no jax: the scheduler calls it while it plans a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jaxserve.types import SamplingParams

if TYPE_CHECKING:
    from jaxserve.scheduler.plan import StepBuilder
    from jaxserve.scheduler.scheduler import Scheduler
    from jaxserve.scheduler.sequence import Sequence as Seq

# Adaptive draft length (DraftControl). A run that kept every draft doubles the next one's
# length (text that repeats tends to go on repeating); a run that kept some sets it to the kept
# count plus one; a run that kept none halves it. After MISSES_TO_PAUSE such runs in a row the
# sequence stops drafting for `pause` of its own tokens, and then retries with one draft; each
# pause that ends in another miss doubles the next, up to PAUSE_MAX, and a kept draft resets it.
# Drafts that fail cost a wider step (a larger bucket when many rows draft); these rules keep
# that cost near zero on text that does not repeat while keeping the gain where it does.
MISSES_TO_PAUSE = 3
# With a draft model (SchedulerConfig.drafts_from_model) the scheduler plans a decode's k draft slots with this
# token; the runner drafts the real ones in the step and the engine hands them back
# (Scheduler.fill_drafts) before update checks them.
DRAFT_PLACEHOLDER = 0
PAUSE_MIN = 8
PAUSE_MAX = 128


def propose(tokens: Sequence[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to `k` tokens to follow `tokens`: find the most recent earlier occurrence of the
    longest suffix of `tokens` with ngram_min <= length <= ngram_max, and copy what followed
    it. Where the copy runs into the end of `tokens`, it continues with its own tokens (a
    repeating pattern of period p keeps predicting itself). [] if no suffix recurs."""
    n = len(tokens)
    if k <= 0 or n < ngram_min + 1:
        return []
    last = tokens[-1]
    best_at, best_len = -1, 0
    # Candidates: earlier positions i holding the last token, most recent first.
    for i in range(n - 2, -1, -1):
        if tokens[i] != last:
            continue
        m = 1
        while m < ngram_max and i - m >= 0 and tokens[i - m] == tokens[n - 1 - m]:
            m += 1
        if m > best_len:
            best_at, best_len = i, m
            if m == ngram_max:
                break
    if best_len < ngram_min:
        return []
    draft: list[int] = []
    src = best_at + 1
    for t in range(k):
        j = src + t
        draft.append(tokens[j] if j < n else draft[j - n])
    return draft


def accept(draft: Sequence[int], predicted: Sequence[int]) -> list[int]:
    """The tokens a verified run yields: `predicted[j]` is the model's (greedy) token after
    the run's token j (the decode token, then the drafts), so len(predicted) = len(draft) + 1.
    Drafts are kept while the model agrees; the first disagreement, or the end, adds the
    model's own token. Returns 1 .. len(draft) + 1 tokens."""
    out = []
    for d, p in zip(draft, predicted):
        out.append(p)
        if p != d:
            return out
    out.append(predicted[len(draft)])
    return out


@dataclasses.dataclass
class DraftControl:
    """One sequence's draft length from its recent acceptance (rules above). `limit` is the
    most drafts its next decode may carry; `record` takes what a verified run kept. The clock
    is the sequence's own output length, so a replay (or another process of a multi-process
    job) makes the same choices."""
    k_max: int
    k: int = 0  # the next run's length; 0 until first used = k_max
    misses: int = 0  # consecutive verified runs that kept no draft
    pause: int = PAUSE_MIN
    paused_until: int = 0  # no drafts while the sequence has fewer output tokens than this

    def __post_init__(self):
        self.k = self.k or self.k_max

    def limit(self, num_output_tokens: int) -> int:
        return 0 if num_output_tokens < self.paused_until else self.k

    def record(self, drafted: int, kept: int, num_output_tokens: int) -> None:
        if drafted <= 0:
            return
        if kept >= drafted:
            self.k, self.misses, self.pause = min(self.k_max, 2 * self.k), 0, PAUSE_MIN
        elif kept > 0:
            self.k, self.misses, self.pause = min(self.k_max, kept + 1), 0, PAUSE_MIN
        else:
            self.k = max(1, self.k // 2)
            self.misses += 1
            if self.misses >= MISSES_TO_PAUSE:
                self.paused_until = num_output_tokens + self.pause
                self.pause = min(PAUSE_MAX, 2 * self.pause)
                self.misses = MISSES_TO_PAUSE - 1  # after the pause, one more miss pauses again
                self.k = 1


def speculates(params: SamplingParams, model_drafts: bool = False) -> bool:
    """Greedy and sampled requests speculate: the step verifies drafts by the rejection rule
    (model/rejection_sampler.py), which keeps a sampled request's output law exactly the
    target's, and for greedy requests is the argmax check. Structured outputs too with n-gram
    drafts: the engine walks a copy of the grammar through the drafts and masks each draft slot
    with the state before it (a draft the grammar refuses has p = 0 there and is refused). Not
    with a draft model (its drafts are drawn on device, where the grammar is not), nor penalised
    requests (their logits would depend on the drafts before them), min_tokens or logit_bias (the
    draft slots' logits are not biased)."""
    return (not params.has_penalties and (params.structured_outputs is None or not model_drafts)
            and params.min_tokens == 0 and params.logit_bias is None)


def plan_drafts(sched: Scheduler, decodes: list[Seq], b: StepBuilder) -> None:
    """Speculative tokens for this step's decodes that speculate (Scheduler.schedule's last stage), from
    the budget everything else left and only from free pages (of every KV group): a draft
    never preempts."""
    from jaxserve.scheduler.sequence import SeqStatus
    cfg = sched.config
    if cfg.num_speculative_tokens == 0:
        return
    model_drafts = cfg.drafts_from_model
    for seq in decodes:
        if (seq.status is not SeqStatus.RUNNING or seq.seq_id not in b.chunks
                or not speculates(seq.params, model_drafts)):
            continue
        if seq.drafts is None:
            seq.drafts = DraftControl(cfg.num_speculative_tokens)
        wanted = seq.drafts.limit(len(seq.output_ids)) if cfg.adaptive_speculation else cfg.num_speculative_tokens
        k = min(wanted, b.budget, seq.params.max_tokens - len(seq.output_ids) - 1,
                cfg.max_model_len - seq.num_tokens)
        if k <= 0:
            continue
        if not sched._can_allocate(sched._pages_short(seq, seq.num_tokens + k)):
            k = min(k, len(seq.pages) * cfg.page_size - seq.num_tokens)  # the slots it holds
        if model_drafts:  # a draft model drafts in the step: k slots to fill
            draft = [DRAFT_PLACEHOLDER] * k
        else:
            draft = propose(seq.all_token_ids, k, cfg.ngram_max, cfg.ngram_min)
        if draft:
            sched._extend(seq, sched._pages_short(seq, seq.num_tokens + len(draft)))
            b.add_draft(seq, draft)
