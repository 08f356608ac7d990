"""A step that raises fails only what it can blame and the server goes on; an unrecoverable
fault turns liveness off and makes `serve` exit non-zero (jaxserve/engine/faults.py).

Real gRPC clients against a real server over the fake engine; faults come from
`FaultInjectingRunner` (raise on chosen steps or rows) or the fake runner's own `fail_next`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

import jaxserve.types
from jaxserve.engine.faults import FaultInjectingRunner
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import (NOT_SERVING, SERVING, check_stream, code_and_field, fake_server,
                                 gen_stub, health, wait_idle, wait_until)

ROOT = Path(__file__).resolve().parents[1]


def long_request(prompt: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_tokens=kw.pop("max_tokens", 60), ignore_eos=True, **kw)


def test_a_request_a_validation_gap_let_through_fails_alone_with_its_field(monkeypatch):
    """The first QA finding: top_k = 2^31 overflowed the step's int32 array and took the server
    down. Re-opened here as a validation gap (the int32 bound patched away): the step fails,
    re-validation blames the one request (its row does not fit), it alone ends INVALID_ARGUMENT
    naming top_k, and the stream beside it finishes normally."""
    with fake_server(step_delay_s=0.01) as s:
        stub = gen_stub(s)
        other = stub.Generate(long_request("bystander"), timeout=30)
        first = next(other)
        monkeypatch.setattr(jaxserve.types, "INT32_MAX", 2**62)
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=3, top_k=2**31, temperature=1.0),
                               timeout=10)
        assert code_and_field(e.value) == (grpc.StatusCode.INVALID_ARGUMENT, "top_k"), e.value.details()
        assert "int32" in e.value.details()
        check_stream([first] + list(other))  # the bystander finished with OK
        assert s.server.engine.stats["step_faults"] >= 1
        assert health(s) == SERVING and health(s, "liveness") == SERVING
        assert stub.GenerateUnary(pb.GenerateRequest(prompt="next", max_tokens=2), timeout=10).completions
        wait_idle(s)


def test_an_unblamed_fault_fails_that_steps_requests_and_serving_goes_on():
    """No request to blame (a device error): the requests of that step end INTERNAL with the
    cause, their pages are freed, readiness dips and comes back, and new requests are served
    by the same engine (no restart)."""
    with fake_server(step_delay_s=0.01) as s:
        stub = gen_stub(s)
        a = stub.Generate(long_request("first"), timeout=30)
        b = stub.Generate(long_request("second"), timeout=30)
        next(a), next(b)
        s.server.engine.runner.fail_next = RuntimeError("XlaRuntimeError: device hiccup")
        for stream in (a, b):
            with pytest.raises(grpc.RpcError) as e:
                list(stream)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "device hiccup" in e.value.details()
            assert "the others go on" in e.value.details()
        wait_until(lambda: health(s) == SERVING, 5, "readiness back to SERVING")
        assert health(s, "liveness") == SERVING
        out = stub.GenerateUnary(pb.GenerateRequest(prompt="after", max_tokens=5), timeout=10)
        assert out.completions[0].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
        wait_idle(s)  # every page back, every request ended exactly once
        assert s.server.engine.stats["step_faults"] == 1


def test_a_fault_on_chosen_requests_fails_them_and_readiness_dips_until_a_step_runs():
    """Injected on every step holding a seed-666 row, until that request is gone: the
    step's requests fail; readiness is NOT_SERVING between the fault and the next good step."""
    dips = []
    with fake_server(step_delay_s=0.01,
                     on_step=lambda el: dips.append(el.degraded)) as s:
        eng = s.server.engine
        eng.runner = FaultInjectingRunner(eng.runner, lambda step, plan, rows: any(r.params.seed == 666 for r in rows))
        stub = gen_stub(s)
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(pb.GenerateRequest(prompt="poison", max_tokens=4, seed=666), timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()
        wait_until(lambda: health(s) == SERVING, 5, "readiness back")
        assert stub.GenerateUnary(pb.GenerateRequest(prompt="fine", max_tokens=4, seed=1), timeout=10)
        assert eng.runner.injected == 1 and True in dips and dips[-1] is False
        wait_idle(s)


def test_a_fault_that_loses_the_kv_cache_fails_everything_in_the_engine_then_serves():
    with fake_server(step_delay_s=0.01, max_num_seqs=1) as s:
        stub = gen_stub(s)
        running = stub.Generate(long_request("running"), timeout=30)
        next(running)
        queued = stub.GenerateUnary.future(long_request("queued"), timeout=30)  # waits: 1 seq per step
        wait_until(lambda: s.server.engine.scheduler.num_waiting == 1, 5, "the second request queued")
        runner = s.server.engine.runner
        runner.cache_lost = True
        runner.fail_next = RuntimeError("device reset")
        with pytest.raises(grpc.RpcError) as e:
            list(running)
        assert e.value.code() == grpc.StatusCode.INTERNAL
        with pytest.raises(grpc.RpcError) as e:
            queued.result()
        assert e.value.code() == grpc.StatusCode.INTERNAL and "KV cache was lost" in e.value.details()
        assert runner.cache_resets == 1
        wait_until(lambda: health(s) == SERVING, 5, "readiness back")
        assert stub.GenerateUnary(pb.GenerateRequest(prompt="after", max_tokens=3), timeout=10).completions
        wait_idle(s)


def test_faults_in_a_row_turn_liveness_off_and_later_calls_unavailable():
    with fake_server(server={"max_consecutive_step_faults": 2}) as s:
        eng = s.server.engine
        eng.runner = FaultInjectingRunner(eng.runner, lambda step, plan, rows: True,
                                          lambda: RuntimeError("device gone"))
        stub = gen_stub(s)
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as e:
                stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=10)
            assert e.value.code() == grpc.StatusCode.INTERNAL and "device gone" in e.value.details()
        wait_until(lambda: health(s, "liveness") == NOT_SERVING, 5, "liveness NOT_SERVING")
        assert health(s) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "restart" in e.value.details()
        assert s.server.fatal.is_set()


def test_an_engine_that_cannot_make_a_new_cache_is_broken():
    with fake_server() as s:
        runner = s.server.engine.runner

        def no_device():
            raise RuntimeError("no device")
        runner.reset_cache = no_device
        runner.cache_lost = True
        runner.fail_next = RuntimeError("device lost")
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "EngineBroken" in e.value.details()
        wait_until(lambda: health(s, "liveness") == NOT_SERVING, 5, "liveness NOT_SERVING")


def test_serve_exits_non_zero_soon_after_an_unrecoverable_fault():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--fake-model", "--port", "0", "--no-progress",
         "--fake-fail-from-step", "0", "--max-consecutive-step-faults", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("jaxserve: listening on"):
                port = int(line.split(":")[2].split()[0])
            if line.startswith("jaxserve: ready"):
                break
        assert port, lines
        stub = generation_grpc.GenerationStub(grpc.insecure_channel(f"localhost:{port}"))
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as e:
                stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=3), timeout=10)
            assert e.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        t0 = time.monotonic()
        assert proc.wait(timeout=20) == 1
        assert time.monotonic() - t0 < 20
        rest = proc.stdout.read()
        assert "jaxserve: error: unrecoverable engine fault" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
