"""Prefix caching in the scheduler and the page pool, with the fake model of tests/fake_model.py
(no jax, milliseconds each): matching, the pool's cached state and LRU eviction, salts, reset,
and hashes that agree across processes. The fake reads every matched page back, so a page
matched with the wrong content fails the step that uses it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.scheduler import InvariantViolation, PagePool, PagePoolError, Scheduler
from jaxserve.scheduler import prefix_cache
from jaxserve.types import InvalidRequestError, SamplingParams

from fake_model import FakeModel, RunResult, expected_output, run_to_completion, step_once

VOCAB = 64


def make(**kw) -> tuple[Scheduler, FakeModel]:
    base = dict(num_pages=64, max_model_len=256, page_size=4, max_num_batched_tokens=64)
    sched = Scheduler(SchedulerConfig(**(base | kw)))
    return sched, FakeModel.for_scheduler(sched, VOCAB)


def toks(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 1) % VOCAB for i in range(n)]


def run_one(sched, fake, rid, prompt, params, res=None):
    """Admit, run to completion; returns (first plan row of the request, outputs)."""
    (sid,) = sched.add_request(rid, prompt, params)
    res = res or RunResult()
    plan, _ = step_once(sched, fake, res)
    first = next(s for s in plan.seqs if s.seq_id == sid)
    r = run_to_completion(sched, fake, result=res)
    return first, r.outputs[sid], sid


# ---- the pool ---------------------------------------------------------------------------------

def test_pool_caches_freed_hashed_pages_and_evicts_lru_only_when_needed():
    pool = PagePool(6)  # 5 usable
    a = pool.allocate(3)
    for i, p in enumerate(a):
        assert pool.register(p, b"h%d" % i)
    assert pool.register(a[0], b"h0")  # the same content again: a no-op
    with pytest.raises(PagePoolError, match="other content"):
        pool.register(a[0], b"zz")
    b = pool.allocate(1)
    assert not pool.register(b[0], b"h1")  # h1 is a[1]'s: b stays private
    pool.free([a[2], a[1], a[0]])  # tail first, so the head is evicted last
    pool.free(b)
    pool.check()
    assert (pool.num_free, pool.num_cached, pool.num_hashed) == (5, 3, 3)
    assert [pool.lookup(b"h%d" % i) for i in range(3)] == a
    pool.touch([a[0]])  # a hit on a cached page: held again, out of the LRU list
    assert pool.refcount(a[0]) == 1 and pool.num_cached == 2 and pool.num_free == 4
    got = pool.allocate(2)  # the 2 truly free pages first: nothing evicted
    assert pool.num_evictions == 0 and set(got).isdisjoint(a)
    got += pool.allocate(1)  # now the least recently freed cached page goes: a[2]
    assert got[-1] == a[2] and pool.num_evictions == 1 and pool.lookup(b"h2") is None
    assert pool.lookup(b"h1") == a[1]
    pool.check()
    with pytest.raises(PagePoolError, match="touch of free page"):
        pool.free(got)
        pool.touch([got[0]])
    pool.check()


@pytest.mark.parametrize("bad", ["touch_twice", "touch_null", "register_unheld", "touch_free"])
def test_pool_refuses_and_stays_unchanged(bad):
    pool = PagePool(5)
    a = pool.allocate(2)
    pool.register(a[0], b"x")
    pool.free([a[0]])  # cached
    calls = {"touch_twice": lambda: pool.touch([a[0], a[0]]),
             "touch_null": lambda: pool.touch([0]),
             "register_unheld": lambda: pool.register(a[0], b"y"),
             "touch_free": lambda: pool.touch([a[0], 4])}
    with pytest.raises(PagePoolError):
        calls[bad]()
    assert pool.num_cached == 1 and pool.refcount(a[0]) == 0 and pool.refcount(a[1]) == 1
    pool.check()


def test_pool_check_catches_a_cached_page_that_is_also_free():
    pool = PagePool(4)
    (p,) = pool.allocate(1)
    pool.register(p, b"x")
    pool.free([p])
    pool._free.append(p)  # corrupt: both cached and free
    with pytest.raises(InvariantViolation, match="both free and cached"):
        pool.check()


def test_pool_without_caching_frees_hashed_pages_at_once():
    pool = PagePool(4, cache_freed=False)
    a = pool.allocate(2)
    pool.register(a[0], b"x")
    pool.incref([a[0]])
    pool.free([a[0]])
    assert pool.lookup(b"x") == a[0]  # still held: still matchable (n > 1 sharing)
    pool.free(a)
    assert pool.num_cached == 0 and pool.lookup(b"x") is None and pool.num_free == 3
    pool.check()


# ---- hashes -------------------------------------------------------------------------------------

def test_hashes_chain_and_are_salted():
    r = prefix_cache.root_hash(None)
    assert r == prefix_cache.root_hash("") != prefix_cache.root_hash("tenant-a")
    assert prefix_cache.private_root(1) not in (prefix_cache.private_root(2), r)
    h1 = prefix_cache.page_hash(r, [1, 2, 3, 4])
    assert h1 == prefix_cache.page_hash(r, (1, 2, 3, 4)) != prefix_cache.page_hash(r, [1, 2, 3, 5])
    assert prefix_cache.page_hash(h1, [5]) != prefix_cache.page_hash(r, [5])  # the parent counts
    assert prefix_cache.page_hash(r, [1, 23]) != prefix_cache.page_hash(r, [12, 3])


def test_hashes_are_equal_in_another_process():
    """Multi-host lockstep needs every process to make the same hits: no per-process salting
    (Python's hash() of bytes and str changes with PYTHONHASHSEED)."""
    code = ("from jaxserve.scheduler import prefix_cache as c; "
            "r = c.root_hash('t'); print(c.page_hash(c.page_hash(r, [1, 2]), [3]).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "", "PYTHONPATH": ":".join(sys.path)}
                           ).stdout.strip() for seed in ("1", "2")}
    here = prefix_cache.page_hash(prefix_cache.page_hash(prefix_cache.root_hash("t"), [1, 2]), [3])
    assert outs == {here.hex()}


# ---- admission ----------------------------------------------------------------------------------

@pytest.mark.parametrize("plen", [1, 3, 4, 5, 8, 9, 15, 16, 17])
def test_a_repeated_prompt_matches_its_full_pages_and_computes_the_rest(plen):
    sched, fake = make()
    p = SamplingParams(max_tokens=3, seed=1)
    first, out1, sid1 = run_one(sched, fake, "a", toks(plen), p)
    assert first.start_pos == 0
    second, out2, sid2 = run_one(sched, fake, "b", toks(plen), p)
    # Every full page before the last token: at least one token is always computed.
    assert second.start_pos == ((plen - 1) // 4) * 4 and second.sample
    assert out1 == out2 == expected_output(toks(plen), p, vocab_size=VOCAB)[0]
    assert sched.prefix_cache_hits == second.start_pos
    assert sched.prefix_cache_queries == 2 * plen


def test_a_longer_prompt_matches_the_shared_head_and_outputs_are_cached_too():
    sched, fake = make()
    p = SamplingParams(max_tokens=9, seed=2)
    _, out, _ = run_one(sched, fake, "a", toks(10), p)
    # The next turn: the whole history (prompt + answer) and more. The answer's full pages were
    # computed as decodes and registered as they filled.
    turn2 = toks(10) + out + toks(6, 5)
    second, out2, _ = run_one(sched, fake, "b", turn2, p)
    assert second.start_pos == ((10 + 9 - 1) // 4) * 4  # 16: the last answer token was never fed
    assert out2 == expected_output(turn2, p, vocab_size=VOCAB)[0]
    third, _, _ = run_one(sched, fake, "c", toks(6) + [63, 63, 63], p)  # diverges in page 1
    assert third.start_pos == 4


def test_concurrent_equal_prompts_share_once_computed():
    sched, fake = make(max_num_batched_tokens=12, max_num_seqs=8)
    p = SamplingParams(max_tokens=4, seed=3)
    (a,) = sched.add_request("a", toks(17), p)
    res = RunResult()
    step_once(sched, fake, res)  # a computes 12 tokens: pages 0-2 registered
    (b,) = sched.add_request("b", toks(17), p)
    plan, _ = step_once(sched, fake, res)
    row = next(s for s in plan.seqs if s.seq_id == b)
    assert row.start_pos == 12  # while a still runs
    assert row.block_table[:3] == next(s for s in plan.seqs if s.seq_id == a).block_table[:3]
    r = run_to_completion(sched, fake, result=res)
    assert r.outputs[a] == r.outputs[b] == expected_output(toks(17), p, vocab_size=VOCAB)[0]


def test_different_salts_never_share_a_page():
    sched, fake = make()
    p_a, p_b = SamplingParams(max_tokens=4, cache_salt="tenant-a"), SamplingParams(max_tokens=4, cache_salt="tenant-b")
    first, _, _ = run_one(sched, fake, "a1", toks(20), p_a)
    other, _, _ = run_one(sched, fake, "b1", toks(20), p_b)
    assert other.start_pos == 0  # tenant b does not hit tenant a's cached prompt
    again, _, _ = run_one(sched, fake, "a2", toks(20), p_a)
    assert again.start_pos == 16  # tenant a does
    # While both run at once, no page is in both block tables.
    (x,) = sched.add_request("a3", toks(20), p_a)
    (y,) = sched.add_request("b3", toks(20), p_b)
    plan, _ = step_once(sched, fake)
    tables = {s.seq_id: set(s.block_table) for s in plan.seqs}
    assert tables[x].isdisjoint(tables[y])
    unsalted, _, _ = run_one(sched, fake, "u", toks(20), SamplingParams(max_tokens=4))
    assert unsalted.start_pos == 0
    run_to_completion(sched, fake)


def test_caching_off_shares_nothing_between_requests():
    sched, fake = make(enable_prefix_caching=False)
    p = SamplingParams(max_tokens=4)
    run_one(sched, fake, "a", toks(20), p)
    second, _, _ = run_one(sched, fake, "b", toks(20), p)
    assert second.start_pos == 0
    assert sched.num_cached_pages == 0 and sched.prefix_cache_queries == 0


def test_n_samples_hit_the_cache_and_share_with_caching_off():
    for caching in (True, False):
        sched, fake = make(enable_prefix_caching=caching)
        p = SamplingParams(max_tokens=5, n=3, seed=4)
        sids = sched.add_request("n", toks(13), p)
        res = RunResult()
        run_to_completion(sched, fake, result=res)
        assert fake.max_refcount_seen == 3, caching  # the followers held the leader's pages
        for i, s in enumerate(sids):
            assert res.outputs[s] == expected_output(toks(13), p, i, vocab_size=VOCAB)[0]


def test_eviction_under_pressure_keeps_pages_in_use_and_runs_what_fits_without_cache():
    # 8 usable pages of 4 tokens. Fill the cache with other prompts, then run a request that
    # needs the whole pool: cached pages are evicted for it, and it runs.
    sched, fake = make(num_pages=9, max_model_len=64)
    p = SamplingParams(max_tokens=2)
    for k in range(4):
        run_one(sched, fake, f"fill{k}", toks(9, k + 1), p)
    cached, evicted = sched.num_cached_pages, sched.num_prefix_evictions
    assert cached >= 6 and sched.num_free_pages == 8  # cached pages count as available
    big = SamplingParams(max_tokens=4, seed=9)
    first, out, _ = run_one(sched, fake, "big", toks(29, 7), big)  # 32 tokens of KV: all 8 pages
    assert first.start_pos == 0 and out == expected_output(toks(29, 7), big, vocab_size=VOCAB)[0]
    assert sched.num_prefix_evictions - evicted == cached  # every cached page made room
    # Under pressure with live requests: two requests share a cached head; a third forces
    # evictions and preemptions. Every step checks that no held page was handed out again.
    res = RunResult()
    sids = [sched.add_request(f"r{k}", toks(12, 7) + toks(k + 1, k), SamplingParams(max_tokens=12, seed=k))[0]
            for k in range(3)]
    r = run_to_completion(sched, fake, result=res)
    for k, sid in enumerate(sids):
        assert r.outputs[sid] == expected_output(toks(12, 7) + toks(k + 1, k),
                                                 SamplingParams(max_tokens=12, seed=k), vocab_size=VOCAB)[0]
    assert sched.num_preemptions_total > 0


def test_invariants_catch_a_sequence_holding_a_hashed_page_it_has_not_computed():
    sched, fake = make()
    (a,) = sched.add_request("a", toks(9), SamplingParams(max_tokens=3))
    step_once(sched, fake)
    seq = sched.get_sequence(a)
    seq.num_computed_tokens = 3  # as if page 0 were still being written
    with pytest.raises(InvariantViolation, match="write into a shared page"):
        sched.check_invariants()


def test_reset_forgets_every_prefix():
    sched, fake = make()
    p = SamplingParams(max_tokens=3)
    run_one(sched, fake, "a", toks(20), p)
    (b,) = sched.add_request("b", toks(30, 2), SamplingParams(max_tokens=20))
    step_once(sched, fake)  # b holds hashed pages while the cache is reset
    cached = sched.num_cached_pages
    assert cached > 0 and sched.reset_prefix_cache() == cached
    assert sched.num_cached_pages == 0 and sched.page_pool.num_hashed == 0
    sched.check_invariants()
    again, _, _ = run_one(sched, fake, "c", toks(20), p)
    assert again.start_pos == 0
    assert sched.num_cached_pages > 0  # c and b cached afresh (b's pages after the reset only)


def test_a_salt_is_validated():
    with pytest.raises(InvalidRequestError, match="^cache_salt:"):
        SamplingParams(cache_salt=b"x")
    with pytest.raises(InvalidRequestError, match="^cache_salt:"):
        SamplingParams(cache_salt="x" * 513)
