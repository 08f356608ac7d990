"""Prefill/decode disaggregation on the scheduler's side: a request's sequences leave one
scheduler holding their pages, and join another as running sequences whose pages were filled
from outside.

Prefill side: once every live sample of a request has sampled its first token (so its KV
holds exactly prompt + outputs less the last token), `hold` takes its sequences out of the
running list and the maps, pages still held, into `Scheduler._held`: nothing schedules them
again, nothing else can take their pages, and the invariants count those tables as owners.
`release` frees them the way a finished sequence's pages are freed (computed full pages offered
to the prefix cache first), once the pages have been read out or the transfer gave up.

Decode side: `admit_running` allocates, for every sample, pages for the live (non-null) entries
of the block tables the prefill side had (a table's leading null entries are pages already
freed behind a sliding window, so they are null here too), and makes the sequences RUNNING
with the outputs so far and `num_computed_tokens` as handed over: the next step decodes them.
It is all or nothing: if the pool or the running slots cannot take every sample, it raises
`NoRoomForHandover` and changes nothing (the caller retries later or elsewhere).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Sequence as SequenceABC
from typing import TYPE_CHECKING

from jaxserve.scheduler import prefix_cache
from jaxserve.scheduler.admission import validate_request
from jaxserve.scheduler.errors import SchedulerError
from jaxserve.scheduler.page_pool import NULL_PAGE
from jaxserve.scheduler.policy import sort_key
from jaxserve.scheduler.sequence import Sequence, SeqStatus
from jaxserve.types import SamplingParams

if TYPE_CHECKING:
    from jaxserve.scheduler.scheduler import Scheduler


def _priority(seq: Sequence) -> tuple:
    return seq.priority  # the running list's sort key (scheduler._priority)


class NoRoomForHandover(RuntimeError):
    """The decode side has not the free pages or running slots for a handed-over request now."""


@dataclasses.dataclass(frozen=True)
class HeldTable:
    """One sample's block tables as handed over: leading null entries, then live pages."""

    sample_index: int
    output_ids: tuple[int, ...]
    num_computed_tokens: int
    full_nulls: int
    full_pages: tuple[int, ...]
    sliding_nulls: int = 0
    sliding_pages: tuple[int, ...] = ()


def _split_nulls(table: list[int]) -> tuple[int, tuple[int, ...]]:
    n = 0
    while n < len(table) and table[n] == NULL_PAGE:
        n += 1
    if any(p == NULL_PAGE for p in table[n:]):
        raise SchedulerError(f"a block table with a null page after a live one: {table}")
    return n, tuple(table[n:])


def hold(s: Scheduler, request_id: str) -> list[HeldTable]:
    """Take the request's live sequences out of scheduling with their pages (module doc);
    returns their tables. Every live sample must be RUNNING with exactly its last output
    uncomputed (it just sampled)."""
    group = s._requests.get(request_id)
    if group is None or request_id in s._held:
        raise SchedulerError(f"hold(): {request_id!r} is not a live request")
    live = [q for q in group if not q.is_finished]
    for q in live:
        if q.status is not SeqStatus.RUNNING or q.num_uncomputed_tokens != 1 or not q.output_ids:
            raise SchedulerError(f"hold(): seq {q.seq_id} is {q.status.name} with "
                                 f"{q.num_uncomputed_tokens} uncomputed tokens, not just sampled")
    tables = []
    for q in live:
        full_nulls, full = _split_nulls(q.pages)
        s_nulls, sliding = _split_nulls(q.sliding_pages) if s._spool is not None else (0, ())
        # Pages past the computed tokens (drafts not kept) hold nothing worth moving.
        need = -(-q.num_computed_tokens // s.config.page_size)
        tables.append(HeldTable(q.sample_index, tuple(q.output_ids), q.num_computed_tokens, full_nulls,
                                full[:max(0, need - full_nulls)], s_nulls,
                                sliding[:max(0, need - s_nulls)]))
        s._running.remove(q)
        del s._seqs[q.seq_id]
        q.status = SeqStatus.FINISHED
        if s._fair is not None:
            s._fair.retire(q.tenant)
    del s._requests[request_id]
    s._held[request_id] = live
    return tables


def release(s: Scheduler, request_id: str) -> bool:
    """Free a held request's pages (module doc); False if it was not held."""
    seqs = s._held.pop(request_id, None)
    if seqs is None:
        return False
    for q in seqs:
        s._release_pages(q)
    return True


def admit_running(s: Scheduler, request_id: str, prompt_ids: SequenceABC[int], params: SamplingParams,
                  eos_token_ids: Collection[int], tables: list[HeldTable], priority: int = 0,
                  tenant: str = "") -> list[int]:
    """Running sequences for a handed-over request (module doc); returns their seq ids, in
    `tables` order. Raises InvalidRequestError for a request this scheduler's limits refuse,
    NoRoomForHandover when it cannot take it now."""
    prompt = validate_request(s.config, request_id, prompt_ids, params, eos_token_ids,
                              {**s._requests, **s._held}, s.kv_window)
    if not tables:
        raise SchedulerError("admit_running(): no samples to admit")
    ps = s.config.page_size
    for t in tables:
        n = len(prompt) + len(t.output_ids)
        if not 0 < t.num_computed_tokens < n or t.full_nulls + len(t.full_pages) != -(-t.num_computed_tokens // ps):
            raise SchedulerError(f"admit_running(): sample {t.sample_index}: {t.num_computed_tokens} of {n} "
                                 f"tokens computed in {t.full_nulls} + {len(t.full_pages)} pages")
        if s._spool is None and t.sliding_pages:
            raise SchedulerError("admit_running(): sliding pages handed to a model without a sliding group")
    need = sum(len(t.full_pages) for t in tables)
    s_need = sum(t.full_nulls + len(t.full_pages) - t.sliding_nulls for t in tables)
    if len(s._running) + len(tables) > s._max_running():
        raise NoRoomForHandover(f"{len(s._running)} running + {len(tables)} handed over is more than "
                                f"max_num_seqs={s._max_running()}")
    if not s._pool.can_allocate(need) or (s._spool is not None and not s._spool.can_allocate(s_need)):
        raise NoRoomForHandover(f"{need} KV pages wanted, {s._pool.num_free} free")
    arrival = s._next_arrival
    s._next_arrival += 1
    eos = frozenset(eos_token_ids)
    if s.config.enable_prefix_caching and params.prompt_logprobs is None:
        root = prefix_cache.root_hash(params.cache_salt)
    else:
        root = None
    group = []
    for t in tables:
        seq = Sequence(seq_id=s._next_seq_id, request_id=request_id, sample_index=t.sample_index,
                       prompt_ids=prompt, params=params, eos_token_ids=eos, arrival_index=arrival,
                       hash_root=root, request_priority=priority, arrival_step=s.num_steps, tenant=tenant)
        s._next_seq_id += 1
        seq.output_ids = list(t.output_ids)
        seq.num_computed_tokens = t.num_computed_tokens
        seq.num_cached_tokens = 0
        seq.pages = [NULL_PAGE] * t.full_nulls + s._pool.allocate(len(t.full_pages))
        if s._spool is not None:
            live = t.full_nulls + len(t.full_pages) - t.sliding_nulls
            seq.sliding_pages = [NULL_PAGE] * t.sliding_nulls + s._spool.allocate(live)
        # Pages already behind the window were offered to the prefill side's cache, not here.
        seq.num_hashed_pages = max(t.full_nulls, t.sliding_nulls)
        seq.status = SeqStatus.RUNNING
        seq.set_priority(sort_key(s.config, seq))
        group.append(seq)
    s._requests[request_id] = group
    if s._fair is not None:
        s._fair.activate(tenant, len(group))
    for seq in group:
        s._seqs[seq.seq_id] = seq
        bisect.insort(s._running, seq, key=_priority)
    return [q.seq_id for q in group]
