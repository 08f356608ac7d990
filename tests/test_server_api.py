"""jaxserve.v1.Generation over a real loopback server: outputs computed by hand (fake model) or by
the same engine run offline, stream shape, n > 1, logprobs, stops, chat, priority, tokenize,
model info, reflection and metrics."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxserve.server.fake_engine import EOS_ID, fake_generate, fake_tokenizer
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import SamplingParams
from test_server_support import channel, check_stream, fake_server, gen_stub, offline, wait_idle, wait_until

TOK = fake_tokenizer()


@pytest.fixture(scope="module")
def server():
    with fake_server(server={"metrics_port": 0}) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    return gen_stub(server)


def test_stream_matches_the_model_computed_by_hand(stub, server):
    msgs = list(stub.Generate(pb.GenerateRequest(prompt="Hello", max_tokens=20, seed=5)))
    texts = check_stream(msgs)
    ids, reason = fake_generate(TOK.encode("Hello"), 20, seed=5)
    assert [t for m in msgs for t in m.token_ids] == ids
    assert texts[0] == bytes(ids).decode()
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and reason == "length"
    u = msgs[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (5, 20, 25)
    t = msgs[-1].timings
    assert 0 <= t.queue_s <= t.ttft_s <= t.e2e_s and t.HasField("tpot_s")
    assert all(m.request_id == msgs[0].request_id for m in msgs)
    wait_idle(server)


def test_eos_ends_with_stop_and_unary_equals_stream(stub):
    # Find a prompt whose fake continuation hits EOS early, by hand.
    prompt = next(p for p in (f"p{i}" for i in range(500))
                  if fake_generate(TOK.encode(p), 40)[1] == "stop")
    ids, _ = fake_generate(TOK.encode(prompt), 40)
    msgs = list(stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=40, request_id="mine")))
    assert check_stream(msgs)[0] == bytes(ids[:-1]).decode()  # EOS is a special token: no text
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP and msgs[-1].request_id == "mine"
    unary = stub.GenerateUnary(pb.GenerateRequest(prompt=prompt, max_tokens=40))
    assert unary.completions[0].text == bytes(ids[:-1]).decode()
    assert list(unary.completions[0].token_ids) == ids
    assert unary.usage.completion_tokens == len(ids)


def test_n_samples_logprobs_stops_and_chat_equal_the_engine_offline(stub):
    cases = [
        (pb.GenerateRequest(prompt="Hi", max_tokens=12, n=3, seed=9, temperature=1.0),
         "Hi", SamplingParams(max_tokens=12, n=3, seed=9, temperature=1.0)),
        (pb.GenerateRequest(prompt="Hi", max_tokens=30, stop=["a", "b", "c"]),
         "Hi", SamplingParams(temperature=0.0, max_tokens=30, stop=("a", "b", "c"))),
        (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[72, 105]), max_tokens=8, logprobs=3),
         {"prompt_token_ids": [72, 105]}, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)),
        (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hé 🎉")]),
                            max_tokens=10),
         [{"role": "user", "content": "hé 🎉"}], SamplingParams(temperature=0.0, max_tokens=10)),
    ]
    for req, prompt, params in cases:
        ref = offline(prompt, params)
        msgs = list(stub.Generate(req))
        texts = check_stream(msgs, params.n)
        for c in ref.outputs:
            assert texts[c.index] == c.text
            got = [t for m in msgs if m.index == c.index for t in m.token_ids]
            assert got == c.token_ids
            ends = [m.finish_reason for m in msgs if m.index == c.index and m.finish_reason]
            assert ends == [pb.FinishReason.Value(f"FINISH_REASON_{c.finish_reason.upper()}")]
        if params.logprobs is not None:
            lps = [lp for m in msgs for lp in m.logprobs]
            assert len(lps) == len(ref.outputs[0].token_ids) and all(len(lp.top) == 3 and lp.top[0].token_id == lp.token_id for lp in lps)
        if params.n > 1:
            assert len({texts[i] for i in range(params.n)}) == params.n  # seeded samples differ
        unary = stub.GenerateUnary(req)
        assert [c.text for c in unary.completions] == [c.text for c in ref.outputs]


def test_priority_orders_the_waiting_queue():
    # One sequence at a time, so the engine takes requests strictly one by one from our queue.
    with fake_server(max_num_seqs=1, max_num_batched_tokens=8) as s:
        stub = gen_stub(s)
        el = s.server.engine_loop
        el.pause()
        order = [("a", 5), ("b", 0), ("c", 5), ("d", -1)]
        futs, done = {}, []
        for rid, prio in order:
            futs[rid] = stub.GenerateUnary.future(pb.GenerateRequest(prompt=rid, max_tokens=3,
                                                                     request_id=rid, priority=prio))
            futs[rid].add_done_callback(lambda f: done.append(f.result().request_id))
            wait_until(lambda: el.num_waiting_here == len(futs), what="queued")
        el.resume()
        wait_until(lambda: len(done) == 4, what="all done")
        assert done == ["d", "b", "a", "c"]  # lower value first, ties in arrival order
        wait_idle(s)


def test_tokenize_detokenize_and_model_info(stub):
    r = stub.Tokenize(pb.TokenizeRequest(text="héllo"))
    assert list(r.token_ids) == list("héllo".encode()) and r.text == "héllo"
    chat = stub.Tokenize(pb.TokenizeRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")])))
    assert chat.text == "<user>x\n<assistant>" and list(chat.token_ids) == list(chat.text.encode())
    d = stub.Detokenize(pb.DetokenizeRequest(token_ids=list("ok 🎉".encode()) + [EOS_ID]))
    assert d.text == "ok 🎉"
    keep = stub.Detokenize(pb.DetokenizeRequest(token_ids=[111, EOS_ID], skip_special_tokens=False))
    assert keep.text == "o<|eos|>"
    with pytest.raises(grpc.RpcError) as e:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 257]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()
    info = stub.ModelInfo(pb.ModelInfoRequest())
    assert (info.context_length, info.vocab_size, info.page_size) == (256, 257, 4)
    assert list(info.token_buckets) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert list(info.eos_token_ids) == [EOS_ID] and info.max_queued_requests == 256


def test_reflection_lists_every_service(server):
    db = ProtoReflectionDescriptorDatabase(channel(server))
    services = set(db.get_services())
    assert {"jaxserve.v1.Generation", "jetstream_proto.Orchestrator", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services
    desc = db.FindFileContainingSymbol("jaxserve.v1.GenerateRequest")
    assert desc.package == "jaxserve.v1"


def test_metrics_count_requests_tokens_and_rejections(stub, server):
    reg = server.server.metrics.registry
    before = {k: reg.get_sample_value(f"jaxserve_{k}_total") or 0 for k in ("prompt_tokens", "generation_tokens")}
    usage = list(stub.Generate(pb.GenerateRequest(prompt="metrics", max_tokens=7)))[-1].usage
    assert reg.get_sample_value("jaxserve_prompt_tokens_total") - before["prompt_tokens"] == usage.prompt_tokens
    assert (reg.get_sample_value("jaxserve_generation_tokens_total") - before["generation_tokens"]
            == usage.completion_tokens)
    with pytest.raises(grpc.RpcError):
        stub.GenerateUnary(pb.GenerateRequest(prompt="x", top_k=-2))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=5).read().decode()
    for name in ("jaxserve_time_to_first_token_seconds_bucket", "jaxserve_time_per_output_token_seconds_count",
                 "jaxserve_e2e_request_latency_seconds_sum", "jaxserve_request_queue_time_seconds_count",
                 "jaxserve_num_requests_running", "jaxserve_num_requests_waiting", "jaxserve_kv_pages_used",
                 "jaxserve_kv_pages_total 511.0", "jaxserve_preemptions_total", "jaxserve_compilations_after_warmup 0.0",
                 'jaxserve_rejected_requests_total{reason="invalid_argument"}', "jaxserve_prompt_tokens_total",
                 "jaxserve_generation_tokens_total", 'jaxserve_finished_requests_total{outcome="ok"}'):
        assert name in text, name
    assert reg.get_sample_value("jaxserve_rejected_requests_total", {"reason": "invalid_argument"}) >= 1


def test_many_concurrent_streams_each_end_once(server):
    stub = gen_stub(server)

    def one(i):
        req = pb.GenerateRequest(prompt=f"stream {i}", max_tokens=5 + i % 7, seed=i, n=1 + i % 2)
        return req, list(stub.Generate(req, timeout=30))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(64)))
    for req, msgs in results:
        texts = check_stream(msgs, req.n)
        ref = offline(req.prompt, SamplingParams(temperature=0.0, max_tokens=req.max_tokens, seed=req.seed, n=req.n))
        assert [texts[i] for i in range(req.n)] == [c.text for c in ref.outputs]
    wait_idle(server)


def test_jaxserve_client_command_streams_the_answer(server):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "jaxserve.cli", "client", "Hello", "--server", server.address,
           "--max-tokens", "20", "--seed", "5", "--stats"]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    ids, _ = fake_generate(TOK.encode("Hello"), 20, seed=5)
    assert r.stdout == bytes(ids).decode() + "\n"
    assert "5 prompt tokens, 20 generated, finish=FINISH_REASON_LENGTH" in r.stderr
    bad = subprocess.run(cmd[:-5] + ["--temperature", "-1"], cwd=root, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == ("jaxserve: error: INVALID_ARGUMENT: temperature: must be 0 "
                                                   "(greedy) or a number in [1e-05, 100], got -1.0")
