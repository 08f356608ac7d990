"""Prefix sharing between the n samples of one request (one prefill for n > 1).

All n sequences are admitted at once (all or nothing). The leader (sample 0) prefills the
prompt's full pages, `shared_len = ((P - 1) // page_size) * page_size` tokens, and stops its
chunk there while any follower still waits, so the followers can join it before it samples.
A follower is admitted only once its leader has computed those tokens; the leader has then
registered those full pages in the prefix cache (prefix_cache.py) and the follower's admission
matches them like any cached prefix: it holds the leader's pages (pages the leader never
writes again) and computes just the prompt tail, 1..page_size tokens, sampling with its own
seed. The tail is never shared: each sample writes its own last prompt token and outputs.
With prefix caching off the samples of a request still hash their pages, under a root private
to the request, so this sharing works the same and nothing is shared between requests.

A follower never holds pages while waiting, so preemption can always reclaim every page and
the admission guarantee (one sample alone fits the pool) still means the oldest sequence
progresses. No waiting when P <= page_size (nothing full to share), when the leader finished
before the follower was admitted, or after the follower itself was preempted: it is then
admitted as soon as it fits, with whatever prefix the cache still holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxserve.scheduler.sequence import Sequence


def shared_prefix_len(prompt_len: int, page_size: int, n: int) -> int:
    """Prompt tokens the followers take from the leader: whole pages, never the last token."""
    return ((prompt_len - 1) // page_size) * page_size if n > 1 else 0


def leader_chunk_cap(seq: Sequence, group: Iterable[Sequence]) -> int:
    """The most tokens `seq` may compute this step as far as sharing is concerned."""
    if seq.sample_index == 0 and seq.params.n > 1:
        for f in group:
            if f.share_from is seq and seq.num_computed_tokens < f.shared_len:
                return f.shared_len - seq.num_computed_tokens
    return seq.num_uncomputed_tokens


def follower_ready(seq: Sequence) -> bool:
    """Whether a waiting `seq` may be admitted: False while its leader has yet to compute the
    shared pages (the follower waits; others may pass it)."""
    leader = seq.share_from
    if leader is None:
        return True
    if leader.is_finished:
        seq.share_from = None  # nothing left to wait for: match what the cache holds
        return True
    return leader.num_computed_tokens >= seq.shared_len
