"""Disaggregated serving as separate processes on loopback (`jaxserve serve --role prefill`, two
of them, `--role decode`, `--role router`) on the default model (SmolLM2-135M-Instruct, fp32):
HF's held-out greedy continuations (tests/goldens/smollm2.json) come back token for token
through the router; a cancelled stream leaves both engines with no page held; and the faults a
deployment meets end as the router promises (router.py's module doc):

- a prefill process killed while it holds a request that has streamed nothing: the router
  retries it on the other prefill server, and the client sees only the right answer;
- a decode process killed mid-stream: the client's stream ends UNAVAILABLE naming that decode
  server, the prefill servers end with no page held, and the router, left without a decode
  server, reports NOT_SERVING.

Pages are read from each server's Prometheus endpoint, as an operator would. The four engine
processes share one compilation cache, so only the first compiles.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((ROOT / "tests" / "goldens" / "smollm2.json").read_text())
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--token-buckets",
          "8,32", "--kv-cache-mb", "64", "--kv-transfer-timeout", "10"]


class Proc:
    def __init__(self, name: str, args: list[str], tmp: Path, env: dict):
        self.name, self.log = name, tmp / f"{name}.log"
        with open(self.log, "w") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--no-progress",
                                       "--metrics-port", "0", "--grace-period", "5", *args],
                                      env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.log.read_text())
            if m:
                return m
            if self.p.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: no {pattern!r} (exit {self.p.poll()}):\n{self.log.read_text()[-3000:]}")

    def started(self) -> "Proc":
        m = self.wait_for(r"listening on 127\.0\.0\.1:(\d+).*metrics on :(\d+)")
        self.address, self.metrics_port = f"localhost:{m.group(1)}", int(m.group(2))
        self.wait_for(r"jaxserve: ready")
        return self

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{self.name}: no metric {name}"
        return float(m.group(1))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def wait_until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def idle(p: Proc) -> bool:
    return (p.metric("jaxserve_kv_pages_used") == 0 and p.metric("jaxserve_num_requests_running") == 0
            and p.metric("jaxserve_num_requests_waiting") == 0)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cache = ["--compilation-cache-dir", str(tmp / "xla")]
    procs: dict[str, Proc] = {}
    try:
        procs["prefill0"] = Proc("prefill0", ["--role", "prefill", *ENGINE, *cache], tmp, env).started()
        for name, role in (("prefill1", "prefill"), ("decode", "decode")):  # compiled already: the cache
            procs[name] = Proc(name, ["--role", role, *ENGINE, *cache], tmp, env)
        for name in ("prefill1", "decode"):
            procs[name].started()
        procs["router"] = Proc("router", ["--role", "router", "--prefill-servers",
                                          f"{procs['prefill0'].address},{procs['prefill1'].address}",
                                          "--decode-servers", procs["decode"].address, "--http-port", "0"],
                               tmp, env).started()
        procs["router"].http_port = int(procs["router"].wait_for(r"OpenAI HTTP on :(\d+)").group(1))
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def stub(p: Proc) -> generation_grpc.GenerationStub:
    return generation_grpc.GenerationStub(grpc.insecure_channel(p.address))


def golden_request(i: int, case: dict) -> pb.GenerateRequest:
    # Greedy, as HF's goldens; its max_new_tokens was 40, and an EOS it met ends ours too.
    return pb.GenerateRequest(request_id=f"g{i}", prompt_token_ids=pb.TokenIds(ids=case["prompt_ids"]),
                              max_tokens=len(case["greedy_ids"]), temperature=0.0, skip_special_tokens=False)


def stream_ids(p: Proc, req: pb.GenerateRequest) -> tuple[list[int], str, list[pb.GenerateResponse]]:
    msgs = list(stub(p).Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs


def test_hf_goldens_come_back_through_router_prefill_and_decode_processes(deployment):
    router, decode = deployment["router"], deployment["decode"]
    results: dict[int, tuple] = {}

    def one(i, case):
        results[i] = stream_ids(router, golden_request(i, case))
    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(GOLDEN["cases"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, case in enumerate(GOLDEN["cases"]):
        ids, text, msgs = results[i]
        assert ids == case["greedy_ids"], case["prompt"]
        assert text == case["greedy_text"], case["prompt"]
        assert all(m.request_id == f"g{i}" for m in msgs)
        assert msgs[-1].usage.prompt_tokens == len(case["prompt_ids"])
        assert msgs[-1].timings.ttft_s > 0 and msgs[-1].timings.e2e_s >= msgs[-1].timings.ttft_s
    # Each went on to the decode server (all are longer than one token), whose pull took time.
    assert decode.metric("jaxserve_kv_transfer_seconds_count") >= len(GOLDEN["cases"])
    for name in ("prefill0", "prefill1", "decode"):
        wait_until(lambda: idle(deployment[name]), 20, f"{name} to be idle")
        # Each process's own count: the decode side's page writes of pulled KV included.
        assert deployment[name].metric("jaxserve_compilations_after_warmup") == 0, name


def test_hf_goldens_come_back_through_the_routers_openai_door(deployment):
    """`--http-port` on the router: the OpenAI completions call, its tokenizer loaded from the
    default --model, the prompt as token ids, streamed and not: HF's tokens and text."""
    router = deployment["router"]
    url = f"http://127.0.0.1:{router.http_port}"
    wait_until(lambda: urllib.request.urlopen(url + "/health", timeout=5).status == 200, 30, "the HTTP door")
    model = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=5).read())["data"][0]["id"]
    for case in GOLDEN["cases"][:3]:
        for stream in (False, True):
            body = dict(model=model, prompt=case["prompt_ids"], max_tokens=len(case["greedy_ids"]), temperature=0,
                        logprobs=0, skip_special_tokens=False, stream=stream)
            req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            raw = urllib.request.urlopen(req, timeout=120).read().decode()
            if stream:
                events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
                text = "".join(c["text"] for e in events for c in e["choices"])
                tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
            else:
                choice = json.loads(raw)["choices"][0]
                text, tokens = choice["text"], choice["logprobs"]["tokens"]
            assert text == case["greedy_text"], (case["prompt"], stream)
            assert len(tokens) == len(case["greedy_ids"])
    for name in ("prefill0", "prefill1", "decode"):
        wait_until(lambda: idle(deployment[name]), 20, f"{name} to be idle")


def test_a_stream_cancelled_after_the_handover_frees_pages_on_both_sides(deployment):
    router, decode = deployment["router"], deployment["decode"]
    before = decode.metric("jaxserve_kv_transfer_seconds_count")
    call = stub(router).Generate(pb.GenerateRequest(prompt="Tell me a long story about a dragon.", max_tokens=200,
                                                    ignore_eos=True, temperature=0.7, seed=1, n=2), timeout=120)
    got = 0
    for _ in call:
        got += 1
        if got == 6:  # past the first token: the decode server has it
            break
    call.cancel()
    assert decode.metric("jaxserve_kv_transfer_seconds_count") == before + 1
    for name in ("prefill0", "prefill1", "decode"):
        wait_until(lambda: idle(deployment[name]), 20, f"{name} to be idle after the cancel")


def test_a_prefill_process_killed_holding_a_request_is_retried_on_the_other(deployment):
    """prefill0 is stopped (SIGSTOP) so the request it is given streams nothing, then killed:
    the router sees UNAVAILABLE before anything reached the client and runs the request on
    prefill1; the client's tokens are HF's."""
    router, victim = deployment["router"], deployment["prefill0"]
    case = GOLDEN["cases"][1]
    # The router picks the prefill server with the fewest tokens in flight, ties to the first
    # listed (prefill0); the request is sent at once, well before a health check (1 s timeout)
    # could take the stopped process out of rotation.
    victim.p.send_signal(signal.SIGSTOP)
    result: list = []
    t = threading.Thread(target=lambda: result.append(stream_ids(router, golden_request(9, case))))
    t.start()
    wait_until(lambda: router.metric(f'jaxserve_router_backend_inflight{{backend="{victim.address}",'
                                     f'role="prefill"}}') == 1, 5, "the router to give prefill0 the request")
    victim.p.kill()
    victim.p.wait(10)
    t.join(120)
    assert result, "the client's call did not return"
    ids, text, _ = result[0]
    assert ids == case["greedy_ids"] and text == case["greedy_text"]
    assert router.metric("jaxserve_router_prefill_retries_total") == 1
    wait_until(lambda: router.metric(f'jaxserve_router_backend_healthy{{backend="{victim.address}",'
                                     f'role="prefill"}}') == 0, 10, "the router to take prefill0 out")
    wait_until(lambda: idle(deployment["prefill1"]) and idle(deployment["decode"]), 20, "the survivors to be idle")


def test_a_decode_process_killed_mid_stream_ends_the_call_unavailable_naming_it(deployment):
    router, decode, prefill = deployment["router"], deployment["decode"], deployment["prefill1"]
    call = stub(router).Generate(pb.GenerateRequest(prompt="Count from one to one hundred:", max_tokens=200,
                                                    ignore_eos=True, temperature=0.0), timeout=120)
    it = iter(call)
    for _ in range(5):
        next(it)  # tokens from the decode server
    decode.p.kill()
    decode.p.wait(10)
    with pytest.raises(grpc.RpcError) as e:
        for _ in it:
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert f"decode server {decode.address}" in e.value.details()
    wait_until(lambda: idle(prefill), 20, "the prefill server to be idle")
    hs = health_pb2_grpc.HealthStub(grpc.insecure_channel(router.address))
    wait_until(lambda: hs.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "the router to say NOT_SERVING")
    with pytest.raises(grpc.RpcError) as e:
        stub(router).GenerateUnary(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no decode server" in e.value.details()


def test_the_router_drains_on_sigterm(deployment):
    router = deployment["router"]
    router.p.send_signal(signal.SIGTERM)
    assert router.p.wait(30) == 0, router.log.read_text()[-2000:]
    log = router.log.read_text()
    assert "jaxserve: draining" in log and "jaxserve: stopped" in log
