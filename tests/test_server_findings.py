"""Smaller findings of the QA pass (issue 15, 3-4): no U+FFFD from a length cut, JetStream's
HealthCheck exempt from auth, an unknown LoRA adapter refused, has_bos honoured, deadline
expiries counted as their own outcome."""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import numpy as np
import pytest

from jaxserve.engine import request_check
from jaxserve.engine.runner import StepResult
from jaxserve.server import calls, messages
from jaxserve.server.app import BackgroundServer
from jaxserve.server.config import ServerConfig
from jaxserve.server.fake_engine import EOS_ID, FakeRunner, make_fake_engine
from jaxserve.server.proto import jetstream_grpc, jetstream_pb2 as js
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import MAX_LOGPROBS
from test_server_support import code_and_field, fake_server, gen_stub, js_stub, wait_idle, wait_until

TEXT = "日本語🙂é"
SCRIPT = list(TEXT.encode())  # the byte tokenizer: token id == byte


class ScriptedRunner(FakeRunner):
    """Every sample emits SCRIPT's bytes in order (then EOS), whatever its prompt: outputs with
    multi-byte characters at known token positions."""

    def __init__(self, sched, buckets, script):
        super().__init__(sched, buckets)
        self.script = script

    def execute(self, plan, rows):
        S = len(plan.seqs)
        tokens = np.array([self.script[len(r.output_ids)] if len(r.output_ids) < len(self.script) else EOS_ID
                           for r in rows], np.int32)
        return StepResult(tokens, np.zeros(S, np.float32), np.zeros((S, MAX_LOGPROBS), np.int32),
                          np.zeros((S, MAX_LOGPROBS), np.float32), tuple((i,) for i in range(S)))


@contextlib.contextmanager
def scripted_server(script=SCRIPT):
    engine = make_fake_engine(runner=lambda sched, buckets: ScriptedRunner(sched, buckets, script))
    s = BackgroundServer(engine, ServerConfig(port=0, progress=False))
    s.start(30.0)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("cut", range(1, len(SCRIPT)))
def test_a_length_cut_inside_a_character_leaves_it_out_of_the_text(cut):
    whole = [i for i in range(len(SCRIPT) + 1) if SCRIPT[:i] and _complete(SCRIPT[:i])]
    want = bytes(SCRIPT[:max(i for i in whole if i <= cut)] if any(i <= cut for i in whole) else []).decode()
    with scripted_server() as s:
        stub = gen_stub(s)
        req = pb.GenerateRequest(prompt="x", max_tokens=cut)
        msgs = list(stub.Generate(req, timeout=10))
        assert "".join(m.text for m in msgs) == want
        assert [t for m in msgs for t in m.token_ids] == SCRIPT[:cut]  # the bytes are kept
        c = stub.GenerateUnary(req, timeout=10).completions[0]
        assert (c.text, list(c.token_ids), c.finish_reason) == (want, SCRIPT[:cut], pb.FINISH_REASON_LENGTH)
        out = list(js_stub(s).Decode(js.DecodeRequest(max_tokens=cut, text_content=js.DecodeRequest.TextContent(
            text="x")), timeout=10))
        assert "".join(m.stream_content.samples[0].text for m in out) == want
        wait_idle(s)


def _complete(bs) -> bool:
    try:
        bytes(bs).decode()
        return True
    except UnicodeDecodeError:
        return False


def test_a_model_that_ends_inside_a_character_keeps_its_replacement_character():
    """EOS after half a character: the model produced invalid text, and the text says so."""
    with scripted_server(SCRIPT[:2]) as s:
        c = gen_stub(s).GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=10), timeout=10).completions[0]
        assert c.finish_reason == pb.FINISH_REASON_STOP and c.text == "\ufffd"


def test_jetstream_healthcheck_needs_no_token_like_the_health_service():
    with fake_server(server={"auth_token": "s3cret-token"}) as s:
        stub = jetstream_grpc.OrchestratorStub(grpc.insecure_channel(s.address))
        assert stub.HealthCheck(js.HealthCheckRequest(), timeout=5).is_live is True
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(js.DecodeRequest(max_tokens=2, text_content=js.DecodeRequest.TextContent(text="x")),
                             timeout=5))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_unknown_lora_adapter_is_refused_not_served_by_the_base_model():
    with fake_server() as s:
        req = js.DecodeRequest(max_tokens=2, text_content=js.DecodeRequest.TextContent(text="x"),
                               lora_adapter_id="my-adapter")
        with pytest.raises(grpc.RpcError) as e:
            list(js_stub(s).Decode(req, timeout=5))
        assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "lora_adapter_id")
        assert "my-adapter" in e.value.details()
        req.lora_adapter_id = ""
        assert list(js_stub(s).Decode(req, timeout=5))
        wait_idle(s)


@dataclasses.dataclass
class BosTokenizer:
    bos_token_id: int | None = 1
    add_bos_token: bool = True


@pytest.mark.parametrize("has_bos,tok,ids,want", [
    (False, BosTokenizer(), [5, 6], [1, 5, 6]),  # JetStream adds the BOS the content lacks
    (True, BosTokenizer(), [5, 6], [5, 6]),  # the client says the content has it
    (False, BosTokenizer(), [1, 5], [1, 5]),  # never twice
    (False, BosTokenizer(add_bos_token=False), [5], [5]),  # a model without BOS (SmolLM2)
    (False, BosTokenizer(bos_token_id=None), [5], [5]),
])
def test_has_bos_is_honoured(has_bos, tok, ids, want):
    spec = messages.spec_from_decode(js.DecodeRequest(
        max_tokens=1, has_bos=has_bos, token_content=js.DecodeRequest.TokenContent(token_ids=ids)))
    assert request_check.tokenize({"prompt_token_ids": spec.token_ids}, tok, spec.add_bos)[1] == want


def _finished(s, outcome: str) -> float:
    return s.server.metrics.registry.get_sample_value("jaxserve_finished_requests_total",
                                                      {"outcome": outcome}) or 0.0


class _Left:
    def __init__(self, remaining):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


@pytest.mark.parametrize("remaining,want", [
    (None, "cancelled"),  # no deadline
    (-0.01, "deadline_exceeded"),  # the server's own timer fired
    (0.02, "deadline_exceeded"),  # the client's timer fired first and cancelled (CI saw this)
    (calls.DEADLINE_SLACK_S + 0.01, "cancelled"),
    (29.9, "cancelled"),
])
def test_why_left_counts_a_cancel_at_the_deadline_as_an_expiry(remaining, want):
    assert calls.why_left(_Left(remaining)) == want


def test_deadline_expiries_are_their_own_outcome_in_the_metrics():
    with fake_server(step_delay_s=0.02) as s:
        stub = gen_stub(s)
        with pytest.raises(grpc.RpcError) as e:
            # 2 s of a 4 s generation: long enough that the server has taken the call (and
            # counts its outcome) before the deadline even on a loaded machine
            list(stub.Generate(pb.GenerateRequest(prompt="slow", max_tokens=200, ignore_eos=True), timeout=2.0))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stream = stub.Generate(pb.GenerateRequest(prompt="cancel me", max_tokens=200, ignore_eos=True), timeout=30)
        next(stream)
        stream.cancel()
        wait_until(lambda: _finished(s, "deadline_exceeded") + _finished(s, "cancelled") == 2, 5, "both counted")
        assert (_finished(s, "deadline_exceeded"), _finished(s, "cancelled")) == (1.0, 1.0)
        wait_idle(s)
