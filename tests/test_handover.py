"""Prefill/decode handover (engine/handover.py, scheduler/handover.py, engine/kv_pages.py): a
prefill engine runs each request to its first token and hands its KV pages to a decode engine
of the same model, which decodes the rest. The streams (token ids and text, per sample) must be
exactly a colocated engine's: greedy, seeded sampling, n > 1, stop strings held back across the
handover, int8 KV, a sliding-window model with two KV groups, prefix caching on the prefill
side; both engines' page pools pass their invariants after every step and end idle (no page
held). Requests are added in waves so handovers land while the decode engine is mid-batch.

Why exact equality: the decode engine's cache holds, page for page, the values the prefill
engine computed (moved in their stored layout, no conversion), each draw's key comes from the
sample's seed and position, and the engine's tests already hold it to the same tokens however
a request's tokens are split into steps (test_engine.py)."""

from __future__ import annotations

import collections

import checkpoints
import numpy as np
import pytest
from conftest import ROOT, byte_tokenizer, make_engine

from jaxserve.engine import compile_watch
from jaxserve.engine.handover import HandoverRefused
from jaxserve.scheduler.handover import NoRoomForHandover
from jaxserve.types import SamplingParams

SHAPE = dict(page_size=4, num_pages=64, max_num_seqs=6, max_num_batched_tokens=32, token_buckets=(8, 32))


def workload(seed: int, n: int = 9, vocab: int = 256, shared: bool = False):
    rng = np.random.default_rng(seed)
    base = rng.integers(3, vocab, 40).tolist()
    out = []
    for i in range(n):
        length = int(rng.integers(2, 38))
        prompt = (base[:length] if shared else rng.integers(3, vocab, length).tolist()) + [3 + i]
        kw = dict(max_tokens=int(rng.integers(2, 10)), ignore_eos=True, temperature=0.0)
        if i % 3 == 1:
            kw.update(temperature=0.9, seed=100 + i)
        if i % 4 == 2:
            kw.update(n=2, temperature=0.9, seed=200 + i)
        if i == 5:
            kw.update(stop=["\x05\x06\x07"])  # held back while a prefix of it may come
        out.append((prompt, SamplingParams(**kw)))
    return out


def _collect(streams, deltas):
    for d in deltas:
        s = streams[(d.request_id, d.index)]
        s["ids"].extend(d.token_ids)
        s["text"] += d.text
        if d.finished:
            s["finish"] = d.finish_reason


def _new_streams():
    return collections.defaultdict(lambda: {"ids": [], "text": "", "finish": None})


def colocated(eng, work, waves=3):
    streams = _new_streams()
    per = -(-len(work) // waves)
    for w in range(waves):
        for i, (prompt, params) in enumerate(work[w * per:(w + 1) * per], start=w * per):
            eng.add_request({"prompt_token_ids": prompt}, params, request_id=str(i))
        for _ in range(3):
            _collect(streams, eng.step())
    while eng.has_unfinished():
        _collect(streams, eng.step())
    return dict(streams)


def disaggregated(p, d, work, waves=3, abort=()):
    """Prefill engine `p`, decode engine `d`: handovers moved between their steps (retried while
    the decode side has no room). Requests in `abort` are aborted on the decode side right after
    they arrive there. Returns the joined streams and how many handovers moved."""
    streams = _new_streams()
    per = -(-len(work) // waves)
    waiting, moved = [], 0
    compiles = compile_watch.compiles()  # process-wide: both engines (and their warm-ups) are done

    def tick():
        nonlocal moved
        _collect(streams, p.step())
        p.scheduler.check_invariants()
        waiting.extend(p.pop_handover(rid) for rid in list(p.handovers))
        while waiting:
            h, data = waiting[0]
            try:
                d.import_request(h, data)
            except NoRoomForHandover:
                break
            waiting.pop(0)
            moved += 1
            if h.request_id in abort:
                d.abort_request(h.request_id)
        d.scheduler.check_invariants()
        _collect(streams, d.step())
        d.scheduler.check_invariants()

    for w in range(waves):
        for i, (prompt, params) in enumerate(work[w * per:(w + 1) * per], start=w * per):
            p.add_request({"prompt_token_ids": prompt}, params, request_id=str(i), hand_over=True)
        for _ in range(3):
            tick()
    for _ in range(500):
        if not (p.has_unfinished() or d.has_unfinished() or waiting or p.handovers):
            break
        tick()
    else:
        raise AssertionError("the two engines did not drain")
    assert compile_watch.compiles() == compiles, "a handover compiled something after warm-up"
    return dict(streams), moved


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_handed_over_streams_equal_colocated(tiny, kv):
    model, tok = tiny
    work = workload(1)
    engines = [make_engine(model, tok, handover=True, **SHAPE, kv_cache_dtype=kv) for _ in range(3)]
    want = colocated(engines[0], work)
    got, moved = disaggregated(engines[1], engines[2], work)
    assert moved >= len(work) - 1, f"only {moved} of {len(work)} requests were handed over"
    assert got == want
    for e in engines:
        assert e.scheduler.num_free_pages == e.scheduler.num_total_pages - 1


def test_prefix_cached_prompts_hand_over_their_matched_pages_too(tiny):
    """Prompts sharing a prefix: the prefill engine matches cached pages, the decode engine gets
    every page of the prompt (cached or computed) and decodes the colocated tokens."""
    model, tok = tiny
    work = workload(2, shared=True)
    a, p, d = (make_engine(model, tok, handover=True, **SHAPE) for _ in range(3))
    want = colocated(a, work)
    got, _ = disaggregated(p, d, work)
    assert got == want
    assert p.prefix_cache_stats()["hits"] > 0, "the workload was meant to hit the prefix cache"


def test_a_sliding_window_model_hands_over_both_kv_groups():
    """The tiny Gemma 3 (sliding and global layers, two KV page groups): prompts longer than
    the window, so the sliding group's table has null entries behind it when handed over."""
    model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "gemma3_local_global", "float32")
    tok = byte_tokenizer()
    work = workload(3, vocab=model.cfg.vocab_size)
    shape = dict(SHAPE, num_pages=96)
    a, p, d = (make_engine(model, tok, handover=True, **shape, enable_prefix_caching=False) for _ in range(3))
    want = colocated(a, work)
    got, moved = disaggregated(p, d, work)
    assert moved >= len(work) - 1
    assert got == want
    assert p.scheduler.pages_freed_by_window + d.scheduler.pages_freed_by_window > 0


def test_aborts_after_the_handover_free_pages_on_both_sides(tiny):
    model, tok = tiny
    work = workload(4)
    p, d = (make_engine(model, tok, handover=True, **SHAPE) for _ in range(2))
    got, moved = disaggregated(p, d, work, abort={"0", "3"})
    assert got[("0", 0)]["finish"] == "abort" and got[("3", 0)]["finish"] == "abort"
    for e in (p, d):
        e.scheduler.check_idle_invariant()


def test_a_decode_engine_of_another_layout_refuses_the_handover(tiny):
    model, tok = tiny
    p = make_engine(model, tok, handover=True, **SHAPE)
    d = make_engine(model, tok, handover=True, **SHAPE, kv_cache_dtype="int8")
    p.add_request({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=4, temperature=0.0), "r", hand_over=True)
    while not p.handovers:
        p.step()
    h, data = p.pop_handover("r")
    with pytest.raises(HandoverRefused, match="kv_cache_dtype"):
        d.import_request(h, data)
    d.scheduler.check_idle_invariant()
    p.scheduler.check_idle_invariant()


def test_a_full_decode_engine_says_no_room_and_changes_nothing(tiny):
    model, tok = tiny
    p = make_engine(model, tok, handover=True, **SHAPE)
    d = make_engine(model, tok, handover=True, **dict(SHAPE, max_num_seqs=1))
    for rid in ("a", "b"):
        p.add_request({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=6, temperature=0.0), rid, hand_over=True)
    while len(p.handovers) < 2:
        p.step()
    d.import_request(*p.pop_handover("a"))
    with pytest.raises(NoRoomForHandover, match="max_num_seqs"):
        d.import_request(*p.pop_handover("b"))
    d.scheduler.check_invariants()
    assert d.scheduler.num_running == 1
