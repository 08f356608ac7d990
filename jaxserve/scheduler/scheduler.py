"""Iteration-level continuous batching over a paged KV cache (pure host Python).

Data flow, once per engine step (single-threaded; the engine calls everything between steps):

    add_request ──> waiting ──schedule()──> running ──update(plan, sampled)──> finished
                       ^                       │
                       └──── preemption ───────┘

`schedule()` builds a `StepPlan` under two budgets, `max_num_seqs` running sequences and
`max_num_batched_tokens` tokens:
  1. every RUNNING decode (one token: the last sampled one),
  2. RUNNING sequences still prefilling, each chunk cut to the tokens left in the budget,
  3. WAITING sequences in priority order while budget, a sequence slot and the pages for their
     first chunk are all there. It stops at the first sequence that does not fit (strict
     order, so a large request is not overtaken forever by small ones). Under
     scheduling_policy="priority" that sequence first preempts running ones ranked below it
     (policy.py); under "fcfs" (the default) admission never preempts. With fair_share the
     order interleaves tenants by the tokens each was given (policy.FairShare).
     Nothing is admitted in a step that preempted, so a victim is not re-admitted at once.
  4. with speculative decoding (num_speculative_tokens > 0), draft tokens for the decodes that
     speculate (speculation.py) from whatever budget and free pages are left: speculation is optional
     work and never delays a prefill, an admission or another decode, nor preempts. `update`
     keeps the drafts the step's verify kept, so a sequence can gain several tokens a step.
So a long prompt delays the running decodes by at most one chunk.

Before a sequence's tokens are scheduled its block table grows to cover them. If the pool is
short, the lowest-priority RUNNING sequence is preempted by recompute: its pages are freed,
`num_computed_tokens` goes to 0, its outputs are kept (it re-prefills prompt + outputs, so
its tokens are identical to a run without preemption) and it re-enters the waiting list,
whose order puts it ahead of every newer arrival. If the sequence asking is itself the lowest
priority it preempts itself instead of anyone above it.

Priority (the sort key of both lists, `Sequence.priority`, made by policy.sort_key):
    (0 if num_preemptions >= max_preemptions_per_request else 1, effective priority,
     arrival_index, sample_index)
the effective priority being 0 under "fcfs" and the request's priority less its aging under
"priority". Below, "FCFS" reads "in key order". So FCFS by arrival, except that a sequence preempted `max_preemptions_per_request` times is
protected: it outranks every unprotected one. Consequences:
  - The highest-priority running sequence is never a victim and, since admission made sure one
    sample alone fits the pool, always gets its pages: it progresses every step, so nothing
    starves.
  - An unprotected sequence is preempted at most `max_preemptions_per_request` times; after
    that only older protected sequences can preempt it (aging).
This differs from "preempt the most recently admitted": a re-admitted old request is not the
next victim, so two requests cannot ping-pong each other's KV out.

Prefix caching (prefix_cache.py, on unless `enable_prefix_caching` is False): a sequence's
full computed pages are registered under a chained content hash after every step; admission
matches a waiting sequence's tokens page by page against them, holds the hits and prefills
only the rest (at least one token). Matched tokens cost no step budget. Freed pages keep their
K/V until the pool needs them (page_pool.py), so a preempted sequence usually re-matches most
of its own history. n > 1 samples share one prefill of the prompt's full pages through the
same matching; see sharing.py.

A model mixing full and sliding layers has two KV page groups (window.py): every verb above
takes, holds and frees a page of each, and the sliding group frees its pages behind the window.

Finished sequences free their pages in the same call and leave the maps at once; the events
returned by `update` / the return values of `abort_request` are the engine's record.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence as SequenceABC

from jaxserve.config import SchedulerConfig
from jaxserve.scheduler import handover, invariants, prefix_cache, window
from jaxserve.scheduler.policy import FairShare, sort_key
from jaxserve.scheduler.admission import pages_for, validate_request
from jaxserve.scheduler.errors import SchedulerError
from jaxserve.scheduler.page_pool import NULL_PAGE, PagePool
from jaxserve.scheduler.plan import SeqEvent, StepBuilder, StepPlan, with_drafts
from jaxserve.scheduler.sequence import Sequence, SeqStatus
from jaxserve.scheduler.sharing import follower_ready, leader_chunk_cap, shared_prefix_len
from jaxserve.scheduler.speculation import plan_drafts, speculates as _speculates  # noqa: F401  (tests import it here)
from jaxserve.types import FinishReason, InvalidRequestError, SamplingParams, check_priority

# preemptions_by_tenant's size while nobody takes the counts (an engine without a metrics
# exporter): later tenants' counts go to one "other" key, as the exporter labels them anyway.
MAX_PREEMPTION_KEYS = 1024
UNTRACKED_TENANTS = "other"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_window: int | None = None):
        """kv_window: free KV pages wholly behind this sliding window as sequences advance
        (window.py; window.freeable_window(model config) says whether a model allows it)."""
        self.config = config
        self.kv_window = kv_window
        self.pages_freed_by_window = 0  # pages released behind the window, over the run
        self._pool = PagePool(config.num_pages, cache_freed=config.enable_prefix_caching)
        # The sliding layers' pool when they are a KV group of their own (window.py): each
        # sequence's `sliding_pages` table, as long as `pages`, grows and is freed with it.
        self._spool = None if config.sliding_window is None else PagePool(
            config.num_sliding_pages, cache_freed=config.enable_prefix_caching)
        if kv_window is not None and self._spool is not None:
            raise SchedulerError("kv_window (every layer windowed) and a sliding KV group exclude each other")
        self._seqs: dict[int, Sequence] = {}  # live (unfinished) sequences
        self._requests: dict[str, list[Sequence]] = {}  # live requests -> all their samples
        self._waiting: list[Sequence] = []  # sorted by priority
        self._running: list[Sequence] = []  # sorted by priority
        self._next_seq_id = 0
        self._next_arrival = 0
        self._pending_plan: StepPlan | None = None
        # Requests handed over to a decode engine, their sequences still holding pages until
        # the pages are read out (handover.py).
        self._held: dict[str, list[Sequence]] = {}
        self.num_preemptions_total = 0
        # Preemptions by reason: "kv" (the pool ran short while growing a running sequence),
        # "priority" (a higher-priority waiting request needed the slot, pages or budget).
        self.preemptions_by_reason = {"kv": 0, "priority": 0}
        # (reason, tenant) -> preemptions since the last take_preemptions_by_tenant(): handed
        # over, not kept, so no state outlives a tenant (clients may name new tenants at will).
        self.preemptions_by_tenant: dict[tuple[str, str], int] = {}
        self.num_steps = 0  # schedule() calls: the clock of priority aging
        # Tokens per step when a TPOT target is held (slo.py; None = max_num_batched_tokens).
        # Prefill chunks shrink to fit; running decodes always get their token.
        self.step_token_cap: int | None = None
        # Running sequences admission may reach under that target (slo.py; None = max_num_seqs).
        # Only admission reads it: nothing running is preempted to meet it.
        self.running_cap: int | None = None
        self._fair = FairShare(config.tenant_weights) if config.fair_share else None
        # Prefix cache lookups at admission, in tokens (vLLM's prefix_cache_queries / _hits):
        # every admission of a sequence, re-admissions after preemption included.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- engine API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: SequenceABC[int], params: SamplingParams,
                    eos_token_ids: Collection[int] = (), priority: int = 0,
                    tenant: str = "") -> list[int]:
        """Admit a request as `params.n` waiting sequences, or raise `InvalidRequestError`.
        `priority` (lower first) counts under scheduling_policy="priority"; `tenant` under
        fair_share (policy.py)."""
        prompt = validate_request(self.config, request_id, prompt_ids, params, eos_token_ids,
                                  self._requests, self.kv_window)
        check_priority(priority)
        if not isinstance(tenant, str):
            raise InvalidRequestError("tenant", f"must be a string, got {type(tenant).__name__}")
        shared_len = shared_prefix_len(len(prompt), self.config.page_size, params.n)
        arrival = self._next_arrival
        self._next_arrival += 1
        eos = frozenset(eos_token_ids)
        if self.config.enable_prefix_caching and params.prompt_logprobs is None:
            root = prefix_cache.root_hash(params.cache_salt)
        else:  # only the request's own samples share pages (sharing.py); prompt_logprobs need
            # every prompt token computed, so such a request stays out of the shared cache
            root = prefix_cache.private_root(arrival) if shared_len > 0 else None
        group: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(seq_id=self._next_seq_id, request_id=request_id, sample_index=i,
                           prompt_ids=prompt, params=params, eos_token_ids=eos,
                           arrival_index=arrival, hash_root=root, request_priority=priority,
                           arrival_step=self.num_steps, tenant=tenant)
            self._next_seq_id += 1
            if i > 0 and shared_len > 0:
                seq.share_from, seq.shared_len = group[0], shared_len
            seq.set_priority(sort_key(self.config, seq))
            group.append(seq)
        self._requests[request_id] = group
        if self._fair is not None:
            self._fair.activate(tenant, len(group))
        for seq in group:
            self._seqs[seq.seq_id] = seq
            bisect.insort(self._waiting, seq, key=_priority)
        return [s.seq_id for s in group]

    def schedule(self) -> StepPlan:
        """Choose this step's tokens and give every chosen sequence the pages they need."""
        if self._pending_plan is not None:
            raise SchedulerError("schedule() called again before update() or discard_plan()")
        self.num_steps += 1
        budget = self.config.max_num_batched_tokens
        if self.step_token_cap is not None:
            budget = max(min(budget, self.step_token_cap), len(self._running), 1)
        b = StepBuilder(budget, self.config.page_size)
        decodes = [s for s in self._running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self._running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            self._schedule_running(seq, b)
        if not b.preempted:
            self._admit_waiting(b)
        plan_drafts(self, decodes, b)
        self._pending_plan = b.build()
        if self._fair is not None:
            for s in self._pending_plan.seqs:
                self._fair.charge(self._seqs[s.seq_id].tenant, s.num_tokens)
        return self._pending_plan

    def update(self, plan: StepPlan, sampled: Mapping[int, int | SequenceABC[int]]) -> list[SeqEvent]:
        """Record that `plan` ran; `sampled` maps every seq id with `sample=True` to its token,
        or, for a run with drafts, to the tokens speculation.accept kept (one event each).

        A sequence aborted or finished between `schedule` and `update` is skipped.
        """
        self._take_plan(plan)
        live = [(s, self._seqs[s.seq_id]) for s in plan.seqs
                if s.seq_id in self._seqs and self._seqs[s.seq_id].status is SeqStatus.RUNNING]
        # Check everything before changing anything: a refused update leaves the state as a
        # discarded plan would, so the engine can fail the step's requests and go on.
        for s, seq in live:
            if s.sample and s.seq_id not in sampled:
                raise SchedulerError(f"update(): no sampled token for seq {s.seq_id} (sample=True)")
            if s.start_pos != seq.num_computed_tokens:
                raise SchedulerError(f"update(): seq {s.seq_id} has {seq.num_computed_tokens} "
                                     f"computed tokens, the plan started at {s.start_pos}")
        kept = {}
        for s, _seq in live:
            if s.sample:
                toks = sampled[s.seq_id]
                toks = [toks] if isinstance(toks, int) else list(toks)
                if not 1 <= len(toks) <= s.draft_len + 1 or toks[:-1] != list(s.draft[:len(toks) - 1]):
                    raise SchedulerError(f"update(): seq {s.seq_id} got tokens {toks} for drafts {s.draft}: "
                                         f"expected the kept drafts and one more token")
                kept[s.seq_id] = toks
        events = []
        for s, seq in live:
            # The run's own tokens are now in the cache, and of its drafts those kept.
            seq.num_computed_tokens += s.num_tokens - s.draft_len
            if not s.sample:
                continue
            toks = kept[s.seq_id]
            seq.num_computed_tokens += len(toks) - 1
            if s.draft_len and seq.drafts is not None:
                seq.drafts.record(s.draft_len, len(toks) - 1, len(seq.output_ids) + len(toks))
            for tok in toks:
                seq.output_ids.append(tok)
                reason = seq.stop_reason(tok, self.config.max_model_len)
                if reason is not None:
                    self._finish(seq, reason)
                events.append(SeqEvent(seq.seq_id, seq.request_id, seq.sample_index, tok,
                                       reason is not None, reason))
                if reason is not None:
                    break
        ps = self.config.page_size
        for _, seq in live:
            if seq.status is SeqStatus.RUNNING:  # a finished one registered in _finish
                prefix_cache.register_computed(self._pool, seq, ps, self._spool)
                if self.kv_window is not None:
                    self.pages_freed_by_window += window.free_dead_pages(self._pool, seq, self.kv_window, ps)
                if self._spool is not None:
                    self.pages_freed_by_window += window.free_dead_pages(
                        self._spool, seq, self.config.sliding_window, ps, seq.sliding_pages)
        return events

    def fill_drafts(self, plan: StepPlan, drafts: Mapping[int, tuple[int, ...]]) -> StepPlan:
        """The pending plan with the tokens a draft model put in its draft slots (plan.with_drafts):
        it replaces `plan` as the one update() and discard_plan() take."""
        filled = with_drafts(plan, drafts)
        self._take_plan(plan)
        self._pending_plan = filled
        return filled

    def discard_plan(self, plan: StepPlan) -> None:
        """Forget a plan that did not run (device error). Its pages stay allocated to the
        sequences, which is harmless: they are reused when the tokens are scheduled again."""
        self._take_plan(plan)

    def discard_pending_plan(self) -> bool:
        """Forget whatever plan schedule() returned that neither update() nor discard_plan()
        took (an owner cleaning up after a failure mid-step); False if there was none."""
        if self._pending_plan is None:
            return False
        self._take_plan(self._pending_plan)
        return True

    def finish_sequence(self, seq_id: int, reason: FinishReason = FinishReason.STOP) -> bool:
        """End one sequence (e.g. a stop string matched); False if it was not live."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def abort_request(self, request_id: str) -> list[int]:
        """End every live sample of a request in any phase (pages freed now); returns their seq
        ids, [] for an unknown or already finished request."""
        group = self._requests.get(request_id)
        if group is None:
            return []
        ended = [s.seq_id for s in group if not s.is_finished]
        for seq in group:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        return ended

    # ---- introspection ------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._held)

    # ---- prefill/decode handover (handover.py) -------------------------------------------------

    def hold_request(self, request_id: str) -> list[handover.HeldTable]:
        return handover.hold(self, request_id)

    def release_held(self, request_id: str) -> bool:
        return handover.release(self, request_id)

    def admit_running(self, request_id: str, prompt_ids: SequenceABC[int], params: SamplingParams,
                      eos_token_ids: Collection[int], tables: list[handover.HeldTable],
                      priority: int = 0, tenant: str = "") -> list[int]:
        return handover.admit_running(self, request_id, prompt_ids, params, eos_token_ids, tables,
                                      priority, tenant)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_pages(self) -> int:
        return self._pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self._pool.num_total

    @property
    def page_pool(self) -> PagePool:
        return self._pool

    def kv_pages(self) -> tuple[int, int]:
        """(held, usable) pages of the fuller KV group by fraction held (the only one of a
        one-group model; the full group's on a tie): the KV usage the server reports, as the
        pool that runs out first is the one that preempts. Cached pages count as free."""
        pools = [p for p in (self._pool, self._spool) if p is not None]
        return max(((p.num_total - 1 - p.num_free, p.num_total - 1) for p in pools),
                   key=lambda hu: hu[0] / hu[1])

    @property
    def sliding_page_pool(self) -> PagePool | None:
        """The sliding layers' pool of a two-group model (window.py), else None."""
        return self._spool

    @property
    def num_cached_pages(self) -> int:
        """Pages nobody holds that keep K/V for prefix matches (counted in num_free_pages)."""
        return self._pool.num_cached

    @property
    def num_prefix_evictions(self) -> int:
        return self._pool.num_evictions

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (weights or adapter changed): cached pages become free and
        pages in use can no longer be matched; running sequences keep their own pages. Returns
        the number of cached pages freed (both pools')."""
        return self._pool.forget() + (0 if self._spool is None else self._spool.forget())

    def get_sequence(self, seq_id: int) -> Sequence:
        """A live sequence (KeyError once finished). Treat it as read-only."""
        return self._seqs[seq_id]

    def live_request_ids(self) -> list[str]:
        return list(self._requests)

    def check_invariants(self) -> None:
        invariants.check_invariants(self)

    def check_idle_invariant(self) -> None:
        invariants.check_idle_invariant(self)

    # ---- internals ----------------------------------------------------------------------------

    def _leader_cap(self, seq: Sequence) -> int:
        return leader_chunk_cap(seq, self._requests[seq.request_id])

    def _grow(self, seq: Sequence, end: int, b: StepBuilder) -> bool:
        """Give `seq` pages up to token `end`, preempting lower-priority sequences if needed.
        False if `seq` had to preempt itself."""
        need = self._pages_short(seq, end)
        while not self._can_allocate(need):
            victim = self._running[-1]  # lowest priority; may be `seq` itself
            self._preempt(victim, "kv")
            b.drop(victim)
            if victim is seq:
                return False
        self._extend(seq, need)
        return True

    def _can_allocate(self, n: int) -> bool:
        return self._pool.can_allocate(n) and (self._spool is None or self._spool.can_allocate(n))

    def _extend(self, seq: Sequence, n: int) -> None:
        """n more pages for `seq`'s block table, and for its sliding one (same length) if any."""
        seq.pages.extend(self._pool.allocate(n))
        if self._spool is not None:
            seq.sliding_pages.extend(self._spool.allocate(n))

    def _pages_short(self, seq: Sequence, end: int) -> int:
        """Pages `seq` lacks to hold tokens up to `end` (0 if it already holds more, e.g. the
        pages of drafts that were not kept)."""
        return max(0, pages_for(end, self.config.page_size) - len(seq.pages))

    def _schedule_running(self, seq: Sequence, b: StepBuilder) -> None:
        if seq.status is not SeqStatus.RUNNING:
            return  # preempted as a victim earlier in this step
        n = min(seq.num_uncomputed_tokens, b.budget, self._leader_cap(seq))
        if n > 0 and self._grow(seq, seq.num_computed_tokens + n, b):
            b.add(seq, n)

    def _admit_waiting(self, b: StepBuilder) -> None:
        """Admit waiting sequences in policy order (fair-share order across tenants if on) until
        one does not fit. Under "priority" a sequence that does not fit first preempts running
        sequences ranked below it, lowest first, until it fits or none is left."""
        ps = self.config.page_size
        order = self._fair.order(self._waiting) if self._fair is not None else list(self._waiting)
        i = 0
        while i < len(order):
            seq = order[i]
            if b.budget == 0 or len(self._running) >= self._max_running():
                if self._preempt_below(seq, b, for_budget=b.budget == 0):
                    continue
                return
            if not follower_ready(seq):
                i += 1  # its leader has not computed the shared prefix yet: let others pass
                continue
            pool, spool = self._pool, self._spool
            cached = prefix_cache.match(pool, seq, ps)
            s_held: list[int] = []  # the sliding group's hits inside the window (window.py)
            if spool is not None:
                m, s_held = window.sliding_match(spool, seq, cached, self.config.sliding_window, ps)
                cached = cached[:m]
            start = len(cached) * ps
            seq.num_computed_tokens = start  # the leader's chunk cap reads it
            n = min(seq.num_tokens - start, b.budget, self._leader_cap(seq))
            need = pages_for(start + n, ps) - len(cached)
            # Hits already behind a sliding window are matched but not held (window.py), so a
            # long match never makes a sample hold more than admission.peak_pages.
            behind = 0 if self.kv_window is None else min(
                len(cached), window.pages_behind(start, self.kv_window, ps))
            held = cached[behind:]
            # Cached hits stop being available once held: they cannot also be allocated.
            if need > pool.num_free - sum(1 for p in held if pool.refcount(p) == 0) or (
                    spool is not None and need > spool.num_free - sum(1 for p in s_held if spool.refcount(p) == 0)):
                seq.num_computed_tokens = 0
                if self._preempt_below(seq, b, for_budget=False):
                    continue
                return
            pool.touch(held)
            seq.pages = [NULL_PAGE] * behind + held + pool.allocate(need)
            if spool is not None:
                spool.touch(s_held)
                seq.sliding_pages = [NULL_PAGE] * (len(cached) - len(s_held)) + s_held + spool.allocate(need)
            seq.num_hashed_pages = len(cached)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
            if self.config.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += start
            seq.share_from = None
            seq.status = SeqStatus.RUNNING
            self._waiting.remove(seq)
            bisect.insort(self._running, seq, key=_priority)
            b.add(seq, n)
            i += 1

    def _max_running(self) -> int:
        cap = self.running_cap
        return self.config.max_num_seqs if cap is None else max(1, min(cap, self.config.max_num_seqs))

    def _preempt_below(self, seq: Sequence, b: StepBuilder, for_budget: bool) -> bool:
        """Under "priority": preempt the lowest-ranked running sequence ranked below `seq` (for
        budget: the lowest-ranked one holding tokens in this step's plan). False if none."""
        if self.config.scheduling_policy != "priority":
            return False
        for victim in reversed(self._running):
            if victim.priority <= seq.priority:
                return False
            if not for_budget or victim.seq_id in b.chunks:
                self._preempt(victim, "priority")
                b.drop(victim)
                return True
        return False

    def _release_pages(self, seq: Sequence) -> None:
        """Free `seq`'s pages, its computed full pages offered to the cache first. Last page
        first, so that under pressure a prefix's tail is evicted before its head (a head
        without its tail still matches; a tail without its head never does)."""
        prefix_cache.register_computed(self._pool, seq, self.config.page_size, self._spool)
        self._pool.free(reversed(window.live_pages(seq)))
        if self._spool is not None:
            self._spool.free(reversed(window.live_pages(seq, seq.sliding_pages)))
        seq.pages, seq.sliding_pages = [], []
        seq.num_hashed_pages = 0

    def _preempt(self, seq: Sequence, reason: str) -> None:
        self._release_pages(seq)
        seq.num_computed_tokens = 0
        seq.share_from = None  # a preempted follower is re-admitted alone, matching what is cached
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._running.remove(seq)
        seq.set_priority(sort_key(self.config, seq))
        bisect.insort(self._waiting, seq, key=_priority)
        self.num_preemptions_total += 1
        self.preemptions_by_reason[reason] += 1
        key = (reason, seq.tenant)
        if key not in self.preemptions_by_tenant and len(self.preemptions_by_tenant) >= MAX_PREEMPTION_KEYS:
            key = (reason, UNTRACKED_TENANTS)  # nobody is taking the counts: keep the map bounded
        self.preemptions_by_tenant[key] = self.preemptions_by_tenant.get(key, 0) + 1

    def take_preemptions_by_tenant(self) -> dict[tuple[str, str], int]:
        """The (reason, tenant) preemption counts since the last call, which start again from
        nothing (server/metrics.py adds them to its labelled counter)."""
        out, self.preemptions_by_tenant = self.preemptions_by_tenant, {}
        return out

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self._waiting.remove(seq)
        self._release_pages(seq)
        seq.share_from = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        if self._fair is not None:
            self._fair.retire(seq.tenant)
        group = self._requests[seq.request_id]
        if all(s.is_finished for s in group):
            del self._requests[seq.request_id]

    def _take_plan(self, plan: StepPlan) -> None:
        if plan is not self._pending_plan:
            raise SchedulerError("update()/discard_plan() with a plan that is not the one "
                                 "schedule() just returned")
        self._pending_plan = None


def _priority(seq: Sequence) -> tuple:
    return seq.priority

