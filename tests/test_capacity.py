"""scripts/capacity.py: the search finds a known safe rate (the real engine with the fake
runner, in virtual time), arrivals have the asked-for statistics, the gRPC and HTTP targets work
over loopback and refuse other hosts."""

from __future__ import annotations

import random
import statistics
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import capacity  # noqa: E402

from jaxserve.server.fake_engine import fake_tokenizer, make_fake_engine  # noqa: E402

STEP_S = 0.010
OUT = 10  # tokens per request: 1 prefill step + 9 decode steps = 100 ms alone
N = 50


def known_service_target():
    # One sequence slot and a constant step cost: the server does exactly one request per
    # OUT steps, a service rate of 1 / (OUT * STEP_S) = 10 requests/s.
    return capacity.SimTarget(lambda: make_fake_engine(max_num_seqs=1, max_num_batched_tokens=64,
                                                       num_pages=64),
                              lambda tokens: STEP_S)


def test_search_finds_the_known_safe_rate_within_10_percent():
    tok = fake_tokenizer()
    reqs = capacity.make_requests(tok, [(8, OUT)] * N, seed=0)
    assert all(len(r.prompt_ids) == 8 for r in reqs)
    slo = capacity.SLO(ttft_s=0.25, tpot_s=0.05)
    target = known_service_target()

    def trial(rate, seed):
        arrivals = capacity.arrival_times(N, rate, "constant", random.Random(seed))
        return capacity.summarize(rate, *target.run(reqs, arrivals), slo)

    rows, safe, note = capacity.search(trial, [2, 5, 8, 16], slo, trials=1, bisect_steps=8,
                                       rel_tol=0.01, log=lambda m: None)
    # Constant arrivals at r > 10/s: request k waits k * (0.1 - 1/r) behind the others; the p99
    # of 50 (index 48.51) meets TTFT <= 0.25 s (less up to two steps: the first token's and the
    # wait for a step boundary) while r <= 1 / (0.1 - 0.23 / 48.51) = 10.5/s. Service rate: 10/s.
    expected = 1 / (OUT * STEP_S - (0.25 - 2 * STEP_S) / 48.51)
    assert safe is not None and abs(safe - expected) <= 0.1 * expected, (safe, expected, note)
    assert abs(safe - 1 / (OUT * STEP_S)) <= 0.1 / (OUT * STEP_S)
    low = next(r for r in rows if r["rate"] == 2)
    assert low["slo_met"] and low["tpot_s"]["p99"] == pytest.approx(STEP_S)  # one token a step
    assert low["goodput_req_s"] == low["throughput_req_s"] and low["preemptions_per_request"] == 0
    assert 0 < low["peak_kv_usage"] <= 1
    assert not next(r for r in rows if r["rate"] == 16)["slo_met"]


def test_prompts_share_no_kv_page_within_or_across_seeds():
    # 60 prompts over the corpus's 43 paragraphs: without each prompt's own opening label some
    # would begin with the same paragraph, and the prefix cache would answer their first pages.
    tok = fake_tokenizer()
    lengths = [(40 + i, 4) for i in range(60)]
    prompts = [r.prompt_ids for seed in (1, 2) for r in capacity.make_requests(tok, lengths, seed)]
    assert [len(p) for p in prompts] == [n for n, _ in lengths] * 2
    assert len({tuple(p[:16]) for p in prompts}) == len(prompts)


@pytest.mark.parametrize("kind, cv", [("poisson", 1.0), ("gamma", 3.0), ("constant", 0.0)])
def test_arrivals_have_the_asked_for_mean_and_burstiness(kind, cv):
    t = capacity.arrival_times(20_000, 4.0, kind, random.Random(1), cv=cv or 1.0)
    gaps = [b - a for a, b in zip([0.0] + t, t)]
    mean = statistics.fmean(gaps)
    # 20 000 gaps: the sample mean's relative error is about cv / sqrt(20 000) < 3 %
    assert mean == pytest.approx(0.25, rel=0.07)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, abs=0.3 if cv > 1 else 0.05)


def test_loopback_targets_refuse_other_hosts():
    for cls in (capacity.GrpcTarget, capacity.HttpTarget):
        with pytest.raises(SystemExit, match="loopback"):
            cls("10.1.2.3:50051")


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_loopback_target_replays_a_tenant_mix(backend):
    # The same requests over either protocol: every one completes with exactly its length,
    # each tenant's bearer token makes it a tenant of the server, and the in-process server's
    # metrics give the trial's peak KV usage.
    from test_server_support import fake_server
    with fake_server(fair_share=True, server={"http_port": 0} if backend == "http" else None) as s:
        address = f"127.0.0.1:{s.server.http_port}" if backend == "http" else s.address
        target = capacity.TARGETS[backend](address, s.server, timeout=30)
        reqs = capacity.make_requests(fake_tokenizer(), [(20, 5)] * 6, seed=0,
                                      tenants=[("a", 1.0), ("b", 1.0)])
        fair, served = s.server.engine.scheduler._fair, set()  # tenants the fair share served
        activate = fair.activate  # (recorded as they come: it forgets idle tenants)
        fair.activate = lambda tenant, n: (served.add(tenant), activate(tenant, n))
        outcomes, duration, extras = target.run(reqs, [0.01 * i for i in range(6)])
        row = capacity.summarize(50.0, outcomes, duration, extras, capacity.SLO(30, 30))
        assert row["prefix_cache_hit_tokens"] == 0  # 20-token prompts, each its own first page
    assert row["completed"] == 6 and all(o.tokens == 5 for o in outcomes), [o.code for o in outcomes]
    assert all(o.ttft is not None and 0 <= o.ttft <= o.e2e for o in outcomes)
    assert row["slo_met"] and row["goodput_req_s"] > 0 and set(row["tenants"]) <= {"a", "b"}
    assert 0 < row["peak_kv_usage"] <= 1
    assert len(served) == len({r.tenant for r in reqs}) == 2  # one server tenant per bearer token


def test_command_line_in_process_over_http(tmp_path):
    # As a user runs it (a subprocess: the in-process server's threads and uvicorn stay out of
    # the test worker): the flags build serve's engine (a flag build_engine reads but the
    # script's parser lacked broke --fake-model), the server listens on HTTP and holds the
    # (generous) SLO itself, every request of every trial completes.
    import json
    import subprocess
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({"requests": [{"prompt_tokens": 12 + 9 * i, "output_tokens": 4}
                                                 for i in range(4)]}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "capacity.py"), "--fake-model",
                           "--backend", "http", "--workload", str(workload), "--rates", "40",
                           "--trials", "1", "--warmup-requests", "1", "--tenants", "a=1,b=1", "--server-slo",
                           "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000", "--plot", str(tmp_path / "c.png")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    (row,) = result["rows"]
    assert result["backend"] == "http" and (row["completed"], row["errors"]) == (4, 0)
    assert row["slo_met"] and (tmp_path / "c.png").exists() and result["server_slo"]


@pytest.mark.parametrize("sizing", ["none", "token_cap_only", "full"])
def test_tpot_target_sizes_the_decode_batch(sizing, monkeypatch):
    # A burst of 32 requests at once, 32 sequence slots, a step costing 5 ms + 1 ms per token
    # of its bucket, a TPOT target of 30 ms: only decode batches of at most 24 rows fit. The SLO
    # admission (as the server runs it, in virtual time) holds the target by capping the batch;
    # the token cap alone cannot (the first step, before anything is measured, admits all 32,
    # and a step never drops below one token per running decode), nor can no sizing at all.
    from jaxserve.scheduler import slo as slo_mod
    buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

    def cost(tokens):
        return 0.005 + 0.001 * next(b for b in buckets if b >= tokens)

    if sizing == "token_cap_only":
        monkeypatch.setattr(slo_mod, "rows_within", lambda model, seconds: None)
    make_slo = None if sizing == "none" else (lambda: slo_mod.SloAdmission(None, buckets, 256, tpot_s=0.030))
    target = capacity.SimTarget(lambda: make_fake_engine(max_num_seqs=32, max_num_batched_tokens=256,
                                                         num_pages=512, token_buckets=buckets),
                                cost, make_slo)
    reqs = capacity.make_requests(fake_tokenizer(), [(8, 20)] * 32, seed=3)
    outcomes, duration, extras = target.run(reqs, [0.0] * 32)
    row = capacity.summarize(1.0, outcomes, duration, extras, capacity.SLO(ttft_s=60, tpot_s=0.030))
    assert row["completed"] == 32 and all(o.tokens == 20 for o in outcomes)
    if sizing == "full":
        # every step within the target: TPOT p99 <= 30 ms (bucket 16's 21 ms: the model, pessimistic
        # beyond what it measured, does not try bucket 24); the queue pays for it in TTFT
        assert row["tpot_s"]["p99"] <= 0.030 and row["slo_met"]
    else:
        assert row["tpot_s"]["p99"] == pytest.approx(0.037)  # 32 decodes a step: bucket 32
        assert not row["slo_met"]


def _compiled_report(kv_bytes_per_token: float = 0.0) -> dict:
    # v6e's 1640 GB/s: 1.64e9 bytes is 1 ms; the FLOPs are negligible at its 918 TFLOP/s.
    progs = [dict(name=f"step_T{t}", tokens=t, max_seqs=min(t, 4), flops=1e6,
                  bytes_accessed=1.64e9 * (1 if t < 8 else 2)) for t in (1, 2, 4, 8)]
    return dict(chip="v6e", topology="v6e:2x2", tp=1, programs=progs, kv_bytes_per_chip=1024 * kv_bytes_per_token,
                kv_tokens=1024, num_pages=64, page_size=16, max_num_seqs=4, max_model_len=256)


def test_compiled_step_cost_is_the_buckets_roofline_plus_the_kv_read():
    from jaxserve.aot.predict import CompiledStepCost
    cost = CompiledStepCost(_compiled_report(kv_bytes_per_token=1.64e6))  # 1 us of HBM per KV token
    assert cost(1) == pytest.approx(1e-3) and cost(3) == pytest.approx(1e-3)
    assert cost(5) == pytest.approx(2e-3)  # the 8-token bucket
    assert cost(1, kv_tokens=500) == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="larger than every compiled bucket"):
        cost(9)


def test_command_line_simulates_at_compiled_step_costs(tmp_path):
    import json
    import subprocess
    (tmp_path / "r.json").write_text(json.dumps(_compiled_report()))
    (tmp_path / "w.json").write_text(json.dumps({"requests": [{"prompt_tokens": 8, "output_tokens": 5}] * 3}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "capacity.py"), "--fake-model", "--simulate",
                           "--sim-compiled", str(tmp_path / "r.json"), "--workload", str(tmp_path / "w.json"),
                           "--rates", "0.5", "--trials", "1", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "1000",
                           "--plot", str(tmp_path / "c.png")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    (row,) = result["rows"]
    assert result["target"].startswith("PREDICTED") and row["completed"] == 3
    # Requests 2 s apart on average never overlap: each prefill is one 8-token step (2 ms),
    # each decode a 1-token step (1 ms), with no KV read in this report.
    assert row["ttft_s"]["p50"] == pytest.approx(2e-3) and row["tpot_s"]["p99"] == pytest.approx(1e-3)
