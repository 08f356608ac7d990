"""scripts/bench_offline.py on a 4-request slice prints a parseable RESULT line (natural-text
chat prompts, EOS respected, the step-roofline table; the cost model itself is checked in
test_step_roofline.py).

The HF half (--compare-hf) needs torch + transformers, which are not project dependencies; its
test runs with JAXSERVE_TEST_HF=1 and an interpreter that has them (JAXSERVE_HF_PYTHON, default
/work/goldens-venv/bin/python). It converts the GGUF and loads a second model: about a minute
on an idle 2-core machine, several on a busy one."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

HF_PYTHON = os.environ.get("JAXSERVE_HF_PYTHON", "/work/goldens-venv/bin/python")
# Four short requests shaped like shared/workloads/offline-mixed-48.json (its real ones take
# minutes here), and a fifth that --max-requests leaves out.
REQUESTS = [{"prompt_tokens": p, "output_tokens": o}
            for p, o in [(20, 6), (7, 9), (33, 3), (12, 5), (900, 900)]]
SMALL_ENGINE = ["--max-model-len", "256", "--num-pages", "32", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "32", "--token-buckets", "32", "--compilation-cache-dir", "none"]


def run_bench(tmp_path, *extra) -> dict:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"name": "tiny", "requests": REQUESTS}))
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_offline.py"), str(path), "--max-requests", "4",
           "--no-progress", *SMALL_ENGINE, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), p.stdout[-2000:]
    return json.loads(last[len("RESULT "):])


def test_bench_offline_result_line(tmp_path):
    r = run_bench(tmp_path)
    assert r["prompts"] == "natural-text chat, EOS respected"
    # EOS respected: a request may end early, never past its output_tokens.
    assert r["requests"] == 4 and len(r["output_lengths"]) == 4
    assert all(1 <= n <= o for n, o in zip(r["output_lengths"], (6, 9, 3, 5)))
    assert r["useful_tokens"] == sum(r["output_lengths"])
    assert r["useful_tok_s"] > 0
    # The roofline table accounts for every step of the run, and only the real tokens.
    buckets = r["roofline"]["buckets"]
    assert sum(b["steps"] for b in buckets) == r["steps"]
    assert sum(b["tokens"] for b in buckets) == r["computed_tokens"] - r["padded_tokens"]
    assert all(b["bucket"] == 32 for b in buckets)  # the only bucket of SMALL_ENGINE
    assert r["roofline"]["peaks"]["gemm_gflops"] > 0 and r["roofline"]["peaks"]["read_gbs"] > 0
    assert 0 < r["roofline_fraction"] <= r["roofline"]["roofline_fraction_in_steps"]
    assert 0 <= r["padding_fraction"] < 1
    assert r["compiles_after_warmup"] == 0
    assert r["peak_rss_mib"] > 100
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(r[k]) == {"p50", "p95", "p99"} and r[k]["p50"] <= r[k]["p99"]
    assert "ratio_vs_hf" not in r


@pytest.mark.skipif(os.environ.get("JAXSERVE_TEST_HF") != "1", reason="slow; set JAXSERVE_TEST_HF=1")
def test_bench_offline_compare_hf(tmp_path):
    r = run_bench(tmp_path, "--compare-hf", "--hf-python", HF_PYTHON)
    assert r["hf_useful_tok_s"] > 0
    assert r["ratio_vs_hf"] == pytest.approx(r["useful_tok_s"] / r["hf_useful_tok_s"], rel=0.01)
    assert r["hf_first8_agree"] >= 0.75  # greedy on both sides (a near tie may flip one)


def test_compare_hf_fails_fast_without_transformers(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"requests": REQUESTS[:1]}))
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_offline.py"), str(path), "--compare-hf",
           "--hf-python", sys.executable]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode == 0:
        pytest.skip("this interpreter has transformers")
    assert "--compare-hf needs torch and transformers" in p.stderr
