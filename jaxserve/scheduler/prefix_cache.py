"""Automatic prefix caching: full KV pages named by a chained content hash, matched at admission.

A sequence's page i (tokens [i * page_size, (i + 1) * page_size)) is named by

    h_0 = sha256(b"jaxserve-prefix-v1" | namespace | salt)          the sequence's root
    h_{i+1} = sha256(h_i | the page's token ids)                     page i's hash

so a page's hash covers every token before it and the salt: equal hashes mean equal K/V (the
model is a function of the prefix), and two salts never share a page. hashlib, not Python's
`hash`: every process of a multi-host job must make the same hits (engine/lockstep.py), and
`hash` of bytes is randomized per process.

Life of a page (page_pool.py has the states): once a sequence has computed a page's last token
the scheduler `register`s it under its hash; at admission a waiting sequence's pages are looked
up in order and the longest run of hits is taken (`touch`), so only the rest is prefilled. The
last page is never matched whole: at least one token must be computed for the first sampled
token's logits, and a page someone still writes is never shared (only full, computed pages
carry a hash). A freed page keeps its hash and K/V until `allocate` needs it (LRU).

Salts: `SamplingParams.cache_salt` (the server derives one per tenant) picks the user namespace.
With caching off (`enable_prefix_caching=False`) the same mechanism still shares the prompt
pages of one request's n samples (sharing.py), under a root private to that request, and a
page nobody holds is freed at once; a request with n = 1 then hashes nothing.

Sliding-window models: a page that leaves every layer's window is released (window.py) only
after it was registered here, so while cached it holds exactly the K/V a recompute would
write and matching stays exact; a prefix whose head was evicted simply stops matching.
Mixed models (a sliding KV group of their own): a match needs the full layers' pages of the
whole prefix and the sliding layers' pages of the window before the resume point
(window.sliding_match shrinks the match until both hold).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from jaxserve.scheduler.page_pool import NULL_PAGE, PagePool

if TYPE_CHECKING:
    from jaxserve.scheduler.sequence import Sequence

_TAG = b"jaxserve-prefix-v1\0"


def root_hash(salt: str | None) -> bytes:
    """The root of every request with this cache salt (None and "" are the same, unsalted)."""
    return hashlib.sha256(_TAG + b"user\0" + (salt or "").encode("utf-8")).digest()


def private_root(arrival_index: int) -> bytes:
    """A root no other request shares (caching off: only a request's own samples match)."""
    return hashlib.sha256(_TAG + b"request\0" + str(arrival_index).encode()).digest()


def page_hash(parent: bytes, tokens) -> bytes:
    # Decimal text, not fixed-width ints: the scheduler accepts any non-negative id.
    return hashlib.sha256(parent + ",".join(map(str, tokens)).encode()).digest()


def extend_hashes(seq: Sequence, num_pages: int, page_size: int) -> list[bytes]:
    """The hashes of `seq`'s first `num_pages` pages (all their tokens must be known); kept on
    the sequence, so each page is hashed once in its life, preemptions included."""
    hashes = seq.page_hashes
    while len(hashes) < num_pages:
        i = len(hashes)
        parent = hashes[-1] if hashes else seq.hash_root
        hashes.append(page_hash(parent, seq.token_slice(i * page_size, (i + 1) * page_size)))
    return hashes


def match(pool: PagePool, seq: Sequence, page_size: int) -> list[int]:
    """The pages holding `seq`'s longest cached prefix, leaving at least one token to compute."""
    if seq.hash_root is None:
        return []
    limit = (seq.num_tokens - 1) // page_size
    pages = []
    # Hash as far as the hits go: a miss on page 0 costs one hash, not a whole prompt's.
    for i in range(limit):
        h = extend_hashes(seq, i + 1, page_size)[i]
        p = pool.lookup(h)
        if p is None:
            break
        pages.append(p)
    return pages


def register_computed(pool: PagePool, seq: Sequence, page_size: int,
                      sliding_pool: PagePool | None = None) -> None:
    """Offer every page `seq` has fully computed since the last call to the cache; with a
    sliding KV group (window.py) its page of the same index too, under the same hash, in its
    own pool (`num_hashed_pages` counts both: they are offered together)."""
    if seq.hash_root is None:
        return
    full = min(seq.num_computed_tokens // page_size, len(seq.pages))
    if seq.num_hashed_pages >= full:
        return
    hashes = extend_hashes(seq, full, page_size)
    for i in range(seq.num_hashed_pages, full):
        pool.register(seq.pages[i], hashes[i])
        if sliding_pool is not None and seq.sliding_pages[i] != NULL_PAGE:
            sliding_pool.register(seq.sliding_pages[i], hashes[i])
    seq.num_hashed_pages = full
