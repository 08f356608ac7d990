"""Fixed-size KV pages with reference counts.

The device KV cache is an array of `num_pages` pages of `page_size` token slots. This pool
only hands out page numbers; the runner writes K/V into the slots a sequence's block table
names. Page 0 is the null page: the runner pads block tables with it, so it is never handed
out and can never be freed.

A page's reference count is the number of block tables that hold it. `allocate` returns pages
with count 1; `incref` adds a holder to a page that is already held (prefix sharing between the
samples of one request); `free` drops one holder per page, and a page whose count reaches 0
goes back to the free list. Every verb checks all its arguments before changing anything, so
a refused call leaves the pool as it was.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from jaxserve.scheduler.errors import InvariantViolation, PagePoolError

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise PagePoolError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self._num_pages = num_pages
        self._refcount = [0] * num_pages
        # FIFO reuse: a freed page goes to the back, so a stale block table entry is less likely
        # to alias a freshly reused page and tests catch such bugs sooner.
        self._free = collections.deque(range(1, num_pages))

    @property
    def num_total(self) -> int:
        """All pages, the null page included."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages (all or nothing), each with reference count 1."""
        if n < 0 or n > len(self._free):
            raise PagePoolError(f"cannot allocate {n} pages: {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
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

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder from each page; pages nobody holds any more return to the free list."""
        counts = collections.Counter(pages)
        for p, c in counts.items():
            self._check_page(p, "free")
            if self._refcount[p] < c:
                raise PagePoolError(
                    f"double free of page {p}: freed {c} time(s), reference count {self._refcount[p]}")
        for p, c in counts.items():
            self._refcount[p] -= c
            if self._refcount[p] == 0:
                self._free.append(p)

    def _check_page(self, p: int, verb: str) -> None:
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self._num_pages:
            raise PagePoolError(f"{verb}: {p!r} is not a page number in [0, {self._num_pages})")
        if p == NULL_PAGE:
            raise PagePoolError(f"{verb} of the reserved null page 0")

    def check(self) -> None:
        """The free list holds exactly the pages with count 0, once each, and never page 0."""
        free = set(self._free)
        if len(free) != len(self._free):
            dup = [p for p, c in collections.Counter(self._free).items() if c > 1]
            raise InvariantViolation(f"pages on the free list twice: {dup}")
        if NULL_PAGE in free or self._refcount[NULL_PAGE] != 0:
            raise InvariantViolation("the null page 0 is on the free list or has holders")
        for p in range(1, self._num_pages):
            rc = self._refcount[p]
            if rc < 0:
                raise InvariantViolation(f"page {p} has negative reference count {rc}")
            if (rc == 0) != (p in free):
                state = "free" if p in free else "not free"
                raise InvariantViolation(f"page {p} has reference count {rc} but is {state}")
