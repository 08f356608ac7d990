"""Sliding-window KV page freeing (jaxserve/scheduler/window.py) on mistral_swa (every layer
windowed, W = 8, pages of 4: windows straddle pages). Freed pages go back to the pool and the
sequence's block table entry becomes the null page; here every free page is overwritten with
NaN after every step, so a single read of a freed page would turn the logits to NaN, and the
greedy tokens still equal the dense reference (which keeps its whole cache). A long sequence
holds a bounded number of pages, where full attention would hold one per 4 tokens."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import byte_tokenizer, dense_forward, make_engine

import checkpoints
from jaxserve.model.decoder import KVCache
from jaxserve.scheduler import invariants
from jaxserve.scheduler.admission import peak_pages
from jaxserve.scheduler.page_pool import NULL_PAGE
from jaxserve.scheduler.window import freeable_window, live_pages
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
W, PS = 8, 4


@pytest.fixture(scope="module")
def swa():
    model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "mistral_swa", "float32")
    assert model.cfg.sliding_window == W and freeable_window(model.cfg) == W
    return model


@pytest.fixture(scope="module")
def swa_logits(swa):
    return dense_forward(swa)  # one compile for the module's references


def _greedy(logits_of, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(logits_of([seq])[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


def _poison(eng, pages):
    """NaN into `pages` of every layer's K and V, on the host (no compilation)."""
    def nan(a):
        h = np.array(a)
        h[:, sorted(pages)] = np.nan
        return jax.device_put(h, a.sharding)
    c = eng.runner.cache
    eng.runner.cache = KVCache(nan(c.k), nan(c.v))


def _run(eng, requests, params, poison=False):
    """Runs to completion; with `poison`, every page a sequence let go of behind its window is
    overwritten with NaN right after the step that freed it. Returns outputs and, per step,
    each sequence's held pages."""
    for rid, p in requests.items():
        eng.add_request({"prompt_token_ids": p}, params, request_id=rid)
    held, poisoned = [], set()
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        before = {s.seq_id: set(live_pages(s)) for s in eng.scheduler._seqs.values()}
        eng.step()
        invariants.check_invariants(eng.scheduler)
        pool = eng.scheduler._pool
        now = {s.seq_id: set(live_pages(s)) for s in eng.scheduler._seqs.values()}
        freed = {p for sid, pages in before.items() if sid in now for p in pages - now[sid]
                 if pool.refcount(p) == 0 and pool.hash_of(p) is None}
        assert not poisoned & {p for pages in now.values() for p in pages}, "a poisoned page was reused"
        if poison and freed:
            _poison(eng, freed)
            poisoned |= freed
        held.append({s.request_id: len(now[s.seq_id]) for s in eng.scheduler._seqs.values()})
    assert not poison or poisoned, "nothing was freed behind the window"
    return {rid: [o.token_ids for o in eng.pop_finished(rid).outputs] for rid in requests}, held


def test_freed_pages_are_never_read(swa, swa_logits):
    """Chunked prefill across the window edge (8-token budget), decodes and n = 2; every freed
    page NaN from the step it was freed in (the pool is large and reuses pages first in, first
    out, so no poisoned page is handed out again: asserted). The XLA attention multiplies
    masked probabilities (exact zeros) by the values it reads, so reading a NaN page even
    masked would poison the output: greedy ids equal to the dense model's mean none was read.
    Prefix caching off, so freed pages are free rather than cached for later matches."""
    tok = byte_tokenizer()
    eng = make_engine(swa, tok, max_model_len=64, page_size=PS, num_pages=96, max_num_seqs=6,
                      max_num_batched_tokens=8, token_buckets=(8,), enable_prefix_caching=False)
    prompts = {"a": list(range(3, 33)), "b": list(range(40, 61)), "c": [5, 9, 2, 7, 11, 4, 8, 6, 1, 12, 10, 3, 14]}
    out, _ = _run(eng, prompts, SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True), poison=True)
    assert eng.scheduler.pages_freed_by_window > 0 and eng.compiles_after_warmup == 0
    for rid, p in prompts.items():
        assert out[rid] == [_greedy(swa_logits, p, 16)] * 2, rid
    invariants.check_idle_invariant(eng.scheduler)


def test_a_long_sequence_holds_a_bounded_number_of_pages(swa, swa_logits):
    """56 tokens (a 24-token prompt, 32 generated): full attention holds 14 pages at the end;
    here at most ceil((W - 1 + chunk) / PS) + 1 = 5 (the window behind the step's first
    token, the step's chunk of up to 8 tokens, one page of misalignment). The pool has 7
    usable pages, fewer than the 14 the sequence spans, so freed pages are reused under it."""
    eng = make_engine(swa, byte_tokenizer(), max_model_len=64, page_size=PS, num_pages=8, max_num_seqs=2,
                      max_num_batched_tokens=8, token_buckets=(8,))
    prompt = list(range(7, 31))
    out, held = _run(eng, {"x": prompt}, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert out["x"] == [_greedy(swa_logits, prompt, 32)]
    per_step = [h["x"] for h in held if "x" in h]
    assert max(per_step) <= -(-(W - 1 + 8) // PS) + 1, per_step
    assert per_step[-1] <= 3, per_step  # decoding: the 8-token window spans at most 3 pages


def test_a_prefix_match_holds_no_page_behind_the_window(swa, swa_logits):
    """n = 2, prefix caching on: the follower is admitted once the leader has computed the
    shared 20 prompt tokens, matching all 5 of the leader's prompt pages by hash; the 3 wholly
    behind its window (positions 0..11; its first query, at 20, sees 13..) are not held: their
    entries are the null page and a sample never holds more than peak_pages. Every cached
    page nobody holds is NaN from the step it was let go of (the large pool hands out free
    pages first, so none is reused: asserted), and both greedy samples still equal the dense
    reference. The first test's engine shapes (compiled programs reused)."""
    eng = make_engine(swa, byte_tokenizer(), max_model_len=64, page_size=PS, num_pages=96, max_num_seqs=6,
                      max_num_batched_tokens=8, token_buckets=(8,))
    sched, pool = eng.scheduler, eng.scheduler.page_pool
    prompt = list(range(3, 27))  # 24 tokens: the follower shares ((24 - 1) // 4) * 4 = 20
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True),
                    request_id="x")
    peak = peak_pages(sched.config, len(prompt) + 8 - 1, W)
    follower_table, poisoned = None, set()
    while eng.has_unfinished():
        eng.step()
        invariants.check_invariants(sched)
        held = {p for s in sched._seqs.values() for p in live_pages(s)}
        assert not held & poisoned, "a poisoned page was held again"
        for s in sched._seqs.values():
            assert len(live_pages(s)) <= peak, (s.sample_index, s.pages, peak)
            if s.sample_index == 1 and s.pages and follower_table is None:
                follower_table = list(s.pages)  # after the step that admitted it
        cached = {p for p in range(1, sched.num_total_pages) if pool.refcount(p) == 0 and pool.hash_of(p)}
        if cached - poisoned:
            _poison(eng, cached - poisoned)
            poisoned |= cached
    # After its first step (tokens 20..23) the 4th page is behind the window too.
    assert follower_table[:4] == [NULL_PAGE] * 4 and NULL_PAGE not in follower_table[4:], follower_table
    assert sched.prefix_cache_hits >= 20 and len(poisoned) >= 3
    assert [o.token_ids for o in eng.pop_finished("x").outputs] == [_greedy(swa_logits, prompt, 8)] * 2
