"""scripts/capacity_disagg.py: one prefill and one decode engine in virtual time, the handover
between them the real engine code's (engine/handover.py) over the fake runner, whose history
check fails any step whose pages do not hold the sequence's tokens, so a handover that moved
the wrong pages cannot go unnoticed. Checked here: every request completes with all its
tokens, every request with more than one token is handed over once, the bytes moved are its
pages', the first token comes at prefill time and the transfer shows between the first and
second token, and a decode engine too small for the arrivals makes handovers wait rather than
drop them."""

from __future__ import annotations

import random
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from capacity_disagg import DisaggSimTarget  # noqa: E402
from capacity_targets import SimTarget  # noqa: E402
from capacity_workload import Request, arrival_times  # noqa: E402

from jaxserve.server.fake_engine import make_fake_engine  # noqa: E402

PAGE_BYTES = 1000


def _requests(n=24, seed=0):
    rng = random.Random(seed)
    return [Request([rng.randint(32, 120) for _ in range(rng.randint(5, 60))], rng.randint(1, 12))
            for _ in range(n)]


def _cost(tokens, kv_tokens):
    return 0.01 + 0.001 * tokens


@pytest.mark.parametrize("latency", [0.0, 0.5])
def test_every_request_completes_through_the_handover(latency):
    reqs = _requests()
    arr = arrival_times(len(reqs), 20.0, "poisson", random.Random(1))
    target = DisaggSimTarget(lambda: make_fake_engine(max_num_seqs=4), _cost, PAGE_BYTES, 1.0, latency)
    outcomes, duration, stats = target.run(reqs, arr)
    assert [o.tokens for o in outcomes] == [r.max_tokens for r in reqs]
    assert all(o.code == "OK" for o in outcomes)
    assert stats["handovers"] == sum(r.max_tokens > 1 for r in reqs)
    pages = sum(-(-len(r.prompt_ids) // 4) for r in reqs if r.max_tokens > 1)  # the fake engine's 4-token pages
    assert stats["transfer_bytes"] == pages * PAGE_BYTES
    colocated, _, _ = SimTarget(lambda: make_fake_engine(max_num_seqs=4), lambda t: _cost(t, 0)).run(reqs, arr)
    for o, c in zip(outcomes, colocated):
        assert o.ttft >= 0.01 and c.ttft >= 0.01
        if o.tokens > 1:  # the transfer (1 GB/s: pages x 1 us, plus the latency) before token 2
            assert o.gaps[0] >= latency + 0.01
    assert duration >= max(arr)


def test_a_full_decode_engine_makes_handovers_wait_not_drop():
    reqs = [Request(list(range(40, 80)), 30) for _ in range(6)]
    target = DisaggSimTarget(lambda: make_fake_engine(max_num_seqs=1), _cost, PAGE_BYTES, 1.0)
    outcomes, _, stats = target.run(reqs, [0.0] * len(reqs))
    assert [o.tokens for o in outcomes] == [30] * 6
    assert stats["mean_handover_wait_s"] > 0
