"""scripts/bench_serving.py end to end on the fake model, over both protocols: its in-process
server is built by serve's own build_engine, so a flag that build_engine reads but the script's
parser lacks fails here (it did: --scheduling-policy, and --quantize before it)."""

import importlib.util
import json
import sys

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "scripts" / "bench_serving.py")
bench = sys.modules["bench_serving"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_fake_model_run_completes_every_request(backend, tmp_path, capsys):
    workload = tmp_path / "w.json"  # its own shapes: the test needs no ../shared beside the checkout
    workload.write_text(json.dumps({"name": "tiny", "requests": [
        {"prompt_tokens": 10 + 7 * i, "output_tokens": 8} for i in range(6)]}))
    assert bench.main(["--fake-model", "--backend", backend, "--workload", str(workload), "--rates", "50",
                       "--max-output-tokens", "8", "--plot", str(tmp_path / "p.png")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1].removeprefix("RESULT "))
    (row,) = result["rates"]
    assert (row["completed"], row["rejected"], row["wrong_length"]) == (6, 0, 0)
    assert result["backend"] == backend and (tmp_path / "p.png").exists()
