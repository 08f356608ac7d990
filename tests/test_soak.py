"""A 60-second soak of a real `jaxserve serve` subprocess (scripts/soak.py) in the suite.

The fake model: what a soak checks is the server's bookkeeping under mixed valid, invalid,
cancelled, deadline, disconnected and killed requests (nothing lost, gauges back to 0, memory
flat, no INTERNAL), which is the same code with any model; the fake one steps in 5 ms of sleep,
so the minute costs about a third of one core instead of two busy cores. The 10-minute soak on
SmolLM2 is run by hand (`python scripts/soak.py --duration 600`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_60_second_soak_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "scripts/soak.py", "--fake-model", "--duration", "60", "--clients", "4",
                        "--pause", "0.02", "--kill-every", "15", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["ok"] and all(s["checks"].values()), s["checks"]
    # Every kind of load really ran, and the server saw each way a request ends.
    assert set(s["codes"]) == {"stream", "unary", "jetstream", "invalid", "cancel", "deadline", "disconnect",
                               "tokenize", "killed"}, s["codes"]
    assert s["codes"]["invalid"] == {"INVALID_ARGUMENT": sum(s["codes"]["invalid"].values())}
    assert {"ok", "cancelled", "deadline_exceeded"} <= set(s["server_outcomes"]), s["server_outcomes"]
    assert s["requests"] > 300
    assert s["final_gauges"]["kv_pages_used"] == 0 and s["final_gauges"]["num_requests_running"] == 0
