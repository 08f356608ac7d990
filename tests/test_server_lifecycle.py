"""Health transitions (warm-up, a stalled step, an engine fault, a dead engine thread) and the
SIGTERM drain of a real `jaxserve serve` subprocess."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.proto import generation_grpc, jetstream_pb2
from jaxserve.server.proto import generation_pb2 as pb
from test_server_support import (NOT_SERVING, SERVING, channel, check_stream, fake_server, gen_stub,
                                 health, js_stub, wait_until)

ROOT = Path(__file__).resolve().parents[1]


def test_not_serving_during_warmup_then_serving():
    warm = threading.Event()  # warm-up lasts until the checks below are done
    with fake_server(warmup_s=warm, ready=False) as s:
        # Readiness waits for warm-up; liveness does not.
        assert health(s) == NOT_SERVING and health(s, "jaxserve.v1.Generation") == NOT_SERVING
        assert health(s, "liveness") == SERVING
        assert js_stub(s).HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=5).is_live is False
        watch = health_pb2_grpc.HealthStub(channel(s)).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "warming up" in e.value.details()
        # Tokenizing needs no engine.
        assert list(gen_stub(s).Tokenize(pb.TokenizeRequest(text="ok"), timeout=5).token_ids) == [111, 107]
        warm.set()
        assert next(watch).status == SERVING  # pushed when warm-up ends
        watch.cancel()
        assert js_stub(s).HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=5).is_live is True
        check_stream(list(gen_stub(s).Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5)))


def test_a_stalled_step_flips_readiness_and_liveness_until_it_ends():
    with fake_server(server={"stall_timeout_s": 0.3}) as s:
        s.server.engine.runner.stall_next_s = 2.0
        fut = gen_stub(s).GenerateUnary.future(pb.GenerateRequest(prompt="slow", max_tokens=3), timeout=20)
        wait_until(lambda: health(s, "liveness") == NOT_SERVING, 5, "liveness NOT_SERVING")
        assert health(s) == NOT_SERVING
        assert fut.result().completions[0].finish_reason == pb.FINISH_REASON_LENGTH
        wait_until(lambda: health(s) == SERVING and health(s, "liveness") == SERVING, 5, "recovery")


def test_a_dead_engine_thread_never_leaves_a_request_hanging():
    with fake_server() as s:
        el = s.server.engine_loop

        def boom():
            raise RuntimeError("a bug in the loop")
        el.pause()
        fut = gen_stub(s).GenerateUnary.future(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=20)
        wait_until(lambda: el.num_waiting_here == 1, 5, "queued")
        el._feed = boom
        el.resume()
        with pytest.raises(grpc.RpcError) as e:
            fut.result()
        assert e.value.code() == grpc.StatusCode.INTERNAL and "engine thread died" in e.value.details()
        wait_until(lambda: not el.alive, 5, "the thread to end")
        wait_until(lambda: health(s, "liveness") == NOT_SERVING, 5, "liveness off")
        with pytest.raises(grpc.RpcError) as e:
            gen_stub(s).GenerateUnary(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- SIGTERM drain --------------------------------------------------------------------------

def _lines(proc) -> "queue.Queue[str]":
    q: queue.Queue[str] = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put("<EOF>")
    threading.Thread(target=pump, daemon=True).start()
    return q


def _expect(q, prefix: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    seen = []
    while time.monotonic() < end:
        try:
            line = q.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting {prefix!r} in {timeout} s; got {seen}")


def test_sigterm_drains_in_flight_calls_then_exits():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--fake-model", "--port", "0", "--no-progress",
         "--fake-step-delay", "0.05", "--grace-period", "3", "--http-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = _lines(proc)
        listening = _expect(out, "jaxserve: listening on", 60)
        port = int(listening.split(":")[2].split()[0])
        http = f"http://127.0.0.1:{int(listening.rsplit(':', 1)[1].split()[0])}"
        _expect(out, "jaxserve: ready", 30)
        assert httpx.get(http + "/health").status_code == 200
        ch = grpc.insecure_channel(f"localhost:{port}")
        stub = generation_grpc.GenerationStub(ch)
        short = stub.Generate(pb.GenerateRequest(prompt="short", max_tokens=20, ignore_eos=True), timeout=30)
        long = stub.Generate(pb.GenerateRequest(prompt="long", max_tokens=2000, ignore_eos=True), timeout=30)
        first = [next(short), next(long)]
        assert all(m.token_ids for m in first)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _expect(out, "jaxserve: SIGTERM: draining", 5)
        hstub = health_pb2_grpc.HealthStub(ch)
        assert hstub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == NOT_SERVING
        assert hstub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=2).status == SERVING
        # HTTP says the same: not ready (a load balancer stops sending), but alive (no restart).
        r = httpx.get(http + "/health", timeout=2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert httpx.get(http + "/live", timeout=2).status_code == 200
        with pytest.raises(grpc.RpcError) as e:
            stub.GenerateUnary(pb.GenerateRequest(prompt="new", max_tokens=2), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # The short call finishes normally within the grace period ...
        check_stream(first[:1] + list(short))
        assert time.monotonic() - t0 < 3
        # ... the long one is ended at its end, as UNAVAILABLE (retry elsewhere), not dropped.
        with pytest.raises(grpc.RpcError) as e:
            list(long)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in e.value.details()
        assert 2.5 < time.monotonic() - t0 < 6
        assert proc.wait(timeout=15) == 0
        _expect(out, "jaxserve: stopped", 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
