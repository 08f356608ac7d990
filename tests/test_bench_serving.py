"""scripts/bench_serving.py end to end on the fake model, over both protocols: its in-process
server is built by serve's own build_engine, so a flag that build_engine reads but the script's
parser lacks fails here (it did: --scheduling-policy, and --quantize before it). Run as the
user runs it, in a subprocess: its in-process servers' threads and uvicorn stay out of the test
worker. Natural-text prompts by default, none repeated across rates (the prefix cache would
answer a repeat)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_fake_model_run_completes_every_request(backend, tmp_path):
    workload = tmp_path / "w.json"  # its own shapes: the test needs no ../shared beside the checkout
    workload.write_text(json.dumps({"name": "tiny", "requests": [
        {"prompt_tokens": 10 + 7 * i, "output_tokens": 8} for i in range(6)]}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--fake-model",
                           "--backend", backend, "--workload", str(workload), "--rates", "50,60",
                           "--max-output-tokens", "8", "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["backend"] == backend and (tmp_path / "p.png").exists()
    assert result["prompts"].startswith("natural text")
    for row in result["rates"]:
        assert (row["completed"], row["rejected"], row["wrong_length"]) == (6, 0, 0)
        # natural text, every prompt distinct within and across the two rates: the prefix cache
        # (on by default) answers none (the same prompts at both rates, as before: 112 at the second)
        assert row["prefix_cache_hit_tokens"] == 0, row
