"""Caps count everything the server parses, and parsing, chat templates and tokenization stay
off the event loop: while an adversarial request is refused or tokenized, health answers and
other streams keep streaming.

Timing is asserted loosely: the failures these guard against were stalls of 0.6 to 17 s (a
20 MB role, 300,000 empty messages, a 999,999-character prompt tokenized while holding the
GIL), and the bound here (1 s, against a 100 ms goal) leaves room for a loaded 2-core machine.
"""

from __future__ import annotations

import functools
import threading
import time

import grpc
import pytest

from jaxserve.server import messages
from jaxserve.server.proto import generation_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from test_server_support import SERVING, channel, code_and_field, fake_server, gen_stub, wait_idle

STALL_LIMIT_S = 1.0


class Watch:
    """Health checks in a loop and one long stream, on threads, timing the worst gap of each."""

    def __init__(self, s):
        self.s = s
        self.stop = threading.Event()
        self.health_worst = 0.0
        self.stream_worst = 0.0
        self.health_calls = 0

    def _health(self):
        stub = health_pb2_grpc.HealthStub(channel(self.s))
        while not self.stop.is_set():
            t0 = time.perf_counter()
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status == SERVING
            self.health_worst = max(self.health_worst, time.perf_counter() - t0)
            self.health_calls += 1
            time.sleep(0.01)

    def _stream(self):
        stream = gen_stub(self.s).Generate(pb.GenerateRequest(prompt="bystander", max_tokens=100_000 // 1000,
                                                              ignore_eos=True), timeout=60)
        last = time.perf_counter()
        for _ in stream:
            now = time.perf_counter()
            self.stream_worst = max(self.stream_worst, now - last)
            last = now
            if self.stop.is_set():
                stream.cancel()
                return

    def __enter__(self):
        self.threads = [threading.Thread(target=self._health), threading.Thread(target=self._stream)]
        for t in self.threads:
            t.start()
        time.sleep(0.3)  # both running before the adversarial call
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)
        assert self.health_calls > 3
        assert self.health_worst < STALL_LIMIT_S, f"a health check took {self.health_worst:.2f} s"
        assert self.stream_worst < STALL_LIMIT_S, f"the other stream stalled {self.stream_worst:.2f} s"


@pytest.fixture(scope="module")
def server():
    # 0.05 s a step: the bystander stream (100 tokens) outlives every adversarial call below.
    with fake_server(step_delay_s=0.05, max_model_len=2048, num_pages=2048) as s:
        yield s


def chat(*pairs):
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in pairs])


@pytest.mark.parametrize("method", ["GenerateUnary", "Tokenize"])
def test_a_20_mb_role_is_refused_at_once_without_stalling_anyone(server, method):
    req = (pb.GenerateRequest(messages=chat(("r" * 20 * 2**20, "hi")), max_tokens=2) if method == "GenerateUnary"
           else pb.TokenizeRequest(messages=chat(("r" * 20 * 2**20, "hi"))))
    with Watch(server):
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            getattr(gen_stub(server), method)(req, timeout=30)
        took = time.perf_counter() - t0
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role"), e.value.details()
    assert str(messages.MAX_ROLE_CHARS) in e.value.details()
    assert took < 5.0, took  # 20 MB over loopback, then one length check
    wait_idle(server)


@functools.lru_cache(maxsize=None)
def many_empty_messages() -> pb.ChatMessages:
    # Built once: 300,000 message objects take the client about a second to make.
    return chat(*[("user", "")] * 300_000)


@pytest.mark.parametrize("method", ["GenerateUnary", "Tokenize"])
def test_300k_empty_messages_are_refused_by_count(server, method):
    msgs = many_empty_messages()
    req = pb.GenerateRequest(messages=msgs, max_tokens=2) if method == "GenerateUnary" else pb.TokenizeRequest(messages=msgs)
    with Watch(server):
        with pytest.raises(grpc.RpcError) as e:
            getattr(gen_stub(server), method)(req, timeout=30)
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "messages"), e.value.details()
    assert "300000 messages exceeds the limit of 4096" in e.value.details()
    wait_idle(server)


def test_roles_count_toward_the_character_limit(server):
    big = "x" * (messages.MAX_PROMPT_CHARS // 2)
    req = pb.GenerateRequest(messages=chat(("user", big), ("user", big)), max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        gen_stub(server).GenerateUnary(req, timeout=30)
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "messages")
    assert "roles and content" in e.value.details()


def test_a_prompt_just_under_the_cap_is_tokenized_off_the_loop(server):
    """999,999 characters: tokenized (a million byte tokens, more than the context, so refused
    after tokenizing) while health and the other stream go on."""
    with Watch(server):
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(server).GenerateUnary(pb.GenerateRequest(prompt="y" * 999_999, max_tokens=2), timeout=60)
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt"), e.value.details()
    assert server.server.frontend.stats["tokenized"] >= 1
    wait_idle(server)


def test_a_tokenize_call_of_4096_messages_renders_off_the_loop(server):
    msgs = chat(*[("user", "z" * 200)] * messages.MAX_MESSAGES)
    with Watch(server):
        out = gen_stub(server).Tokenize(pb.TokenizeRequest(messages=msgs), timeout=60)
    assert out.text.count("<user>") == messages.MAX_MESSAGES
    assert len(out.token_ids) == len(out.text.encode())  # the byte tokenizer: one id per byte


def test_too_many_prompt_token_ids_are_refused_before_they_are_copied(server):
    ids = pb.TokenIds(ids=[65] * (messages.MAX_PROMPT_TOKEN_IDS + 1))
    with pytest.raises(grpc.RpcError) as e:
        gen_stub(server).GenerateUnary(pb.GenerateRequest(prompt_token_ids=ids, max_tokens=2), timeout=30)
    assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids")
