"""The lockstep replay (jaxserve/engine/lockstep.py) in one process: a Leader around one fake
engine, `follow` on a second fake engine in a thread, and a queue standing in for the
collective. Random adds (n > 1, unseeded requests, stop strings, one too long to admit), aborts
and steps over a small page pool (so preemption happens) must give the follower the leader's
every step; the real collective is exercised by tests/test_multihost_serve.py."""

import queue
import threading
import time

import numpy as np
import pytest

from jaxserve.engine import lockstep
from jaxserve.server.fake_engine import make_fake_engine
from jaxserve.types import InvalidRequestError, SamplingParams
from sharding import host_messages

ENGINE = dict(num_pages=24, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96)


@pytest.fixture
def wire(monkeypatch):
    q: queue.SimpleQueue = queue.SimpleQueue()

    def exchange(payload):
        if payload is None:
            return q.get(timeout=30)
        q.put(payload)
        return payload

    monkeypatch.setattr(host_messages, "exchange", exchange)
    return q


def _key(deltas):
    return [(d.request_id, d.index, tuple(d.token_ids), d.text, d.finish_reason) for d in deltas]


def _start_follower(engine):
    steps, result = [], []
    real_step = engine.step
    engine.step = lambda: steps.append(_key(real_step()))  # follow() drops outputs; keep them here

    def run():
        try:
            result.append(lockstep.follow(engine))
        except BaseException as e:
            result.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, steps, result


def test_follower_replays_every_step_of_the_leader(wire):
    leader = lockstep.Leader(make_fake_engine(**ENGINE), tick_s=1e6)
    follower = make_fake_engine(**ENGINE)
    thread, follower_steps, result = _start_follower(follower)
    leader.warmup(progress=False)
    rng = np.random.default_rng(0)
    leader_steps, live, resets = [], [], 0
    base = rng.integers(32, 127, 24).tolist()  # a shared head, so prefix-cache hits happen
    with pytest.raises(InvalidRequestError):  # refused by the leader: never sent
        leader.add_request({"prompt_token_ids": [65] * 200}, SamplingParams(), request_id="too-long")
    for i in range(400):
        r = rng.random()
        if r < 0.25:
            plen = int(rng.integers(1, 30))
            params = SamplingParams(max_tokens=int(rng.integers(1, 30)), n=int(rng.choice([1, 2])),
                                    seed=None if rng.random() < 0.5 else int(rng.integers(0, 1000)),
                                    temperature=0.8, stop=["x"] if rng.random() < 0.3 else [])
            prompt = rng.integers(32, 127, plen).tolist()
            if rng.random() < 0.5:
                prompt = base[:int(rng.integers(1, 25))] + prompt[:4]
            live.append(leader.add_request({"prompt_token_ids": prompt}, params, request_id=f"r{i}"))
        elif r < 0.32 and live:
            leader.abort_request(live.pop(int(rng.integers(0, len(live)))))
        elif r < 0.335:
            leader.reset_prefix_cache()  # replayed: the follower must forget the same pages
            resets += 1
        elif leader.has_unfinished():
            leader_steps.append(_key(leader.step()))
    while leader.has_unfinished():
        leader_steps.append(_key(leader.step()))
    leader.close()
    thread.join(30)
    assert result == [len(leader_steps)], result
    assert follower_steps == leader_steps
    assert leader.stats["preemptions"] > 0  # the workload did reach that path
    assert resets > 0 and leader.prefix_cache_stats()["hits"] > 0
    assert follower.prefix_cache_stats() == leader.prefix_cache_stats()
    assert not follower.has_unfinished()
    follower.scheduler.check_idle_invariant()


def test_unseeded_requests_sample_with_the_leaders_seed(wire):
    """Unseeded requests draw from each engine's own random base seed; the follower must use
    the leader's draw, not its own."""
    leader = lockstep.Leader(make_fake_engine(**ENGINE), tick_s=1e6)
    follower = make_fake_engine(**ENGINE)
    assert leader._engine._base_seed != follower._base_seed
    thread, steps, result = _start_follower(follower)
    rid = leader.add_request({"prompt_token_ids": [65, 66]}, SamplingParams(max_tokens=3, n=2))
    seeds = [s.seed for s in leader.get_request(rid).samples]
    leader.step()
    for _ in range(500):  # the follower replays on its own thread
        if steps:
            break
        time.sleep(0.01)
    assert [s.seed for s in follower.get_request(rid).samples] == seeds
    leader.close()
    thread.join(30)
    assert result == [1]


def test_a_follower_with_another_configuration_refuses_to_start(wire):
    leader = lockstep.Leader(make_fake_engine(**ENGINE), tick_s=1e6)
    thread, _, result = _start_follower(make_fake_engine(**{**ENGINE, "max_num_seqs": 8}))
    leader.warmup(progress=False)
    thread.join(30)
    assert isinstance(result[0], lockstep.LockstepError)
    assert "max_num_seqs=8" in str(result[0]) and "differs from process 0" in str(result[0])


def test_the_leader_ticks_while_idle(wire):
    leader = lockstep.Leader(make_fake_engine(**ENGINE), tick_s=0.05)
    msg = wire.get(timeout=5)
    assert b'"action":"tick"' in msg
    leader.close()
    with pytest.raises(lockstep.LockstepError, match="already told to stop"):
        leader.step()


def test_a_follower_that_diverged_stops_before_stepping(wire):
    leader = lockstep.Leader(make_fake_engine(**ENGINE), tick_s=1e6)
    follower = make_fake_engine(**ENGINE)
    follower.add_request({"prompt_token_ids": [65]}, SamplingParams(), request_id="only-here")
    thread, steps, result = _start_follower(follower)
    leader.add_request({"prompt_token_ids": [66]}, SamplingParams(), request_id="everywhere")
    leader.step()
    thread.join(30)
    assert steps == [] and isinstance(result[0], lockstep.LockstepError)
    assert "diverged from process 0 before its step" in str(result[0])
