"""scripts/accelerator_check.py --smoke: the one-shot device check's harness on CPU (interpret
mode, tiny shapes), so the script an H200 run depends on is known to work before the run."""

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import accelerator_check  # noqa: E402


def test_smoke_runs_every_kind_and_writes_json_lines(tmp_path):
    out = tmp_path / "check.jsonl"
    records = accelerator_check.main(["--smoke", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == json.loads(json.dumps(records, default=str))  # written as they came, all of them
    kinds = {r["kind"] for r in records}
    assert kinds == {"env", "bandwidth", "attention", "qmatmul", "summary"}
    cases = [r for r in records if r["kind"] in ("attention", "qmatmul")]
    assert all(r["status"] == "pass" for r in cases), [(r["case"], r.get("error"), r.get("max_err")) for r in cases]
    for r in cases:  # a time and a bandwidth figure for the kernel and its baselines
        assert r["kernel_s"] > 0 and r["kernel_GBps"] > 0 and r["kernel_frac_read"] > 0
        assert r.get("xla_s", r.get("xla_dequant_s")) > 0
    assert records[-1] == {**records[-1], "pass": len(cases), "fail": 0, "error": 0}


def test_a_failing_case_is_recorded_and_the_run_goes_on(tmp_path):
    rec = accelerator_check.Recorder(tmp_path / "r.jsonl", budget_s=60)
    bad = rec.case("attention", "boom", lambda: 1 / 0)
    good = rec.case("attention", "fine", lambda: {"status": "pass"})
    assert bad["status"] == "error" and "ZeroDivisionError" in bad["error"]
    assert good["status"] == "pass"
    skipped = accelerator_check.Recorder(None, budget_s=0).case("qmatmul", "late", lambda: {"status": "pass"})
    assert skipped["status"] == "skipped"
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
