"""Consistency checks of a `Scheduler`, cheap enough to run after every step in tests.

`check_invariants`: every page's reference count equals the number of block tables holding
it, no block table holds a page twice or the null page (except in the entries of pages freed
behind a sliding window), the free and cached lists are exactly
the pages nobody holds (page_pool.check), a page that carries a prefix hash sits at the same
index of every block table holding it, under that sequence's own hash for the index, and
inside its computed tokens (so nobody ever writes into a page others can match), waiting
sequences hold nothing, and the lists and maps agree; with a sliding KV group (window.py)
all of it per group, its tables as long as the full group's.
`check_idle_invariant`: with nothing unfinished, every page of every pool but the null page is
free or cached (nobody holds any) and all maps are empty ("nothing lost", docs reliability.md).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from jaxserve.scheduler.admission import pages_for
from jaxserve.scheduler.errors import InvariantViolation
from jaxserve.scheduler.page_pool import NULL_PAGE
from jaxserve.scheduler import window
from jaxserve.scheduler.sequence import SeqStatus

if TYPE_CHECKING:
    from jaxserve.scheduler.scheduler import Scheduler


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


def _check_table(pool, seq, table: list[int], kv_window: int | None, ps: int,
                 owners: collections.Counter[int], group: str) -> None:
    """One block table of `seq` against its pool (`group` names it in the message)."""
    sid = seq.seq_id
    # The null page only in the entries of pages freed behind a sliding window (window.py).
    nulls = [i for i, p in enumerate(table) if p == NULL_PAGE]
    freed = 0 if kv_window is None else window.dead_pages(seq, kv_window, ps)
    live = [p for p in table if p != NULL_PAGE]
    if len(set(live)) != len(live) or any(i >= freed for i in nulls):
        _fail(f"seq {sid} {group}block table holds a page twice or the null page outside the freed "
              f"window ({freed} pages): {table}")
    owners.update(live)
    for i, p in enumerate(table):
        if p == NULL_PAGE:
            continue
        h = pool.hash_of(p)
        if h is None:
            continue
        if i >= len(seq.page_hashes) or seq.page_hashes[i] != h:
            _fail(f"seq {sid} holds hashed {group}page {p} at index {i}, but its own page {i} "
                  f"hashes differently")
        if seq.num_computed_tokens < (i + 1) * ps:
            _fail(f"seq {sid} holds hashed {group}page {p} at index {i} but has computed only "
                  f"{seq.num_computed_tokens} tokens: it would write into a shared page")


def _check_refcounts(pool, owners: collections.Counter[int], group: str) -> None:
    for page in range(1, pool.num_total):
        if pool.refcount(page) != owners[page]:
            _fail(f"{group}page {page}: reference count {pool.refcount(page)} but {owners[page]} "
                  f"block tables hold it")


def check_invariants(s: Scheduler) -> None:
    """The module doc's checks; with a sliding KV group (window.py) its pool and every
    sequence's sliding table too, which is exactly as long as the block table."""
    pool, spool = s._pool, s._spool
    pool.check()
    if spool is not None:
        spool.check()
    ps = s.config.page_size
    owners: collections.Counter[int] = collections.Counter()
    s_owners: collections.Counter[int] = collections.Counter()
    for sid, seq in s._seqs.items():
        if sid != seq.seq_id or seq.is_finished:
            _fail(f"seq map entry {sid} holds seq {seq.seq_id} in state {seq.status.name}")
        if seq not in s._requests.get(seq.request_id, ()):
            _fail(f"seq {sid} is not listed under its request {seq.request_id!r}")
        _check_table(pool, seq, seq.pages, s.kv_window, ps, owners, "")
        if spool is None:
            if seq.sliding_pages:
                _fail(f"seq {sid} holds sliding pages {seq.sliding_pages} with no sliding group")
        else:
            if len(seq.sliding_pages) != len(seq.pages):
                _fail(f"seq {sid}: sliding block table {seq.sliding_pages} not as long as {seq.pages}")
            _check_table(spool, seq, seq.sliding_pages, s.config.sliding_window, ps, s_owners, "sliding ")
        if seq.status is SeqStatus.WAITING and (seq.pages or seq.sliding_pages or seq.num_computed_tokens):
            _fail(f"waiting seq {sid} holds pages {seq.pages} / "
                  f"{seq.num_computed_tokens} computed tokens")
        if seq.status is SeqStatus.RUNNING:
            if not 0 <= seq.num_computed_tokens < seq.num_tokens:
                _fail(f"running seq {sid} has {seq.num_computed_tokens} of {seq.num_tokens} "
                      f"tokens computed")
            if len(seq.pages) < pages_for(seq.num_computed_tokens, ps):
                _fail(f"seq {sid}: {len(seq.pages)} pages cannot hold "
                      f"{seq.num_computed_tokens} computed tokens")
    for rid, held in s._held.items():  # handed-over sequences keep their pages (handover.py)
        if rid in s._requests:
            _fail(f"request {rid!r} is both held for a handover and live")
        for seq in held:
            owners.update(window.live_pages(seq))
            if spool is not None:
                s_owners.update(window.live_pages(seq, seq.sliding_pages))
    _check_refcounts(pool, owners, "")
    if spool is not None:
        _check_refcounts(spool, s_owners, "sliding ")
    running, waiting = s._running, s._waiting
    if len(running) > s.config.max_num_seqs:
        _fail(f"{len(running)} running sequences, max_num_seqs={s.config.max_num_seqs}")
    for name, lst, status in (("running", running, SeqStatus.RUNNING),
                              ("waiting", waiting, SeqStatus.WAITING)):
        if any(q.status is not status or s._seqs.get(q.seq_id) is not q for q in lst):
            _fail(f"the {name} list holds a sequence that is not live and {status.name}")
        keys = [q.priority for q in lst]
        if keys != sorted(keys):
            _fail(f"the {name} list is not in priority order")
    if len(running) + len(waiting) != len(s._seqs) or set(running) & set(waiting):
        _fail(f"{len(running)} running + {len(waiting)} waiting != {len(s._seqs)} live sequences")
    for rid, group in s._requests.items():
        if all(q.is_finished for q in group):
            _fail(f"request {rid!r} has no live sequence but is still in the request map")


def check_idle_invariant(s: Scheduler) -> None:
    problems = []
    for name, pool in (("", s._pool), ("sliding ", s._spool)):
        if pool is None:
            continue
        usable = pool.num_total - 1
        if pool.num_free != usable:
            problems.append(f"{pool.num_free} free {name}pages ({pool.num_cached} of them cached), "
                            f"expected {usable} (all but the null page)")
        held = [p for p in range(pool.num_total) if pool.refcount(p) != 0]
        if held:
            problems.append(f"{name}pages with non-zero reference counts: {held[:20]}")
    if s._held:
        problems.append(f"{len(s._held)} requests still hold pages for a handover: {list(s._held)[:5]}")
    if s._seqs or s._requests or s._running or s._waiting:
        problems.append(f"not idle: {len(s._requests)} requests ({list(s._requests)[:5]}), "
                        f"{len(s._seqs)} sequences, {len(s._running)} running, "
                        f"{len(s._waiting)} waiting")
    if problems:
        raise InvariantViolation("idle invariant: " + "; ".join(problems))
    s._pool.check()
    if s._spool is not None:
        s._spool.check()
