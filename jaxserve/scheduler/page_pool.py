"""Fixed-size KV pages with reference counts, and the prefix cache of full pages.

The device KV cache is an array of `num_pages` pages of `page_size` token slots. This pool
only hands out page numbers; the runner writes K/V into the slots a sequence's block table
names. Page 0 is the null page: the runner pads block tables with it, so it is never handed
out and can never be freed.

A page's reference count is the number of block tables that hold it. Every page other than
the null page is in exactly one of three states:

    in use   count >= 1 (it may also carry a hash: a full page others can match)
    cached   count 0, carries a hash: its K/V is still valid, kept in LRU order for reuse
    free     count 0, no hash

`register(page, h)` gives a full, computed page its content hash (prefix_hash.py); `lookup(h)`
finds the page holding a hash, in use or cached; `touch` takes pages found that way (a cached
one leaves the LRU list). `free` drops one holder per page; a page nobody holds becomes
cached if it carries a hash, free otherwise. `allocate` takes free pages first and only then
evicts the least recently freed cached pages (their hashes go), so caching never makes a
request wait that could run without it: cached pages count as available (`num_free`).

`incref` adds a holder to a page that is already held. With `cache_freed=False` (prefix
caching off) no page is ever cached: a page nobody holds is free. Every verb checks all its arguments
before changing anything, so a refused call leaves the pool as it was.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jaxserve.scheduler.errors import InvariantViolation, PagePoolError

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int, cache_freed: bool = True):
        if num_pages < 2:
            raise PagePoolError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        self._refcount = [0] * num_pages
        # FIFO reuse: a freed page goes to the back, so a stale block table entry is less likely
        # to alias a freshly reused page and tests catch such bugs sooner.
        self._free = collections.deque(range(1, num_pages))
        # Cached pages, least recently freed first (dict order; `touch` and eviction pop them).
        self._cached: dict[int, None] = {}
        self._hash_of: dict[int, bytes] = {}  # page -> hash, for in-use and cached pages
        self._page_of: dict[bytes, int] = {}  # hash -> page (the inverse map)
        self.num_evictions = 0  # cached pages reused for other content
        # False (prefix caching off): a hashed page nobody holds is freed at once, so hashes
        # only ever match pages still held (the n samples of one request, sharing.py).
        self._cache_freed = cache_freed

    @property
    def num_total(self) -> int:
        """All pages, the null page included."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones (evicted on demand)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Pages nobody holds whose K/V is kept for prefix matches."""
        return len(self._cached)

    @property
    def num_hashed(self) -> int:
        """Pages, held or cached, that a prompt can match."""
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (all or nothing), each with reference count 1: free pages first, then
        the least recently freed cached pages, whose hashes are dropped."""
        if n < 0 or n > self.num_free:
            raise PagePoolError(f"cannot allocate {n} pages: {self.num_free} free or cached")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p = next(iter(self._cached))
                del self._cached[p]
                del self._page_of[self._hash_of.pop(p)]
                self.num_evictions += 1
            self._refcount[p] = 1
            pages.append(p)
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one holder to each page; each must already be held (sharing, not allocation)."""
        pages = list(pages)
        for p in pages:
            self._check_page(p, "incref")
            if self._refcount[p] == 0:
                raise PagePoolError(f"incref of free page {p}")
        for p in pages:
            self._refcount[p] += 1

    def lookup(self, h: bytes) -> int | None:
        """The page holding content hash `h` (in use or cached), or None."""
        return self._page_of.get(h)

    def touch(self, pages: Iterable[int]) -> None:
        """Add one holder to each page found by `lookup`: a held page is shared, a cached one
        leaves the LRU list. A free page (no K/V worth reading) is refused."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise PagePoolError(f"touch of a page twice: {pages}")
        for p in pages:
            self._check_page(p, "touch")
            if self._refcount[p] == 0 and p not in self._cached:
                raise PagePoolError(f"touch of free page {p}: only held or cached pages hold K/V")
        for p in pages:
            self._cached.pop(p, None)
            self._refcount[p] += 1

    def register(self, page: int, h: bytes) -> bool:
        """Give the held, full page `page` its content hash so prompts can match it. False (and
        nothing changes) when another page already holds `h`: two sequences computed the same
        content; the first one stays the one matched and this page stays private."""
        self._check_page(page, "register")
        if self._refcount[page] == 0:
            raise PagePoolError(f"register of unheld page {page}")
        old = self._hash_of.get(page)
        if old is not None:
            if old != h:
                raise PagePoolError(f"register of page {page}: it already holds other content")
            return True
        if h in self._page_of:
            return False
        self._hash_of[page] = h
        self._page_of[h] = page
        return True

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder from each page, in the order given; a page nobody holds any more
        becomes cached (most recently freed, so evicted last) if it has a hash, else free."""
        pages = list(pages)
        counts = collections.Counter(pages)
        for p, c in counts.items():
            self._check_page(p, "free")
            if self._refcount[p] < c:
                raise PagePoolError(
                    f"double free of page {p}: freed {c} time(s), reference count {self._refcount[p]}")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                h = self._hash_of.get(p)
                if h is not None and self._cache_freed:
                    self._cached[p] = None
                else:
                    if h is not None:
                        del self._hash_of[p], self._page_of[h]
                    self._free.append(p)

    def forget(self, pages: Iterable[int] | None = None) -> int:
        """Drop the hashes of `pages` (all pages when None): cached ones become free, held ones
        stay held but can no longer be matched. Returns how many cached pages were freed."""
        targets = list(self._hash_of) if pages is None else [p for p in pages if p in self._hash_of]
        freed = 0
        for p in targets:
            del self._page_of[self._hash_of.pop(p)]
            if p in self._cached:
                del self._cached[p]
                self._free.append(p)
                freed += 1
        return freed

    def _check_page(self, p: int, verb: str) -> None:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self._num_pages:
            raise PagePoolError(f"{verb}: {p!r} is not a page number in [0, {self._num_pages})")
        if p == NULL_PAGE:
            raise PagePoolError(f"{verb} of the reserved null page 0")

    def check(self) -> None:
        """Every page but the null page is in exactly one state: free (count 0, no hash, on the
        free list once), cached (count 0, a hash, on the LRU list) or in use (count >= 1); the
        hash maps are inverse bijections."""
        free = set(self._free)
        if len(free) != len(self._free):
            dup = [p for p, c in collections.Counter(self._free).items() if c > 1]
            raise InvariantViolation(f"pages on the free list twice: {dup}")
        if (NULL_PAGE in free or NULL_PAGE in self._cached or NULL_PAGE in self._hash_of
                or self._refcount[NULL_PAGE] != 0):
            raise InvariantViolation("the null page 0 is free, cached, hashed or has holders")
        if free & self._cached.keys():
            raise InvariantViolation(f"pages both free and cached: {sorted(free & self._cached.keys())}")
        if len(self._page_of) != len(self._hash_of) or any(
                self._page_of.get(h) != p for p, h in self._hash_of.items()):
            raise InvariantViolation("the page -> hash and hash -> page maps disagree")
        for p in range(1, self._num_pages):
            rc = self._refcount[p]
            if rc < 0:
                raise InvariantViolation(f"page {p} has negative reference count {rc}")
            if (rc == 0) != (p in free or p in self._cached):
                state = "free" if p in free else "cached" if p in self._cached else "not free"
                raise InvariantViolation(f"page {p} has reference count {rc} but is {state}")
            if p in self._cached and p not in self._hash_of:
                raise InvariantViolation(f"cached page {p} has no hash")
            if p in free and p in self._hash_of:
                raise InvariantViolation(f"free page {p} still has a hash")
