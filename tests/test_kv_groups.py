"""Two KV page groups (scheduler/window.py, model/paged_attention.GroupedKV) on the tiny Gemma 3
golden (tests/data/gemma3_local_global: 5 layers, sliding, sliding, global, sliding, sliding,
window W = 8) with 4-token pages, so windows straddle pages: the global layer keeps every page
in the full group's pool, the four sliding layers' own pool frees the pages that leave their
window. Every freed (or cached, nobody holding it) sliding page is overwritten with NaN after
the step that let it go, so a single read of one would turn the logits to NaN (the XLA
attention multiplies masked probabilities, exact zeros, by the values it reads), and the greedy
ids still equal the dense reference, which keeps its whole cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import byte_tokenizer, dense_forward, make_engine

import checkpoints
from jaxserve.config import ModelConfig
from jaxserve.model.decoder import KVCache
from jaxserve.model.paged_attention import GroupedKV
from jaxserve.scheduler import invariants
from jaxserve.scheduler.admission import peak_pages
from jaxserve.scheduler.page_pool import NULL_PAGE
from jaxserve.scheduler.window import live_pages
from jaxserve.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
W, PS, CHUNK = 8, 4, 8
# One engine shape for every test here (one compiled bucket of 8 tokens, reused).
SHAPE = dict(max_model_len=64, page_size=PS, max_num_seqs=6, max_num_batched_tokens=CHUNK, token_buckets=(CHUNK,))


@pytest.fixture(scope="module")
def gemma():
    model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "gemma3_local_global", "float32")
    assert model.cfg.kv_groups() == ((2,), (0, 1, 3, 4)) and model.cfg.sliding_window == W
    return model


@pytest.fixture(scope="module")
def gemma_logits(gemma):
    return dense_forward(gemma)


def _greedy(logits_of, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(logits_of([seq])[0, len(seq) - 1].argmax()))
    return seq[len(prompt):]


def _poison_sliding(eng, pages):
    """NaN into `pages` of every sliding layer's K and V, on the host (no compilation)."""
    def nan(a):
        h = np.array(a)
        h[:, sorted(pages)] = np.nan
        return jax.device_put(h, a.sharding)
    c = eng.runner.cache
    eng.runner.cache = c._replace(sliding=KVCache(nan(c.sliding.k), nan(c.sliding.v)))


def _run(eng, requests, params):
    """Runs to completion, poisoning every free sliding page (nobody holds it and no prefix can
    match it: freed behind the window) right after the step that let it go, and asserting
    none is handed out again (the pool is large and reuses free pages first in, first out).
    Returns the outputs and, per step, each sequence's held sliding pages."""
    sched = eng.scheduler
    spool = sched.sliding_page_pool
    for rid, p in requests.items():
        eng.add_request({"prompt_token_ids": p}, params, request_id=rid)
    held, poisoned = [], set()
    while eng.has_unfinished():
        eng.step()
        invariants.check_invariants(sched)
        now = {s.seq_id: live_pages(s, s.sliding_pages) for s in sched._seqs.values()}
        assert not poisoned & {p for pages in now.values() for p in pages}, "a poisoned page was reused"
        unheld = {p for p in range(1, spool.num_total) if spool.refcount(p) == 0 and spool.hash_of(p) is None}
        unheld -= poisoned
        # Only pages once written: never-used pages are zeros, and poisoning them proves nothing.
        unheld &= {p for s in eng._seen_sliding for p in s}
        if unheld:
            _poison_sliding(eng, unheld)
            poisoned |= unheld
        held.append({s.request_id: len(now[s.seq_id]) for s in sched._seqs.values()})
        eng._seen_sliding.extend(now.values())
    # With prefix caching on a page let go is cached (it keeps a hash), so nothing is free.
    assert poisoned or eng.scheduler.config.enable_prefix_caching, "no sliding page was let go"
    return {rid: [o.token_ids for o in eng.pop_finished(rid).outputs] for rid in requests}, held


def _engine(model, **kw):
    eng = make_engine(model, byte_tokenizer(), **SHAPE, **kw)
    assert isinstance(eng.runner.cache, GroupedKV)
    eng._seen_sliding = []
    return eng


def test_freed_sliding_pages_are_never_read(gemma, gemma_logits):
    """Prompts of 30, 21 and 13 tokens (past the window) prefilled in 8-token chunks across
    the window edge, n = 2, speculative decoding on (greedy drafts verified, rejected ones'
    pages reused), prefix caching off: every sliding page freed behind the window is NaN from
    the step it was freed in; the greedy ids equal the dense reference's. The sliding pages a
    sequence holds stay within peak_pages: (W - 1 + chunk + drafts) / page + 1, against the
    full group's one page per 4 tokens."""
    eng = _engine(gemma, num_pages=96, num_speculative_tokens=2, enable_prefix_caching=False)
    prompts = {"a": list(range(3, 33)), "b": list(range(40, 61)), "c": [5, 9, 2, 7, 11, 4, 8, 6, 1, 12, 10, 3, 14]}
    out, held = _run(eng, prompts, SamplingParams(temperature=0.0, max_tokens=16, n=2, ignore_eos=True))
    assert eng.scheduler.pages_freed_by_window > 0 and eng.compiles_after_warmup == 0
    for rid, p in prompts.items():  # (the dense reference compiles here, after the engine ran)
        assert out[rid] == [_greedy(gemma_logits, p, 16)] * 2, rid
    bound = peak_pages(eng.scheduler.config, 64, W)
    assert bound == -(-(W - 1 + CHUNK + 2) // PS) + 1 == 6
    assert max(h for step in held for h in step.values()) <= bound
    invariants.check_idle_invariant(eng.scheduler)


def test_prefix_cache_with_two_groups(gemma, gemma_logits):
    """Prefix caching on: a request sharing a 24-token prefix with an earlier, finished one
    matches the full group's pages of the whole prefix and the sliding group's inside the
    window before its resume point only (its table holds the null page behind it, asserted);
    n = 2 followers match the leader's pages the same way. Greedy ids equal the dense
    reference's, so every matched page of both groups held the K/V a recompute would write.
    (Preemption with two groups: tests/test_families.py's paged Gemma runs, whose 13-page
    pools preempt.)"""
    eng = _engine(gemma, num_pages=96)
    sched = eng.scheduler
    shared = list(range(3, 27))
    out, _ = _run(eng, {"x": shared + [30, 31]}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hits = sched.prefix_cache_hits
    eng.add_request({"prompt_token_ids": shared + [40]}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                    request_id="w")
    eng.step()  # w's admission: 6 matched pages, resume at 24, whose window starts at 17
    w = next(iter(sched._seqs.values()))
    assert w.sliding_pages[:4] == [NULL_PAGE] * 4 and NULL_PAGE not in w.sliding_pages[4:] + w.pages
    out2, _ = _run(eng, {"z": shared + [40]}, SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True))
    assert sched.prefix_cache_hits - hits >= 3 * 24, (sched.prefix_cache_hits, hits)  # w, z, z's follower
    assert out["x"] == [_greedy(gemma_logits, shared + [30, 31], 12)]
    assert out2["z"] == [_greedy(gemma_logits, shared + [40], 12)] * 2
    assert [o.token_ids for o in eng.pop_finished("w").outputs] == out2["z"][:1]
    invariants.check_idle_invariant(sched)


def test_two_groups_change_no_output_bit(gemma, monkeypatch):
    """The same Gemma requests with its layers forced into one KV group (the engine as it was:
    one cache, one block table, nothing freed) and in two: every sampled token and its logprob
    is identical to the bit (same kernels, same arithmetic: a freed page's masked weight is an
    exact zero either way), and a one-group engine's cache and step arrays are exactly the
    one-group ones (a KVCache of every layer, no sliding inputs)."""
    prompts = {"a": list(range(3, 33)), "b": list(range(40, 61))}
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, logprobs=1, ignore_eos=True)

    def run(eng):
        for rid, p in prompts.items():
            eng.add_request({"prompt_token_ids": p}, params, request_id=rid)
        while eng.has_unfinished():
            eng.step()
        return {rid: [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs])
                      for o in eng.pop_finished(rid).outputs] for rid in prompts}

    two = _engine(gemma, num_pages=96)
    got_two = run(two)
    assert two.scheduler.pages_freed_by_window > 0
    monkeypatch.setattr(ModelConfig, "kv_groups", lambda self: (tuple(range(self.num_layers)),))
    one = make_engine(gemma, byte_tokenizer(), **SHAPE, num_pages=96)
    c = one.runner.cache
    assert isinstance(c, KVCache) and c.k.shape == (5, 96, PS, 2 * 16)
    assert one.scheduler.sliding_page_pool is None and one.scheduler.pages_freed_by_window == 0
    assert one.runner.arrays.abstract_inputs(CHUNK).sliding_slot_mapping is None
    assert run(one) == got_two


def test_kv_usage_reports_the_fuller_group():
    """The server's KV usage (jaxserve_kv_pages_*, vllm:kv_cache_usage_perc) is the fuller
    group's pages: here a 40-token prompt's first 16-token chunk holds 4 of the full pool's 63
    pages and 4 of the sliding pool's 7, then 2 of those once the window has moved past."""
    from jaxserve.config import SchedulerConfig
    from jaxserve.scheduler import Scheduler
    cfg = SchedulerConfig(num_pages=64, page_size=4, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                          sliding_window=W, num_sliding_pages=8)
    sched = Scheduler(cfg)
    assert sched.kv_pages() == (0, 63)
    sched.add_request("r", list(range(40)), SamplingParams(max_tokens=4))
    plan = sched.schedule()
    assert sched.kv_pages() == (4, 7)  # 16 tokens: 4 pages of each pool, the sliding one fuller
    sched.update(plan, {})
    assert sched.kv_pages() == (2, 7)  # the next query (16) sees 9..: pages 0 and 1 freed
    assert sched.page_pool.num_total - 1 - sched.page_pool.num_free == 4


def test_grouped_cache_shapes_int8_and_tp_specs(gemma):
    """The cache of each group holds only its layers and pages, in either format, and the tp
    sharding rules split both groups' KV heads (no compilation: shapes only)."""
    from jaxserve.model.paged_attention import index_in_group, init_paged_cache
    from sharding import rules
    cfg = gemma.cfg
    assert index_in_group(cfg).tolist() == [0, 1, 0, 2, 3]  # layer 2 is the full group's only one
    for kv_dtype in ("auto", "int8"):
        c = jax.eval_shape(lambda: init_paged_cache(cfg, 10, PS, np.float32, kv_dtype, num_sliding_pages=6))
        assert isinstance(c, GroupedKV)
        values = [(x if kv_dtype == "auto" else x.values).shape for x in (c.full.k, c.sliding.v)]
        assert values == [(1, 10, PS, 2 * 16), (4, 6, PS, 2 * 16)], kv_dtype
        specs = rules.cache_specs(c)
        assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)) \
            == jax.tree.structure(c)
    with pytest.raises(ValueError, match="one KV group"):
        init_paged_cache(dataclasses.replace(cfg, layer_types=None), 10, PS, np.float32, num_sliding_pages=6)


def test_a_match_shrinks_to_the_sliding_pages_still_cached():
    """Scheduler and fake model only: a finished 24-token prompt leaves its 6 pages cached in
    both pools. The same prompt plus one token matches all 6 full pages, and needs the sliding
    pages inside the window of position 24 (17..23: pages 4 and 5); with page 5 evicted from the
    sliding pool the match shrinks to 5 pages, whose window (13..19: pages 3 and 4) is cached,
    so it resumes at 20 with the null page in its sliding table before page 3 (the fake reads
    both tables back, so a wrong page would fail the run)."""
    from fake_model import FakeModel, run_to_completion, step_once

    from jaxserve.config import SchedulerConfig
    from jaxserve.scheduler import Scheduler
    from jaxserve.scheduler.prefix_cache import page_hash, root_hash
    cfg = SchedulerConfig(num_pages=32, page_size=PS, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                          sliding_window=W, num_sliding_pages=32)
    sched = Scheduler(cfg)
    fake = FakeModel.for_scheduler(sched)
    prompt = list(range(1, 25))
    sched.add_request("a", prompt, SamplingParams(max_tokens=1))
    run_to_completion(sched, fake)
    spool = sched.sliding_page_pool
    assert spool.num_cached == sched.page_pool.num_cached == 6
    h = root_hash(None)
    for i in range(6):
        h = page_hash(h, prompt[i * PS:(i + 1) * PS])
    spool.forget([spool.lookup(h)])  # the sliding page 5 of the prefix: evicted
    sched.add_request("b", prompt + [30], SamplingParams(max_tokens=1))
    plan, _ = step_once(sched, fake)
    (s,) = plan.seqs
    assert s.start_pos == 20 and s.token_ids == (21, 22, 23, 24, 30)
    assert s.sliding_table[:3] == (NULL_PAGE,) * 3 and NULL_PAGE not in s.sliding_table[3:] + s.block_table
    assert sched.prefix_cache_hits == 20
    run_to_completion(sched, fake)
