"""The schema the HTTP door publishes (/openapi.json), swept by schemathesis against a real server
on the fake model: every operation, every check (`st run --checks all`, as a user would run it).

The checks say the schema tells the truth both ways: no 5xx and no response slower than the
limit; each status, media type (JSON, SSE, text), header and body documented; the requests it
admits accepted (positive_data_acceptance) and the ones it refuses refused
(negative_data_rejection), methods it does not list answered 405, a missing token 401. The one
check replaced, positive_data_acceptance, passes only the 400s of the rules JSON Schema cannot
state (tests/openapi_sweep_hooks.py lists them). Afterwards the server is still ready and serves.

A fixed seed and a bounded number of examples per operation keep it reproducible and ~1 min.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from jaxserve.server.fake_engine import fake_generate, fake_tokenizer
from test_server_support import MODEL, TOKEN, base_url, http_server, metric

HOOKS = Path(__file__).with_name("openapi_sweep_hooks.py")
MAX_EXAMPLES = 25  # per operation and phase; the coverage phase adds ~1,000 boundary cases


def sweep(url: str, tmp: Path, max_examples: int, *extra: str) -> tuple[dict, Counter, str]:
    """`st run` on url's schema: (its JSON report, the tally of RULES passes, its output)."""
    report, tally = tmp / "report.json", tmp / "tally.txt"
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
           # all checks; positive_data_acceptance as the hooks' variant (named RULES only)
           "--checks", "all", "--exclude-checks", "positive_data_acceptance",
           "--max-examples", str(max_examples), "--seed", "1", "--generation-database", "none",
           "--request-timeout", "30", "--max-response-time", "20",  # no hang, no slow answer (2 busy cores)
           "--output-sanitize", "false", "--no-color", "--report", "json", "--report-json-path", str(report),
           *extra]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "SWEEP_TALLY": str(tally)}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-12_000:]
    passes = Counter(tally.read_text().split("\n")[:-1]) if tally.exists() else Counter()
    return json.loads(report.read_text()), passes, out


def test_the_schema_states_this_servers_facts_and_no_422():
    with http_server(server={"auth_token": TOKEN}) as s:
        auth = {"authorization": f"Bearer {TOKEN}"}
        doc = httpx.get(base_url(s) + "/openapi.json", headers=auth).json()
        vocab = s.server.frontend.vocab_size
    schemas, paths = doc["components"]["schemas"], doc["paths"]
    assert "HTTPValidationError" not in schemas and "x-jaxserve-served" not in json.dumps(doc)
    req = schemas["CompletionRequest"]["properties"]
    assert req["model"]["enum"] == [MODEL]
    assert req["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1
    assert req["max_tokens"]["maximum"] == 255  # max_model_len 256 less a prompt token
    assert schemas["ErrorResponse"]["properties"]["error"]["$ref"] == "#/components/schemas/ErrorDetail"
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    for path, ops in paths.items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            guarded = path not in ("/health", "/ready", "/live", "/metrics")
            assert ("401" in op["responses"]) == guarded == ("security" in op), (method, path)
    gen = paths["/v1/completions"]["post"]["responses"]
    assert set(gen["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404", "413", "429", "500", "503"} <= set(gen)
    assert set(paths["/health"]) == {"get", "head"} and set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"])[0].startswith("text/plain; version=")
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "bearer"])
def test_schemathesis_sweep_finds_nothing_and_the_server_still_serves(tmp_path, token):
    with http_server(server={"auth_token": token}) as s:
        b = base_url(s)
        # With a token, the fuzzing phase only (its bodies' coverage phase is the open sweep's):
        # every operation with and without the token (ignored_auth), and with a wrong one.
        headers = ("-H", f"Authorization: Bearer {token}", "--phases", "fuzzing") if token else ()
        report, passes, out = sweep(b, tmp_path, MAX_EXAMPLES, *headers)
        cases = report["test_cases"]
        print(f"\nschemathesis {report['schemathesis_version']}: {cases['generated']} cases in "
              f"{report['running_time']:.1f} s; ST202 passes by rule: {dict(passes)}")
        assert report["complete"] and not report["failures"] and not report["errors"], out[-12_000:]
        assert cases["with_failures"] == 0 and cases["errored"] == 0
        ops = report["operations"]
        assert ops["tested"] == ops["selected"] == ops["total"] == 12, ops  # nothing left out
        # The fuzzer got past the refusals: each POST had requests accepted, not only refused.
        for op, rates in report["valid_rates"].items():
            if op.startswith("POST"):
                assert sum(r["accepted"] for r in rates.values()) > 0, (op, rates)
        assert cases["generated"] > (100 if token else 1000)
        # The server's own count: requests refused as malformed, missing tokens refused (the
        # ignored_auth check, with a token), and completions that ran to their end.
        scrape = httpx.get(b + "/metrics").text
        assert metric(s, "jaxserve_rejected_requests_total", '{reason="invalid_argument"}', scrape) > 0
        assert (metric(s, "jaxserve_rejected_requests_total", '{reason="unauthenticated"}', scrape) > 0) == bool(token)
        assert metric(s, "jaxserve_finished_requests_total", '{outcome="ok"}', scrape) > 20

        auth = {"authorization": f"Bearer {token}"} if token else {}
        assert httpx.get(b + "/health").status_code == 200
        r = httpx.post(b + "/v1/completions", headers=auth, timeout=30,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "seed": 3})
        assert r.status_code == 200, r.text
        tok = fake_tokenizer()
        assert r.json()["choices"][0]["text"] == tok.decode(fake_generate(tok.encode("Hello"), 8, seed=3)[0])
