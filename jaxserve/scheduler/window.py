"""Freeing the KV pages a sliding window has left behind: every layer's (Mistral-like models,
every layer windowed), or the sliding layers' own group (Gemma 2 / 3, below).

A query at position p attends to keys p - W + 1 .. p. Every query a running sequence will ever
run is at a position >= its `num_computed_tokens` (chunks, decodes and drafts all start there;
only preemption goes back, and it re-prefills into fresh pages), so a page whose last slot is
below num_computed_tokens - W + 1 is never visible again and is released to the pool. Its block
table entry becomes the null page (page 0): the sequence's table keeps its length (page i still
holds positions i * page_size ..), the freed page can be reused by anyone at once, and this
sequence never reads it again: the kernels skip or mask positions outside the window, and the
null page they may read in a chunk straddling the window edge holds finite values whose
softmax weight is exactly 0.

Mixed local / global models (Gemma 2 / 3): their global layers attend to every position, so
`freeable_window` is None for them (as for full-attention models), but their layers are two
KV groups (ModelConfig.kv_groups, SchedulerConfig.sliding_window; vLLM's hybrid KV cache
manager does the same): the full layers' cache, pool and block table (`Sequence.pages`)
keep every page, the sliding layers' (`Sequence.sliding_pages`, same length, pages from a
pool of their own) follow the rule above, so that pool holds about window + step tokens per
sequence (admission.peak_pages with the window) whatever the context. Both tables grow
together (a page of each per page_size tokens) and are released together; a prefix match
needs the full group's pages of the whole prefix and the sliding group's inside the window
before the resume point (`sliding_match`).

Interactions: a page is freed only after the prefix cache has seen it (prefix_cache.
register_computed runs first), so with prefix caching on it becomes a cached page that later
requests may still match. A leader frees its pages even while a follower of its request waits
to share them (sharing.py): holding them would break the page bound admission relies on
(admission.peak_pages); the follower then matches what the cache still holds and computes
the rest itself (with prefix caching off, nothing of what was freed).

Admission follows the same rule: a prefix match (prefix_cache.match) may reach far behind the
window of the position it resumes at; the matched pages already behind it are not held (their
entries are the null page from the start), else a follower or a re-admitted sequence would
hold more than peak_pages and, in a small pool, never fit (the scheduler would stall).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.scheduler.page_pool import NULL_PAGE, PagePool

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig
    from jaxserve.scheduler.sequence import Sequence


def freeable_window(cfg: ModelConfig) -> int | None:
    """The window behind which pages may be freed: the model's sliding window when every layer
    uses it, else None (full attention, or global layers that need every page)."""
    if cfg.sliding_window is None:
        return None
    if cfg.layer_types is not None and any(t != "sliding_attention" for t in cfg.layer_types):
        return None
    return int(cfg.sliding_window)


def pages_behind(num_computed_tokens: int, window: int, page_size: int) -> int:
    """How many leading pages lie wholly below position num_computed_tokens - window + 1, the
    first key any query at or after num_computed_tokens can see."""
    return max(0, num_computed_tokens - window + 1) // page_size


def dead_pages(seq: Sequence, window: int, page_size: int) -> int:
    """How many leading pages of `seq` no future query can see: pages wholly below position
    num_computed_tokens - window + 1 (and already offered to the prefix cache)."""
    n = pages_behind(seq.num_computed_tokens, window, page_size)
    if seq.hash_root is not None:
        n = min(n, seq.num_hashed_pages)
    return min(n, len(seq.pages))


def free_dead_pages(pool: PagePool, seq: Sequence, window: int, page_size: int,
                    table: list[int] | None = None) -> int:
    """Release `seq`'s dead pages (last first, like a finished sequence's, so a prefix's head
    outlives its tail in the cache) and put the null page in their entries; returns how many.
    `table`: the block table to free from (default `seq.pages`; `seq.sliding_pages` for a
    sliding group)."""
    table = seq.pages if table is None else table
    n = dead_pages(seq, window, page_size)
    drop = [p for p in table[:n] if p != NULL_PAGE]
    if drop:
        pool.free(reversed(drop))
        table[:n] = [NULL_PAGE] * n
    return len(drop)


def live_pages(seq: Sequence, table: list[int] | None = None) -> list[int]:
    """The pages `seq` holds in `table` (default its block table) without the null entries of
    freed pages."""
    return [p for p in (seq.pages if table is None else table) if p != NULL_PAGE]


def sliding_match(pool: PagePool, seq: Sequence, full_hits: list[int], window: int,
                  page_size: int) -> tuple[int, list[int]]:
    """A prefix match for a sliding KV group: the longest m <= len(full_hits) whose sliding
    pages inside the window of resume point m * page_size (pages_behind .. m - 1) are all in
    the sliding `pool` (held or cached, under the same hashes as the full group's), and those
    pages. A page evicted from the sliding pool shrinks the match to before it, so what the
    sequence then computes itself is always what its own layers need."""
    hashes = seq.page_hashes  # prefix_cache.match hashed at least len(full_hits) pages
    for m in range(len(full_hits), 0, -1):
        hits = [pool.lookup(hashes[i]) for i in range(min(m, pages_behind(m * page_size, window, page_size)), m)]
        if None not in hits:
            return m, hits
    return 0, []
