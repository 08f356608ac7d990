"""The router's prefix-aware choice of a prefill server (jaxserve/disagg/prefix_affinity.py):
prompts sharing a prefix go where it last ran unless that server is too busy; other prompts go
to the least loaded; a server that leaves rotation is forgotten; retries skip the holder."""

from jaxserve.disagg import prefix_affinity as pa
from jaxserve.disagg.router import Router
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import generation_pb2 as pb

C = pa.CHUNK_TOKENS


def ids(*runs):
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[t for r in runs for t in r]))


def test_chain_names_each_whole_chunk_prefix():
    a, b = list(range(C)), list(range(C, 2 * C))
    assert pa.PrefixAffinity.chain(ids(a[:C - 1])) == []  # shorter than a chunk: nothing to route by
    one, two = pa.PrefixAffinity.chain(ids(a)), pa.PrefixAffinity.chain(ids(a, b, [7] * 5))
    assert len(one) == 1 and len(two) == 2 and two[0] == one[0]
    assert pa.PrefixAffinity.chain(ids(b, a))[0] != one[0]  # the same chunk after another prefix
    text = pb.GenerateRequest(prompt="x" * (4 * C) + "tail")
    chat = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x" * (4 * C))]))
    assert len(pa.PrefixAffinity.chain(text)) == 1 and pa.PrefixAffinity.chain(chat) != pa.PrefixAffinity.chain(text)


def _router():
    r = Router(ServerConfig(), ["p0:1", "p1:2"], ["d:3"])
    for b in r.backends:
        b.healthy = True
    return r, r.backends[0], r.backends[1]


def test_a_shared_prefix_goes_where_it_ran_unless_that_server_is_too_busy():
    r, p0, p1 = _router()
    system = list(range(3 * C))
    first = pa.PrefixAffinity.chain(ids(system, [1, 2, 3] * C))
    assert r.pick("prefill", (), first) is p0  # a tie: the first; p0 now holds the prefix
    p0.inflight_tokens = pa.AFFINITY_SLACK_TOKENS  # busier than p1, within the slack
    again = pa.PrefixAffinity.chain(ids(system, [9] * C))  # the same 3 chunks, then its own
    assert r.pick("prefill", (), again) is p0 and r.metrics.prefix_routed._value.get() == 1
    other = pa.PrefixAffinity.chain(ids([5] * (4 * C)))
    assert r.pick("prefill", (), other) is p1  # nothing known: the least loaded
    p0.inflight_tokens = pa.AFFINITY_SLACK_TOKENS + 1  # over the slack: load wins, and p1 takes the prefix
    assert r.pick("prefill", (), again) is p1
    p0.inflight_tokens = 0
    assert r.pick("prefill", (), again) is p1  # p1 ran it last
    assert r.pick("prefill", (p1,), again) is p0  # a retry skips the server that failed it


def test_a_server_out_of_rotation_is_forgotten():
    r, p0, p1 = _router()
    chain = pa.PrefixAffinity.chain(ids(list(range(2 * C))))
    p0.inflight_tokens = 10
    assert r.pick("prefill", (), chain) is p1
    r.set_healthy(p1, False)
    assert len(r.affinity) == 0  # its prefixes left with it
    r.set_healthy(p1, True)
    p1.inflight_tokens = 20  # back, busier, and holding nothing any more
    assert r.pick("prefill", (), chain) is p0


def test_the_table_keeps_the_most_recent_prefixes():
    table = pa.PrefixAffinity(capacity=3)
    table.record([1, 2], "a")
    table.record([3, 4], "b")
    assert len(table) == 3 and table._owner.get(1) is None and table._owner[4] == "b"
