"""Disaggregated serving in one process (jaxserve/disagg/: router.py, service.py, port.py): a
router, a --role prefill and a --role decode server, each a real gRPC server on loopback, the
KV pages moved between the two engines by jax.experimental.transfer (two transfer servers, as
between processes). A client's streams through the router must be exactly a colocated engine's
(test_handover.py says why exact), requests cancelled before, during and after the handover
must leave both engines idle with every page free, and the failure statuses must say which
server failed and why. tests/test_disagg_processes.py runs the same parts as real processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import threading
import time

import grpc
import pytest
import checkpoints
from conftest import ROOT, byte_tokenizer, make_engine
from test_handover import SHAPE, colocated, workload
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_server_support import FIELD_KEY, NOT_SERVING, wait_idle, wait_until

from jaxserve.disagg.port import TransferPort
from jaxserve.engine import compile_watch
from jaxserve.disagg.router import Router
from jaxserve.disagg.service import service_factory
from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import SamplingParams

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
TRANSFER_TIMEOUT_S = 3.0  # short, so the dropped-transfer case ends quickly; loopback moves KB


class BackgroundRouter:
    """A Router on its own event-loop thread (as app.BackgroundServer for a server)."""

    def __init__(self, prefill: list[str], decode: list[str], wait: bool = True, tokenizer=None, **cfg):
        self.wait = wait
        self.router = Router(ServerConfig(port=0, role="router", prefill_servers=",".join(prefill),
                                          decode_servers=",".join(decode), progress=False, **cfg),
                             prefill, decode, tokenizer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def call(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def __enter__(self):
        self._thread.start()
        self.call(self.router.start())
        assert not self.wait or self.call(self.router.wait_ready(30)), "the router never saw both backends serving"
        return self

    def __exit__(self, *exc):
        self.call(self.router.stop(), 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def address(self) -> str:
        return f"localhost:{self.router.port}"


def role_server(model, tok, role: str, engine_kw=None, **server_cfg) -> BackgroundServer:
    eng = make_engine(model, tok, handover=True, **{**SHAPE, **(engine_kw or {})})
    cfg = ServerConfig(port=0, role=role, progress=False, kv_transfer_timeout_s=TRANSFER_TIMEOUT_S, **server_cfg)
    return BackgroundServer(eng, cfg, kv_port=TransferPort(TRANSFER_TIMEOUT_S),
                            extra_services=(service_factory(role),)).start()


@contextlib.contextmanager
def deploy(model, tok, **engine_kw):
    """(prefill server, decode server, router), stopped on exit."""
    prefill = role_server(model, tok, "prefill", engine_kw, metrics_port=0)
    decode = role_server(model, tok, "decode", engine_kw, metrics_port=0)
    try:
        with BackgroundRouter([prefill.address], [decode.address], metrics_port=0) as router:
            yield prefill, decode, router
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def deployment(tiny_model):
    with deploy(*tiny_model) as d:
        yield d


@pytest.fixture(scope="module")
def colocated_engine(tiny_model):
    return make_engine(*tiny_model, **SHAPE)


@pytest.fixture(scope="module")
def reference(colocated_engine):
    """Colocated streams of the workloads, from an engine of the same shape."""
    return {seed: colocated(colocated_engine, workload(seed, shared=shared))
            for seed, shared in ((1, False), (2, True))}


def request_of(i: int, prompt: list[int], params) -> pb.GenerateRequest:
    r = pb.GenerateRequest(request_id=str(i), prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=params.max_tokens,
                           ignore_eos=params.ignore_eos, temperature=params.temperature, n=params.n,
                           stop=list(params.stop or ()), stop_token_ids=list(params.stop_token_ids))
    if params.seed is not None:
        r.seed = params.seed
    return r


def stub(address: str) -> generation_grpc.GenerationStub:
    return generation_grpc.GenerationStub(grpc.insecure_channel(address))


def run_concurrently(address: str, requests: list[pb.GenerateRequest]) -> dict:
    """Every request streamed at once; {(request_id, index): ids, text, finish} as test_handover's."""
    out, errors = {}, []
    lock = threading.Lock()

    def one(r):
        try:
            check(r, list(stub(address).Generate(r, timeout=60)))
        except grpc.RpcError as e:
            errors.append((r.request_id, e.code(), e.details()))
        except AssertionError as e:  # a thread's assertion must fail the test, not vanish
            errors.append((r.request_id, "assertion", str(e)))

    def check(r, msgs):
        assert msgs[-1].HasField("usage") and all(not m.HasField("usage") for m in msgs[:-1])
        # Usage counts every token the client got, the prefill server's first ones included.
        assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)
        assert msgs[-1].usage.prompt_tokens == len(r.prompt_token_ids.ids)
        assert msgs[-1].usage.total_tokens == msgs[-1].usage.prompt_tokens + msgs[-1].usage.completion_tokens
        with lock:
            for m in msgs:
                assert m.request_id == r.request_id  # the client's id, not a backend's
                s = out.setdefault((m.request_id, m.index), {"ids": [], "text": "", "finish": None})
                s["ids"].extend(m.token_ids)
                s["text"] += m.text
                if m.finish_reason:
                    assert s["finish"] is None, "a sample finished twice"
                    s["finish"] = FINISH[m.finish_reason]
    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def both_idle(prefill, decode) -> None:
    wait_idle(prefill, 20)
    wait_idle(decode, 20)


@pytest.mark.parametrize("seed", [1, 2], ids=["plain", "prefix-cached"])
def test_streams_through_the_router_equal_colocated(deployment, reference, seed):
    """Greedy, seeded sampling, n = 2, a stop string held back across the handover; seed 2's
    prompts share a prefix, so its later requests hit the prefill server's prefix cache (the
    decode server gets those pages too). Sent twice: the second round is all prefix hits."""
    prefill, decode, router = deployment
    work = workload(seed, shared=seed == 2)
    reqs = [request_of(i, p, sp) for i, (p, sp) in enumerate(work)]
    for _ in range(2 if seed == 2 else 1):
        before, compiles = decode.server.frontend.stats["accepted"], compile_watch.compiles()
        got = run_concurrently(router.address, reqs)
        # Both engines warmed up before the router served: nothing compiles in this process,
        # the page programs included (a handover's pulled pages meet the warmed-up programs).
        assert compile_watch.compiles() == compiles
        assert len(got) == len(reference[seed]) > len(work)  # every sample, n = 2 ones included
        assert got == reference[seed]
        both_idle(prefill, decode)
        # Every request went on to the decode server (max_tokens >= 2: none ends in prefill).
        assert decode.server.frontend.stats["accepted"] - before == len(work)
    handed = prefill.server.frontend.stats
    assert handed["accepted"] == handed["terminal"]
    if seed == 2:
        assert prefill.server.engine.scheduler.num_cached_pages > 0
    gap = router.router.metrics.handover_gap.collect()[0]
    assert next(s.value for s in gap.samples if s.name.endswith("_count")) > 0


@pytest.mark.parametrize("variant", ["int8-kv", "sliding-window"])
def test_int8_kv_and_sliding_window_streams_through_the_router_equal_colocated(tiny_model, variant):
    """The KV moves in its stored layout: int8 pages with their scales; the tiny Gemma 3's two
    page groups (sliding and global layers), prompts longer than its window so the sliding
    table has freed entries behind it when handed over."""
    if variant == "int8-kv":
        (model, tok), kw, vocab = tiny_model, dict(kv_cache_dtype="int8"), 256
    else:
        model, _ = checkpoints.load_model(ROOT / "tests" / "data" / "gemma3_local_global", "float32")
        tok, kw, vocab = byte_tokenizer(), dict(num_pages=96, enable_prefix_caching=False), model.cfg.vocab_size
    work = workload(3, vocab=vocab)
    want = colocated(make_engine(model, tok, **{**SHAPE, **kw}), work)
    with deploy(model, tok, **kw) as (prefill, decode, router):
        compiles = compile_watch.compiles()
        got = run_concurrently(router.address, [request_of(i, p, sp) for i, (p, sp) in enumerate(work)])
        assert got == want
        assert compile_watch.compiles() == compiles  # int8 pages with scales, two page groups
        both_idle(prefill, decode)
        if variant == "sliding-window":
            assert prefill.server.engine.scheduler.pages_freed_by_window > 0


def test_a_sample_that_ends_in_prefill_is_in_the_stream_and_the_usage(deployment, colocated_engine):
    """n = 2 where sample 0's first token is a stop token id and sample 1's is not: sample 0
    ends on the prefill server, sample 1 is handed over alone. The client gets both, as
    colocated serving streams them, and usage counts both (run_concurrently checks it)."""
    prefill, decode, router = deployment
    prompt = list(range(7, 30))
    for seed in range(11, 60):
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        first = colocated(colocated_engine, [(prompt, params)], waves=1)
        a, b = first[("0", 0)]["ids"][0], first[("0", 1)]["ids"][0]
        if a != b:
            break
    else:
        raise AssertionError("no seed in 11..59 gives the two samples different first tokens")
    params = dataclasses.replace(params, stop_token_ids=(a,))
    want = colocated(colocated_engine, [(prompt, params)], waves=1)
    assert want[("0", 0)]["ids"] == [a] and want[("0", 0)]["finish"] == "stop"
    assert len(want[("0", 1)]["ids"]) > 1
    got = run_concurrently(router.address, [request_of(0, prompt, params)])
    assert got == want
    both_idle(prefill, decode)


def test_unary_through_the_router_equals_colocated(deployment, reference):
    prefill, decode, router = deployment
    work = workload(1)
    s = stub(router.address)
    for i in (0, 2, 4):  # greedy, n = 2 sampled, greedy
        out = s.GenerateUnary(request_of(i, *work[i]), timeout=60)
        assert out.request_id == str(i)
        for c in out.completions:
            want = reference[1][(str(i), c.index)]
            assert (list(c.token_ids), c.text, FINISH[c.finish_reason]) == (want["ids"], want["text"], want["finish"])
        assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.completions)
        assert out.timings.e2e_s > 0 and out.timings.ttft_s > 0
    both_idle(prefill, decode)


def test_cancelled_before_during_and_after_the_handover_free_pages_on_both_sides(deployment):
    """A stream cancelled right away (in prefill), after its first token (around the handover)
    and after a few decode tokens: both servers end idle, every page free, each request ended
    once on each server that had it."""
    prefill, decode, router = deployment
    s = stub(router.address)
    prompt = list(range(5, 41))
    for after in (0, 1, 4):
        r = pb.GenerateRequest(request_id=f"c{after}", prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=200,
                               ignore_eos=True, n=2, temperature=0.8, seed=3)
        call = s.Generate(r, timeout=60)
        got = 0
        if after:
            for _ in call:
                got += 1
                if got >= after:
                    break
        call.cancel()
        both_idle(prefill, decode)
    assert router.router.inflight == 0


def test_a_server_answers_only_its_own_role(deployment):
    prefill, decode, _ = deployment
    disagg = generation_grpc.DisaggStub(grpc.insecure_channel(prefill.address))
    with pytest.raises(grpc.RpcError) as e:
        list(disagg.Decode(pb.DecodeRequest(handover=pb.KVHandover(address="x:1")), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "role is prefill" in e.value.details()
    disagg = generation_grpc.DisaggStub(grpc.insecure_channel(decode.address))
    with pytest.raises(grpc.RpcError) as e:
        list(disagg.Prefill(pb.GenerateRequest(prompt="hi"), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "role is decode" in e.value.details()


def test_a_dropped_transfer_fails_that_request_unavailable_and_the_decode_server_stays_idle(deployment):
    """A ticket whose KV was never offered (the prefill side dropped it): the decode server
    polls until kv_transfer_timeout_s and fails the call UNAVAILABLE, naming the transfer;
    nothing stays held, and the next request is served."""
    prefill, decode, router = deployment
    # A real handover's state, from a real prefill call, with its uuid changed: nothing is
    # offered under the new one.
    disagg = generation_grpc.DisaggStub(grpc.insecure_channel(prefill.address))
    msgs = list(disagg.Prefill(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(range(3, 20))),
                                                  max_tokens=8, ignore_eos=True), timeout=30))
    ticket = msgs[-1].handover
    assert ticket.kv_bytes > 0 and not msgs[-1].HasField("delta")
    to_decode = generation_grpc.DisaggStub(grpc.insecure_channel(decode.address))
    # First the real ticket is pulled, so the offer is not left held on the prefill side.
    real = list(to_decode.Decode(pb.DecodeRequest(handover=ticket), timeout=30))
    assert real[-1].HasField("usage")
    dropped = pb.KVHandover()
    dropped.CopyFrom(ticket)
    dropped.uuid = ticket.uuid + 10**6
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(to_decode.Decode(pb.DecodeRequest(handover=dropped), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "did not arrive" in e.value.details() and str(dropped.uuid) in e.value.details()
    assert TRANSFER_TIMEOUT_S <= time.monotonic() - start < TRANSFER_TIMEOUT_S + 10
    both_idle(prefill, decode)
    assert decode.server.engine_loop.engine.scheduler.num_free_pages > 0


def test_a_malformed_ticket_is_invalid_argument_naming_the_field(deployment):
    _, decode, _ = deployment
    to_decode = generation_grpc.DisaggStub(grpc.insecure_channel(decode.address))
    with pytest.raises(grpc.RpcError) as e:
        list(to_decode.Decode(pb.DecodeRequest(handover=pb.KVHandover(handover=b"{}")), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata() or ()).get(FIELD_KEY, "").startswith("handover")
    wait_idle(decode, 20)


def test_a_router_without_a_serving_decode_server_is_not_ready_and_refuses(deployment):
    """Nothing listens at the decode address: the router's health says NOT_SERVING and a call
    fails UNAVAILABLE naming the missing role, before any prefill server is asked."""
    prefill, _, _ = deployment
    asked = prefill.server.frontend.stats["accepted"]
    with BackgroundRouter([prefill.address], ["localhost:1"], wait=False) as r:
        wait_until(lambda: r.router.metrics.healthy.labels("prefill", prefill.address)._value.get() == 1, 10,
                   "the prefill server's health to be seen")
        assert not r.router.ready
        hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(r.address))
        assert hs.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub(r.address).GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode server" in e.value.details()
    assert prefill.server.frontend.stats["accepted"] == asked


def test_the_router_reaches_mtls_backends_with_its_certificate_and_forwards_the_token(deployment, tiny_model,
                                                                                       tmp_path):
    """Backends behind mutual TLS and a bearer token: the router connects with --backend-tls-ca /
    --backend-tls-cert / --backend-tls-key, the client's token reaches both servers, and the
    stream equals the plaintext deployment's; without the token the backends refuse
    UNAUTHENTICATED; a router without a client certificate never sees them serving."""
    from jaxserve.server.security import bearer_metadata
    from test_server_support import make_certs
    certs = {k: str(v) for k, v in make_certs(tmp_path).items()}
    token = "disagg-secret-token"
    tls = dict(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca.pem"],
               auth_token=token)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 9, 17, 33, 2, 11]), max_tokens=8,
                             temperature=0.0, ignore_eos=True)
    want = [t for m in stub(deployment[2].address).Generate(req, timeout=60) for t in m.token_ids]
    prefill = role_server(*tiny_model, "prefill", **tls)
    decode = role_server(*tiny_model, "decode", **tls)
    try:
        client = dict(backend_tls_ca=certs["ca.pem"], backend_tls_cert=certs["client.pem"],
                      backend_tls_key=certs["client.key"])
        with BackgroundRouter([prefill.address], [decode.address], **client) as router:
            got = [t for m in stub(router.address).Generate(req, timeout=60, metadata=bearer_metadata(token))
                   for t in m.token_ids]
            assert got == want and len(got) == 8
            with pytest.raises(grpc.RpcError) as e:
                list(stub(router.address).Generate(req, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        with BackgroundRouter([prefill.address], [decode.address], wait=False, backend_tls_ca=certs["ca.pem"]) as r:
            assert not r.call(r.router.wait_ready(3))  # the handshake needs its certificate
        wait_idle(prefill, 20)
        wait_idle(decode, 20)
    finally:
        prefill.stop()
        decode.stop()
