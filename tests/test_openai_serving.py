"""The OpenAI-compatible HTTP server as load balancers, gateways and operators meet it: the
bearer token, 429 with Retry-After when the queue is full, /health, /ready and /live through
warm-up, draining and an engine fault, client disconnects freeing their pages, and /metrics
(vLLM's names beside jaxserve's, the metrics-only port). A real loopback server over the fake
engine, through the official `openai` client and raw HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from test_server_support import (MODEL, NOT_SERVING, SERVING, TOKEN, base_url, gen_stub, health,
                                 http_server, metric, wait_idle, wait_until)


@pytest.fixture(scope="module")
def server():
    with http_server() as s:
        yield s


def test_auth_token_on_every_path_but_the_probes():
    with http_server(server={"auth_token": TOKEN}) as s:
        b = base_url(s)
        bad = openai.OpenAI(base_url=b + "/v1", api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(b + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "missing" in r.json()["error"]["message"]
        good = openai.OpenAI(base_url=b + "/v1", api_key=TOKEN, max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
        for path in ("/health", "/ready", "/live", "/metrics"):
            assert httpx.get(b + path).status_code == 200
        assert metric(s, "jaxserve_rejected_requests_total", '{reason="unauthenticated"}') == 2


def test_queue_full_is_429_with_retry_after_and_warming_up_is_503():
    with http_server(server={"max_queued_requests": 2}) as s:
        el = s.server.engine_loop
        el.pause()
        b = base_url(s)
        results = []

        def call():
            results.append(httpx.post(b + "/v1/completions", timeout=30,
                                      json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2}))
        t = threading.Thread(target=call)
        t.start()
        wait_until(lambda: el.num_waiting_here == 1, what="queued")
        r = httpx.post(b + "/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=b + "/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="y", max_tokens=2)
        el.resume()
        t.join(10)
        assert results[0].status_code == 200 and len(results[0].json()["choices"]) == 2
        wait_idle(s)
    with http_server(warmup_s=threading.Event(), ready=False) as s:  # warm until the test ends
        b = base_url(s)
        assert httpx.get(b + "/ready").status_code == 503 and httpx.get(b + "/health").status_code == 503
        assert httpx.get(b + "/live").status_code == 200  # warming up is alive
        r = httpx.post(b + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]


# ---- readiness as load balancers read it: /health, /ready, /live -------------------------------

def test_a_client_polling_health_until_200_is_never_refused_503():
    """vLLM's and TGI's contract, which Kubernetes readiness probes, gateways and benchmark clients
    rely on: poll /health, then send. During warm-up /health is 503 (saying why), /live 200, gRPC
    readiness NOT_SERVING; the first completion after the first 200 is served."""
    warm = threading.Event()  # warm-up lasts until every poller below has seen it
    with http_server(warmup_s=warm, ready=False) as s:
        b = base_url(s)
        r = httpx.get(b + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "warming_up" and "warming up" in err["message"]
        assert err["type"] == "service_unavailable"
        assert httpx.get(b + "/ready").json() == r.json()  # /ready is an alias
        assert httpx.head(b + "/health").status_code == 503
        assert httpx.get(b + "/live").status_code == 200 and httpx.head(b + "/live").status_code == 200
        assert health(s) == NOT_SERVING and health(s, "liveness") == SERVING

        def poll_then_send(results: list) -> None:
            with httpx.Client(base_url=b, timeout=30) as c:
                polls = 0
                while c.get("/health").status_code != 200:
                    polls += 1
                    if polls == 1:
                        saw_503.append(1)
                    time.sleep(0.005)
                results.append((polls, c.post("/v1/completions",
                                              json={"model": MODEL, "prompt": "go", "max_tokens": 3})))
        results: list = []
        saw_503: list = []
        pollers = [threading.Thread(target=poll_then_send, args=(results,)) for _ in range(4)]
        for t in pollers:
            t.start()
        wait_until(lambda: len(saw_503) == 4, what="every poller saw the warm-up")
        warm.set()
        for t in pollers:
            t.join(30)
        assert len(results) == 4
        for _, r in results:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        assert health(s) == SERVING
        r = httpx.get(b + "/health")
        assert r.status_code == 200 and r.text == "ok\n" and httpx.get(b + "/ready").status_code == 200
        wait_idle(s)


def test_health_is_503_while_draining_and_live_stays_200():
    import grpc

    from jaxserve.server.proto import generation_pb2 as pb
    with http_server(step_delay_s=0.02) as s:
        b = base_url(s)
        assert httpx.get(b + "/health").status_code == 200
        # A long call (200 tokens, 4 s) keeps the drain going for its grace period.
        long = gen_stub(s).Generate(pb.GenerateRequest(prompt="long", max_tokens=200, ignore_eos=True),
                                    timeout=30)
        assert next(long).token_ids  # running
        drainer = threading.Thread(target=s.drain, args=(3.0,))
        drainer.start()
        wait_until(lambda: httpx.get(b + "/health").status_code == 503, 5, "/health 503")
        r = httpx.get(b + "/health")
        assert r.json()["error"]["code"] == "draining" and "shutting down" in r.json()["error"]["message"]
        assert "retry-after" not in r.headers  # this replica is not coming back
        assert httpx.get(b + "/ready").status_code == 503
        assert httpx.get(b + "/live").status_code == 200
        assert health(s) == NOT_SERVING and health(s, "liveness") == SERVING
        r = httpx.post(b + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        drainer.join(15)
        assert not drainer.is_alive()
        with pytest.raises(grpc.RpcError) as e:
            list(long)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # ended at the grace period's end


def test_health_and_live_are_503_after_an_unrecoverable_engine_fault():
    from jaxserve.engine.faults import FaultInjectingRunner
    with http_server(server={"max_consecutive_step_faults": 1}) as s:
        b = base_url(s)
        eng = s.server.engine
        eng.runner = FaultInjectingRunner(eng.runner, lambda step, plan, rows: True,
                                          lambda: RuntimeError("device gone"))
        r = httpx.post(b + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and "device gone" in r.json()["error"]["message"]
        wait_until(lambda: httpx.get(b + "/live").status_code == 503, 5, "/live 503")
        for path in ("/health", "/ready", "/live"):
            err = httpx.get(b + path).json()["error"]
            assert err["code"] == "engine_failed" and "restart" in err["message"], (path, err)
        assert health(s) == NOT_SERVING and health(s, "liveness") == NOT_SERVING


# ---- disconnects free pages --------------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(stream):
    with http_server(step_delay_s=0.02) as s:
        b = base_url(s)
        body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 200, "ignore_eos": True, "stream": stream}
        with httpx.Client(base_url=b, timeout=0.5 if not stream else 30) as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    got = [next(lines) for _ in range(6)]  # three events in, then hang up
                    assert sum(1 for g in got if g.startswith("data: ")) == 3
                    scrape = httpx.get(b + "/metrics").text
                    used = metric(s, "jaxserve_kv_pages_used", text=scrape)
                    total = metric(s, "jaxserve_kv_pages_total", text=scrape)
                    assert used > 0
                    assert metric(s, "vllm:kv_cache_usage_perc", '{model_name="fake"}', scrape) == used / total
            else:
                with pytest.raises(httpx.ReadTimeout):  # 200 tokens take 4 s; we leave after 0.5
                    c.post("/v1/completions", json=body)
        wait_until(lambda: metric(s, "jaxserve_finished_requests_total", '{outcome="cancelled"}') == 1,
                   what="the request to be cancelled")
        wait_until(lambda: metric(s, "jaxserve_kv_pages_used") == 0, what="pages freed (from /metrics)")
        assert metric(s, "jaxserve_generation_tokens_total") < 200
        wait_idle(s)


def test_vllm_metric_names_mirror_jaxserve(server):
    client = openai.OpenAI(base_url=base_url(server) + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=7,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    wait_idle(server)
    lab = '{model_name="fake"}'
    t = httpx.get(base_url(server) + "/metrics").text  # one scrape: the two names must agree in it

    def m(name, labels=""):
        return metric(server, name, labels, t)
    for ours, theirs in (("jaxserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("jaxserve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("jaxserve_num_requests_running", "vllm:num_requests_running"),
                         ("jaxserve_num_requests_waiting", "vllm:num_requests_waiting"),
                         ("jaxserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                         ("jaxserve_e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
                         ("jaxserve_time_per_output_token_seconds_count", "vllm:time_per_output_token_seconds_count")):
        assert m(theirs, lab) == m(ours), theirs
    assert m("vllm:prompt_tokens_total", lab) >= 8
    length = m("vllm:request_success_total", '{finished_reason="length",model_name="fake"}')
    assert length >= 1 and length == m("jaxserve_request_success_total", '{finished_reason="length"}')
    assert m("vllm:kv_cache_usage_perc", lab) == 0.0  # idle: every page free


def test_metrics_port_answers_only_metrics():
    with http_server(server={"metrics_port": 0, "http_port": None}) as s:
        m = f"http://127.0.0.1:{s.server.metrics_port}"
        assert httpx.get(m + "/metrics").status_code == 200
        for path in ("/", "/v1/models", "/ready", "/metricsx"):
            assert httpx.get(m + path).status_code == 404, path
        assert httpx.post(m + "/metrics").status_code == 405
