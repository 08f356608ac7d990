"""Backpressure, cancellation and deadlines against a real loopback server (fake model).

- Ten times the queue limit at once: exactly the overflow is RESOURCE_EXHAUSTED, before
  tokenizing; n > 1 admitted all or nothing; the token bound likewise.
- Cancel while queued (ours, the engine's), mid-prefill, at first token, mid-decode and while
  preempted: the engine is held in that phase (EngineLoop.pause from its step hook), the client
  cancels, and the abort frees the pages with no step in between; the id is reusable.
- Deadlines give DEADLINE_EXCEEDED and abort within one step; 64 streams with random cancels
  and deadlines under preemption lose nothing.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from jaxserve.scheduler.sequence import SeqStatus
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import (aborted, check_stream, fake_server, find_request_id, gen_stub,
                                 wait_idle, wait_until)


def _codes(futures):
    out = []
    for f in futures:
        try:
            f.result(timeout=30)
            out.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            out.append(e.code())
    return out


def _burst(s, requests):
    """Send all at once with the engine held, wait until every refusal is back; then release."""
    stub = gen_stub(s)
    el = s.server.engine_loop
    el.pause()
    futs = [stub.GenerateUnary.future(r) for r in requests]
    fe = s.server.frontend
    # Every call has been answered or admitted: refusals are done, the rest sit in the queue.
    wait_until(lambda: sum(f.done() for f in futs) + el.num_waiting_here == len(futs), 20, "the burst")
    queued = (s.server.limiter.queued_samples, s.server.limiter.queued_tokens, fe.stats["tokenized"])
    el.resume()
    return _codes(futs), queued


def test_ten_times_the_queue_limit_gives_exact_resource_exhausted():
    with fake_server(server={"max_queued_requests": 8}) as s:
        codes, (samples, _, tokenized) = _burst(s, [pb.GenerateRequest(prompt=f"r{i}", max_tokens=2)
                                                    for i in range(80)])
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 72
        assert codes.count(grpc.StatusCode.OK) == 8
        assert samples == 8 and tokenized == 8  # the refused ones were never tokenized
        reg = s.server.metrics.registry
        assert reg.get_sample_value("jaxserve_rejected_requests_total", {"reason": "queue_full"}) == 72
        wait_idle(s)


def test_n_samples_are_admitted_all_or_nothing():
    with fake_server(server={"max_queued_requests": 8}) as s:
        codes, (samples, _, _) = _burst(s, [pb.GenerateRequest(prompt=f"r{i}", max_tokens=2, n=3)
                                             for i in range(30)])
        assert samples == 6  # two requests of 3; a third would need 9 > 8
        assert codes.count(grpc.StatusCode.OK) == 2
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 28
        # A request that could never fit is a client error, not "retry later".
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(pb.GenerateRequest(prompt="x", n=9), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("n:")
        wait_idle(s)


def test_queued_prompt_tokens_are_bounded():
    with fake_server(server={"max_queued_tokens": 100}) as s:
        ids = pb.TokenIds(ids=list(range(65, 105)))  # 40 tokens
        codes, (_, tokens, _) = _burst(s, [pb.GenerateRequest(prompt_token_ids=ids, max_tokens=2)
                                           for _ in range(10)])
        # 0 -> 40 -> 80 -> 120 tokens queued; from 120 >= 100 on, refused.
        assert tokens == 120 and codes.count(grpc.StatusCode.OK) == 3
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 7
        wait_idle(s)


# ---- cancellation in every phase ------------------------------------------------------------

def _seq(eng, rid, i=0):
    state = eng.get_request(rid)
    return None if state is None else eng.scheduler.get_sequence(state.samples[i].seq_id)


def _pages_held(eng) -> int:
    sched = eng.scheduler
    return sum(len(sched.get_sequence(s.seq_id).pages) for rid in sched.live_request_ids()
               for s in eng.get_request(rid).samples if s.finish_reason is None)


def _cancel_in_phase(s, requests, victim: str, reached, read_tokens: int = 0):
    """Start `requests` (client ids), hold the engine when `reached(engine, victim_id)` after a
    step, cancel the victim's stream, and check its pages are free before any further step."""
    stub = gen_stub(s)
    el, eng = s.server.engine_loop, s.server.engine
    el.pause()
    streams, ids = {}, {}
    for r in requests:  # one at a time: concurrent calls may be admitted in any order
        streams[r.request_id] = stub.Generate(r, timeout=60)
        ids[r.request_id] = find_request_id(s, r.request_id)
    rid = ids[victim]
    el.on_step = lambda loop: loop.pause() if reached(eng, rid) else None
    if not reached(eng, rid):
        el.resume()
        wait_until(lambda: el.paused, 20, "the phase")
    got = 0
    while got < read_tokens:
        got += len(next(streams[victim]).token_ids)
    steps = el.steps
    streams[victim].cancel()
    wait_until(lambda: aborted(s, rid) is not None, 10, "the abort")
    asked, done = aborted(s, rid)
    assert done == asked == steps  # handled while held: no step between cancel and free
    assert rid not in eng.scheduler.live_request_ids() and eng.get_request(rid) is None
    eng.scheduler.check_invariants()
    sched = eng.scheduler
    assert sched.num_free_pages == sched.num_total_pages - 1 - _pages_held(eng)
    assert s.server.limiter.queued_samples == sum(1 for c in ids.values() if c != rid
                                                  and (eng.get_request(c) is None
                                                       or eng.get_request(c).metrics.first_scheduled_time is None))
    el.on_step = None
    el.resume()
    for cid, st in streams.items():
        if cid != victim:
            check_stream(list(st))
    wait_idle(s)
    # The id is free again.
    again = [r for r in requests if r.request_id == victim][0]
    check_stream(list(stub.Generate(again, timeout=60)))


def _req(cid, n_prompt=6, max_tokens=30):
    return pb.GenerateRequest(request_id=cid, prompt_token_ids=pb.TokenIds(ids=[70 + (i + len(cid)) % 20 for i in range(n_prompt)]),
                              max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def phase_server():
    # 8 tokens per step, so a 40-token prompt takes 5 prefill steps.
    with fake_server(max_num_batched_tokens=8, max_num_seqs=4, step_delay_s=0.002) as s:
        yield s


def test_cancel_while_queued_in_the_server(phase_server):
    s = phase_server
    # Held before its first step: it sits in the server's priority queue, not in the engine.
    _cancel_in_phase(s, [_req("q")], "q", lambda eng, rid: eng.get_request(rid) is None)


def test_cancel_mid_prefill(phase_server):
    def mid_prefill(eng, rid):
        seq = _seq(eng, rid)
        return seq is not None and 0 < seq.num_computed_tokens < 40
    _cancel_in_phase(phase_server, [_req("p", n_prompt=40)], "p", mid_prefill)


def test_cancel_at_first_token(phase_server):
    def first(eng, rid):
        st = eng.get_request(rid)
        return st is not None and len(st.samples[0].token_ids) == 1
    _cancel_in_phase(phase_server, [_req("f")], "f", first, read_tokens=1)


def test_cancel_mid_decode(phase_server):
    def mid(eng, rid):
        st = eng.get_request(rid)
        return st is not None and len(st.samples[0].token_ids) == 5
    _cancel_in_phase(phase_server, [_req("d")], "d", mid, read_tokens=5)


def test_cancel_while_waiting_in_the_engine():
    with fake_server(max_num_seqs=1, max_num_batched_tokens=8) as s:
        def in_engine_waiting(eng, rid):
            st = eng.get_request(rid)
            return st is not None and st.metrics.first_scheduled_time is None
        _cancel_in_phase(s, [_req("long", max_tokens=200), _req("w")], "w", in_engine_waiting)


def test_cancel_while_preempted():
    # 6 usable pages of 4 tokens: each request needs 5 pages at most, both together need 10,
    # so the later one is preempted by recompute as the first grows.
    with fake_server(page_size=4, num_pages=7, max_num_batched_tokens=8, max_num_seqs=4) as s:
        def preempted(eng, rid):
            seq = _seq(eng, rid)
            return seq is not None and seq.num_preemptions > 0 and seq.status is SeqStatus.WAITING
        _cancel_in_phase(s, [_req("a", n_prompt=8, max_tokens=12), _req("b", n_prompt=8, max_tokens=12)],
                         "b", preempted)
        assert s.server.engine.stats["preemptions"] >= 1


# ---- deadlines -------------------------------------------------------------------------------

def test_deadline_mid_decode_aborts_within_one_step(phase_server):
    s = phase_server
    stub = gen_stub(s)
    stream = stub.Generate(_req("dl", max_tokens=250), timeout=0.4)
    rid = find_request_id(s, "dl")
    with pytest.raises(grpc.RpcError) as e:
        list(stream)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: aborted(s, rid) is not None, 10, "the abort")
    asked, done = aborted(s, rid)
    assert done - asked <= 1
    wait_idle(s)


def test_deadline_while_queued(phase_server):
    s = phase_server
    el = s.server.engine_loop
    el.pause()
    try:
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(_req("dq"), timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: el.num_waiting_here == 0, 10, "the queued request to be dropped")
        assert s.server.limiter.queued_samples == 0
    finally:
        el.resume()
    wait_idle(s)


def test_random_cancels_and_deadlines_under_preemption_lose_nothing():
    rng = random.Random(7)
    with fake_server(page_size=4, num_pages=40, max_num_seqs=16, max_num_batched_tokens=32,
                     step_delay_s=0.001) as s:
        stub = gen_stub(s)
        plans = [(i, rng.choice(["finish", "cancel", "deadline"]), rng.randint(0, 12)) for i in range(64)]

        def run(plan):
            i, how, k = plan
            req = pb.GenerateRequest(prompt=f"load {i}", max_tokens=10 + i % 30, seed=i, ignore_eos=True,
                                     n=1 + (i % 5 == 0))
            stream = stub.Generate(req, timeout=0.05 + k * 0.01 if how == "deadline" else 60)
            msgs = []
            try:
                for m in stream:
                    msgs.append(m)
                    if how == "cancel" and len(msgs) > k:
                        stream.cancel()
                        return how, None, None
            except grpc.RpcError as e:
                return how, e.code(), None
            return how, grpc.StatusCode.OK, (req, msgs)

        # Hold the engine while the calls arrive, so they really compete for the 39 pages.
        el = s.server.engine_loop
        el.pause()
        lasting = sum(how != "deadline" for _, how, _ in plans)  # short deadlines expire while held
        with ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(run, p) for p in plans]
            try:
                wait_until(lambda: el.num_waiting_here >= lasting, 20, "the calls to arrive")
            finally:
                el.resume()
            results = [f.result() for f in futures]
        for how, code, done in results:
            if how == "finish":
                assert code == grpc.StatusCode.OK
            assert code in (None, grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED), code
            if done is not None:
                req, msgs = done
                check_stream(msgs, req.n)
        wait_idle(s)
        assert s.server.engine.stats["preemptions"] > 0
        assert s.server.engine.compiles_after_warmup == 0
        log = s.server.engine_loop.abort_log
        assert log and all(done - asked <= 1 for _, asked, done in log)
