"""Scheduler tests with the fake model of tests/fake_model.py (no jax, milliseconds each)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jaxserve.config import ConfigError, SchedulerConfig
from jaxserve.scheduler import (InvariantViolation, PagePool, PagePoolError, Scheduler,
                                SchedulerError, SeqStatus)
from jaxserve.types import FinishReason, InvalidRequestError, SamplingParams

# tests/ is on sys.path under pytest (rootdir-relative test module without __init__.py)
from fake_model import FakeModel, RunResult, expected_output, run_to_completion, step_once

VOCAB = 64


def make(vocab=VOCAB, **kw) -> tuple[Scheduler, FakeModel]:
    kw.setdefault("num_pages", 64)
    kw.setdefault("max_model_len", 256)
    sched = Scheduler(SchedulerConfig(**kw))
    return sched, FakeModel.for_scheduler(sched, vocab)


def prompt_of(length: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 1) % VOCAB for i in range(length)]


def expect(sched, prompt, params, idx=0, eos=(), vocab=VOCAB):
    return expected_output(prompt, params, idx, eos, sched.config.max_model_len, vocab)


# ---- config and page pool ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(num_pages=1), "num_pages"),
    (dict(page_size=0), "page_size"),
    (dict(max_model_len=-3), "max_model_len"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(max_prompt_len=300), "max_prompt_len"),
    (dict(max_output_len=0), "max_output_len"),
    (dict(max_preemptions_per_request=-1), "max_preemptions_per_request"),
])
def test_config_errors_name_the_field(kw, field):
    args = dict(num_pages=8, max_model_len=256) | kw
    with pytest.raises(ConfigError, match=f"^{field}:"):
        SchedulerConfig(**args)


def test_config_defaults():
    cfg = SchedulerConfig(num_pages=8, max_model_len=100)
    assert (cfg.page_size, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (16, 64, 512)
    assert cfg.max_prompt_len == cfg.max_output_len == 100
    assert cfg.max_preemptions_per_request == 4 and cfg.num_usable_pages == 7


def test_page_pool_verbs():
    pool = PagePool(5)
    assert pool.num_total == 5 and pool.num_free == 4
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    a = pool.allocate(3)
    assert 0 not in a and len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(PagePoolError):
        pool.allocate(2)  # all or nothing
    assert pool.num_free == 1
    pool.incref(a[:2])
    assert [pool.refcount(p) for p in a] == [2, 2, 1]
    pool.free(a)
    assert [pool.refcount(p) for p in a] == [1, 1, 0] and pool.num_free == 2
    pool.free(a[:2])
    assert pool.num_free == 4
    pool.check()


@pytest.mark.parametrize("bad", ["double", "null", "never", "incref_free", "incref_null", "range"])
def test_page_pool_refuses_and_stays_unchanged(bad):
    pool = PagePool(4)
    a = pool.allocate(2)
    calls = {
        "double": lambda: pool.free([a[0], a[0]]),
        "null": lambda: pool.free([a[1], 0]),
        "never": lambda: pool.free([a[0], 3]),
        "incref_free": lambda: pool.incref([a[0], 3]),
        "incref_null": lambda: pool.incref([0]),
        "range": lambda: pool.free([4]),
    }
    with pytest.raises(PagePoolError):
        calls[bad]()
    assert [pool.refcount(p) for p in range(4)] == [0, 1, 1, 0] and pool.num_free == 1
    pool.check()


def test_scheduler_does_not_import_jax():
    code = ("import sys, jaxserve.scheduler; "
            "print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- admission ----------------------------------------------------------------------------------

ADMISSION_CASES = [
    # (prompt_len, params kwargs, request id, field, words the message must contain)
    (0, {}, "a", "prompt", ["at least one"]),
    (41, {}, "a", "prompt", ["41", "max_prompt_len=40"]),
    (4, dict(max_tokens=31), "a", "max_tokens", ["31", "max_output_len=30"]),
    (40, dict(max_tokens=25), "a", "max_tokens", ["40", "25", "max_model_len=64"]),
    (30, dict(max_tokens=30), "a", "max_tokens", ["KV pages", "15"]),  # needs 15 pages, pool has 12
    (4, {}, "", "request_id", ["non-empty"]),
]


@pytest.mark.parametrize("plen, pkw, rid, field, words", ADMISSION_CASES)
def test_admission_errors_name_field_and_limit(plen, pkw, rid, field, words):
    sched, fake = make(num_pages=13, page_size=4, max_model_len=64, max_prompt_len=40,
                       max_output_len=30)
    with pytest.raises(InvalidRequestError) as ei:
        sched.add_request(rid, prompt_of(plen), SamplingParams(n=3, **pkw))
    assert ei.value.field == field
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert not sched.has_unfinished() and sched.num_waiting == 0
    sched.check_idle_invariant()  # nothing allocated, nothing registered
    # the next request goes through
    p = SamplingParams(max_tokens=5)
    (sid,) = sched.add_request("ok", prompt_of(6), p)
    r = run_to_completion(sched, fake)
    assert (r.outputs[sid], r.finish[sid]) == expect(sched, prompt_of(6), p)


def test_admission_pool_limit_is_per_sample_and_exact():
    # 12 usable pages of 4 tokens: prompt + max_tokens - 1 = 48 KV tokens fit exactly.
    sched, fake = make(num_pages=13, page_size=4, max_model_len=64)
    p = SamplingParams(max_tokens=29, n=4)
    sids = sched.add_request("fits", prompt_of(20), p)  # n=4 samples run one after another
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        sched.add_request("too-big", prompt_of(20), SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequestError, match="prompt"):
        sched.add_request("bad-token", [1, -1], SamplingParams())
    r = run_to_completion(sched, fake)
    for i, sid in enumerate(sids):
        assert (r.outputs[sid], r.finish[sid]) == expect(sched, prompt_of(20), p, i)


def test_duplicate_live_request_id_rejected_then_reusable():
    sched, fake = make()
    sched.add_request("x", prompt_of(5), SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError) as ei:
        sched.add_request("x", prompt_of(5), SamplingParams(max_tokens=3))
    assert ei.value.field == "request_id"
    assert sched.num_waiting == 1
    run_to_completion(sched, fake)
    sched.add_request("x", prompt_of(5), SamplingParams(max_tokens=3))  # finished: id free again
    assert sched.abort_request("x") and not sched.has_unfinished()
    sched.add_request("x", prompt_of(5), SamplingParams(max_tokens=3))  # aborted: free again
    run_to_completion(sched, fake)


# ---- batching -----------------------------------------------------------------------------------

def test_chunked_prefill_keeps_decodes_going():
    sched, fake = make(num_pages=200, max_model_len=2048, max_num_batched_tokens=256,
                       max_num_seqs=8)
    short = SamplingParams(max_tokens=40)
    decoders = [sched.add_request(f"d{i}", prompt_of(5, i), short)[0] for i in range(3)]
    res = RunResult()
    step_once(sched, fake, res)  # the three prompts prefill and sample in one step
    long_params = SamplingParams(max_tokens=5)
    (long_id,) = sched.add_request("long", prompt_of(1000), long_params)
    chunks = []
    for _ in range(4):
        plan, _ = step_once(sched, fake, res)
        by_id = {s.seq_id: s for s in plan.seqs}
        assert plan.num_tokens <= 256
        for d in decoders:  # every running decode gets its one token in every step
            assert len(by_id[d].token_ids) == 1 and by_id[d].sample
        lg = by_id[long_id]
        chunks.append((lg.start_pos, len(lg.token_ids), lg.sample))
    assert chunks == [(0, 253, False), (253, 253, False), (506, 253, False), (759, 241, True)]
    r = run_to_completion(sched, fake, result=res)
    assert (r.outputs[long_id], r.finish[long_id]) == expect(sched, prompt_of(1000), long_params)


def test_budget_and_seq_slots_respected():
    sched, fake = make(num_pages=400, max_model_len=512, max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(8):
        sched.add_request(f"r{i}", prompt_of(15 + i, i), SamplingParams(max_tokens=6))
    r = run_to_completion(sched, fake, keep_plans=True)
    assert all(p.num_tokens <= 20 and len(p.seqs) <= 3 for p in r.plans)
    assert max(p.num_tokens for p in r.plans) == 20


def run_mix(pool_pages, n_req=6, page_size=4, **kw):
    sched, fake = make(num_pages=pool_pages, page_size=page_size, max_model_len=64, **kw)
    reqs = []
    for i in range(n_req):
        p = SamplingParams(max_tokens=14 + i, seed=i, n=1 + i % 3)
        prompt = prompt_of(9 + 2 * i, i)
        reqs.append((sched.add_request(f"r{i}", prompt, p), prompt, p))
    r = run_to_completion(sched, fake, keep_plans=True)
    for plan in r.plans:  # nothing is admitted in a step that preempted
        assert not set(plan.preempted) & {s.seq_id for s in plan.seqs}
    outs = {(rid, i): (r.outputs[sid], r.finish[sid]) for rid, (sids, _, _) in enumerate(reqs)
            for i, sid in enumerate(sids)}
    for rid, (sids, prompt, p) in enumerate(reqs):
        for i in range(len(sids)):
            assert outs[(rid, i)] == expect(sched, prompt, p, i)
    return sched, outs, r


def test_preemption_output_equals_big_pool_run():
    big_sched, big, _ = run_mix(pool_pages=400)
    assert big_sched.num_preemptions_total == 0
    # 8 usable pages: the largest sample needs pages_for(19 + 18) = 10 -> tighter than one request
    small_sched, small, r = run_mix(pool_pages=11)
    assert small_sched.num_preemptions_total > 0
    assert any(p.preempted for p in r.plans)
    assert small == big


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_sequence_resumes_by_recompute(caching):
    sched, fake = make(num_pages=9, page_size=4, max_model_len=64, max_num_batched_tokens=64,
                       enable_prefix_caching=caching)
    pa, pb = SamplingParams(max_tokens=20, seed=1), SamplingParams(max_tokens=20, seed=2)
    (a,) = sched.add_request("a", prompt_of(8, 1), pa)
    (b,) = sched.add_request("b", prompt_of(8, 2), pb)
    res = RunResult()
    while not sched.num_preemptions_total:
        step_once(sched, fake, res)
    victim = sched.get_sequence(b)  # the newer request yields
    assert victim.status is SeqStatus.WAITING and victim.pages == [] and victim.output_ids
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    plan, _ = step_once(sched, fake, res)
    while b not in {s.seq_id for s in plan.seqs}:
        plan, _ = step_once(sched, fake, res)
    resumed = next(s for s in plan.seqs if s.seq_id == b)
    if caching:  # it re-matches the full pages it left cached (those not evicted since)
        assert resumed.start_pos > 0 and resumed.start_pos % 4 == 0
        assert resumed.start_pos + len(resumed.token_ids) > 8
    else:  # prompt + outputs so far, all recomputed
        assert resumed.start_pos == 0 and len(resumed.token_ids) > 8
    r = run_to_completion(sched, fake, result=res)
    assert (r.outputs[a], r.outputs[b]) == (expect(sched, prompt_of(8, 1), pa)[0],
                                            expect(sched, prompt_of(8, 2), pb)[0])


@pytest.mark.parametrize("limit", [0, 1, 4])
def test_no_starvation_under_constant_pressure(limit):
    # Prefix caching off: this pins the preemption policy's own dynamics (with caching a
    # re-admitted victim skips its cached pages, which changes when inversions happen; the
    # fuzz tests cover the policy with caching on).
    sched, fake = make(num_pages=13, page_size=4, max_model_len=64, max_num_seqs=4,
                       max_num_batched_tokens=16, max_preemptions_per_request=limit,
                       enable_prefix_caching=False)
    res = RunResult()
    arrived, finished, expected, k = {}, {}, {}, 0
    inversions = 0  # victims older than a protected sequence that kept running
    for step in range(600):
        while sched.num_waiting < 3:  # keep the queue full: more work than the pool holds
            p = SamplingParams(max_tokens=10 + k % 13, seed=k)
            prompt = prompt_of(5 + (k * 7) % 20, k)
            (sid,) = sched.add_request(f"q{k}", prompt, p)
            arrived[sid], expected[sid] = step, expect(sched, prompt, p)
            k += 1
        oldest = min(sched._running + sched._waiting, key=lambda s: s.priority)
        before = {s.seq_id: s.priority for s in sched._running}
        plan, events = step_once(sched, fake, res)
        if oldest.status is SeqStatus.RUNNING:  # the top-priority sequence progresses every step
            assert oldest.seq_id in {s.seq_id for s in plan.seqs}
        # every victim ranked below every sequence that kept running
        kept = [before[s.seq_id] for s in sched._running if s.seq_id in before]
        for v in plan.preempted:
            assert all(before[v] > q for q in kept), (before[v], kept)
            inversions += any(q[0] == 0 and q[2] > before[v][2] for q in kept)  # [2]: arrival
        finished.update((e.seq_id, step) for e in events if e.finished)
    for sid in finished:
        assert (res.outputs[sid], res.finish[sid]) == expected[sid]
    assert len(finished) > 40 and sched.num_preemptions_total > 0
    # FCFS with 3 waiting and ~2 running at a time, ~10 steps per request: a request waits for
    # about 5 others (observed max ~90 steps); a starving one would never finish.
    latency = [finished[s] - arrived[s] for s in finished]
    assert max(latency) <= 120, max(latency)
    assert all(sid in finished for sid, t in arrived.items() if t < 540)
    if limit == 1:
        assert inversions > 0  # aging: a newer request preempted `limit` times outranked older ones


# ---- stops and ends -----------------------------------------------------------------------------

def test_eos_stop_tokens_and_ignore_eos():
    sched, fake = make()
    prompt = prompt_of(7)
    plain, _ = expect(sched, prompt, SamplingParams(max_tokens=12))
    eos = plain[3]
    cut = plain.index(eos) + 1
    cases = {
        "eos": (SamplingParams(max_tokens=12), [eos], (plain[:cut], FinishReason.STOP)),
        "ignore": (SamplingParams(max_tokens=12, ignore_eos=True), [eos], (plain, FinishReason.LENGTH)),
        "stop_id": (SamplingParams(max_tokens=12, stop_token_ids=[eos]), [], (plain[:cut], FinishReason.STOP)),
    }
    sids = {name: sched.add_request(name, prompt, p, e)[0] for name, (p, e, _) in cases.items()}
    r = run_to_completion(sched, fake)
    for name, (_, _, want) in cases.items():
        assert (r.outputs[sids[name]], r.finish[sids[name]]) == want


def test_finish_sequence_frees_pages():
    sched, fake = make(page_size=4)
    (sid,) = sched.add_request("s", prompt_of(9), SamplingParams(max_tokens=50))
    step_once(sched, fake)
    assert sched.num_free_pages < sched.num_total_pages - 1
    assert sched.finish_sequence(sid, FinishReason.STOP)
    assert sched.num_free_pages == sched.num_total_pages - 1 and not sched.has_unfinished()
    sched.check_idle_invariant()
    assert not sched.finish_sequence(sid)
    with pytest.raises(KeyError):
        sched.get_sequence(sid)


def _reach_phase(phase):
    """A scheduler with request "t" in `phase`, another request "o" beside it."""
    kw = dict(num_pages=9, page_size=4, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4)
    sched, fake = make(**kw)
    res = RunResult()
    sched.add_request("o", prompt_of(6, 1), SamplingParams(max_tokens=20))
    (t,) = sched.add_request("t", prompt_of(10 if phase == "prefill" else 5, 2),
                             SamplingParams(max_tokens=20))
    seq = sched.get_sequence(t)
    if phase == "queued":
        pass
    elif phase == "prefill":
        while seq.num_computed_tokens == 0:
            step_once(sched, fake, res)
        assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    elif phase == "first_token":
        while not seq.output_ids:
            step_once(sched, fake, res)
        assert len(seq.output_ids) == 1
    elif phase == "decode":
        while len(seq.output_ids) < 3:
            step_once(sched, fake, res)
    elif phase == "preempted":
        while not (seq.status is SeqStatus.WAITING and seq.num_preemptions):
            step_once(sched, fake, res)
    return sched, fake, res, t


@pytest.mark.parametrize("phase", ["queued", "prefill", "first_token", "decode", "preempted"])
def test_abort_in_each_phase_frees_pages_at_once(phase):
    sched, fake, res, t = _reach_phase(phase)
    other_pages = {p for s in sched._seqs.values() if s.request_id == "o" for p in s.pages}
    assert sched.abort_request("t") == [t]
    assert sched.num_free_pages == sched.num_total_pages - 1 - len(other_pages)
    sched.check_invariants()
    assert sched.abort_request("t") == [] and sched.abort_request("never-seen") == []
    p = SamplingParams(max_tokens=4)
    (again,) = sched.add_request("t", prompt_of(5, 3), p)  # the id is reusable at once
    r = run_to_completion(sched, fake, result=res)
    assert (r.outputs[again], r.finish[again]) == expect(sched, prompt_of(5, 3), p)


def test_abort_between_schedule_and_update():
    sched, fake = make()
    (a,) = sched.add_request("a", prompt_of(5), SamplingParams(max_tokens=5))
    (b,) = sched.add_request("b", prompt_of(6), SamplingParams(max_tokens=5))
    plan = sched.schedule()
    sampled = fake.step(plan)
    assert sched.abort_request("a") == [a]
    events = sched.update(plan, sampled)
    assert [e.seq_id for e in events] == [b]
    sched.check_invariants()
    run_to_completion(sched, fake)


def test_discarded_plan_leaves_a_consistent_state():
    sched, fake = make(page_size=4, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=6, n=2, seed=3)
    sids = sched.add_request("a", prompt_of(30), p)
    res = RunResult()
    step_once(sched, fake, res)  # the leader computes the shared 28 tokens
    plan = sched.schedule()  # the follower attaches: shared pages + its tail page
    assert len(plan.seqs) == 2
    sched.discard_plan(plan)  # e.g. the device step failed
    sched.check_invariants()
    (other,) = sched.add_request("b", prompt_of(7), SamplingParams(max_tokens=3))
    r = run_to_completion(sched, fake, result=res)
    assert [r.outputs[s] for s in sids] == [expect(sched, prompt_of(30), p, i)[0] for i in (0, 1)]
    assert r.outputs[other] == expect(sched, prompt_of(7), SamplingParams(max_tokens=3))[0]


def test_protocol_errors():
    sched, fake = make()
    sched.add_request("a", prompt_of(5), SamplingParams(max_tokens=5))
    plan = sched.schedule()
    with pytest.raises(SchedulerError):
        sched.schedule()
    with pytest.raises(SchedulerError, match="no sampled token"):
        sched.update(plan, {})
    plan = sched.schedule()  # the refused update consumed the plan; nothing advanced
    assert plan.seqs[0].start_pos == 0 and plan.seqs[0].sample
    sched.discard_plan(plan)
    with pytest.raises(SchedulerError):
        sched.update(plan, {})
    run_to_completion(sched, fake)


def test_idle_invariant_reports_what_is_wrong():
    sched, _ = make()
    sched.add_request("a", prompt_of(5), SamplingParams(max_tokens=5))
    with pytest.raises(InvariantViolation, match="not idle"):
        sched.check_idle_invariant()
    sched.abort_request("a")
    sched.page_pool.allocate(1)  # a leak
    with pytest.raises(InvariantViolation, match="free pages"):
        sched.check_idle_invariant()
    with pytest.raises(InvariantViolation, match="reference count"):
        sched.check_invariants()


def test_fake_model_catches_a_wrong_block_table():
    sched, fake = make(page_size=4)
    sched.add_request("a", prompt_of(6), SamplingParams(max_tokens=5))
    plan, _ = step_once(sched, fake)
    plan = sched.schedule()
    s = plan.seqs[0]
    swapped = dataclasses.replace(s, block_table=(s.block_table[1], s.block_table[0]))
    bad = dataclasses.replace(plan, seqs=(swapped,))
    with pytest.raises(AssertionError, match="read back"):
        fake.step(bad)


# ---- n > 1 --------------------------------------------------------------------------------------

def test_n_samples_share_the_prompt_pages_and_equal_independent_runs():
    sched, fake = make(page_size=4, num_pages=64, max_num_batched_tokens=64)
    prompt, p = prompt_of(23), SamplingParams(max_tokens=9, seed=100, n=4)
    sids = sched.add_request("n", prompt, p)
    res = RunResult()
    plan, _ = step_once(sched, fake, res, keep_plans=True)
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in plan.seqs] == [(sids[0], 0, 20)]
    plan, _ = step_once(sched, fake, res)
    # all four compute only the 3-token tail over the leader's 5 shared pages, and sample together
    assert sorted((s.start_pos, len(s.token_ids), s.sample) for s in plan.seqs) == [(20, 3, True)] * 4
    shared = plan.seqs[0].block_table[:5]
    assert all(s.block_table[:5] == shared for s in plan.seqs)
    assert all(sched.page_pool.refcount(pg) == 4 for pg in shared)
    r = run_to_completion(sched, fake, result=res)
    solo, solo_fake = make(page_size=4, num_pages=64)
    singles = [solo.add_request(f"s{i}", prompt, SamplingParams(max_tokens=9, seed=100 + i))[0]
               for i in range(4)]
    rs = run_to_completion(solo, solo_fake)
    assert [r.outputs[s] for s in sids] == [rs.outputs[s] for s in singles]
    assert len({tuple(r.outputs[s]) for s in sids}) > 1  # the seeds make the samples differ


def test_n_short_prompt_has_nothing_to_share():
    sched, fake = make(page_size=8)
    p = SamplingParams(max_tokens=5, n=3)
    sids = sched.add_request("n", prompt_of(8), p)
    res = RunResult()
    plan, _ = step_once(sched, fake, res)
    assert len(plan.seqs) == 3 and all(s.start_pos == 0 for s in plan.seqs)
    r = run_to_completion(sched, fake, result=res)
    assert fake.max_refcount_seen == 1
    assert [r.outputs[s] for s in sids] == [expect(sched, prompt_of(8), p, i)[0] for i in range(3)]


def test_n_followers_prefill_alone_when_the_leader_finished_first():
    sched, fake = make(page_size=4, max_num_seqs=1)  # one slot: followers cannot join the leader
    p = SamplingParams(max_tokens=3, seed=5, n=3)
    sids = sched.add_request("n", prompt_of(13), p)
    r = run_to_completion(sched, fake)
    assert fake.max_refcount_seen == 1
    assert [r.outputs[s] for s in sids] == [expect(sched, prompt_of(13), p, i)[0] for i in range(3)]


def test_n_with_preemption_equals_independent_runs():
    _, outs_small, _ = run_mix(pool_pages=13, n_req=9)
    _, outs_big, _ = run_mix(pool_pages=400, n_req=9)
    assert outs_small == outs_big
