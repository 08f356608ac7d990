"""jaxserve on Ray Data, on a real local Ray cluster: a head and a second worker node started with
`ray start` on loopback (bounded in time, torn down), two engine actors on the tiny model.

- `generate_batch.py --ray` gives the same records as `generate_batch.py` alone (JSONL in and
  out, and Parquet in and out), exactly one row per input id, invalid rows as error rows;
- an engine actor killed by its pid mid-run is restarted by Ray, its rows are re-run, and the
  output is still exactly one row per id with the same greedy tokens.

These run in their own venv (`make test-ray`): Ray stays out of the base install.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="the Ray tests run in `make test-ray`'s venv")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from multiprocess import free_port  # noqa: E402
from tp_cases import write_tiny_tp_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "generate_batch.py"
CLUSTER_START_S = 120
JOB_S = 420


def _ray(*args, env, timeout=CLUSTER_START_S):
    return subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, timeout=timeout,
                          check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and one more worker node, 2 logical CPUs each (an actor reserves 1, Ray's read and
    write tasks take the rest), on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("ray")
    # RAY_AUTH_MODE: a loopback cluster of this test's own; with a token file left in ~/.ray by
    # another Ray the head turns token auth on and the second node cannot join without it.
    env = dict(os.environ, RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    address = f"127.0.0.1:{free_port()}"
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"]
    try:
        _ray("start", "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false",
             f"--temp-dir={tmp}", *common, env=env)
        _ray("start", f"--address={address}", *common, env=env)
        yield address, env
    finally:
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=env,
                       timeout=CLUSTER_START_S, capture_output=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_tp_folder(folder)
    return folder


def _records(n=14):
    recs = [{"id": f"r{i}", "prompt": f"row {i}: the quick brown fox " * (1 + i % 3), "max_tokens": 6 + i % 5,
             "temperature": 0} for i in range(n)]
    recs.append({"id": 99, "prompt": "an integer id", "max_tokens": 4, "temperature": 0})
    recs.append({"id": "bad-max", "prompt": "x", "max_tokens": -1})
    recs.append({"id": "bad-both", "prompt": "x", "prompt_token_ids": [1, 2]})
    recs.append({"prompt": "no id at all"})
    return recs


def _engine_flags(model):
    # One compilation cache for every engine of the module: the actors after the first load
    # from it instead of compiling again.
    return ["--model", str(model), "--max-num-seqs", "8", "--compilation-cache-dir", str(model.parent / "xla")]


def _normalize(rec: dict) -> dict:
    """A record as both paths must agree on it: no "line" (rows have none), id as a string,
    nulls dropped (every Arrow column is in every row), timings dropped (wall clock)."""
    out = {k: v for k, v in rec.items() if v is not None and k not in ("line", "timings")}
    if "id" in out:
        out["id"] = str(out["id"])
    return out


def _key(rec: dict):
    return (rec.get("id") or "", json.dumps(rec, sort_keys=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    """generate_batch.py alone (no Ray) on the same input: the records Ray must reproduce."""
    tmp = tmp_path_factory.mktemp("ref")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records()) + "\n")  # a blank line: no record
    out = tmp / "out.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), str(src), str(out), *_engine_flags(model)],
                   check=True, timeout=JOB_S, capture_output=True)
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    return src, sorted((_normalize(r) for r in recs), key=_key)


def _run_ray(cluster, model, src, dst, tmp):
    address, env = cluster
    proc = subprocess.run([sys.executable, str(SCRIPT), str(src), str(dst), *_engine_flags(model),
                           "--ray", address, "--ray-actors", "2", "--ray-batch-size", "3"],
                          env=env, timeout=JOB_S, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def _read_json_dir(d: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(d.iterdir()) for line in f.read_text().splitlines() if line]


def test_jsonl_through_ray_equals_generate_batch(cluster, model, reference, tmp_path):
    src, want = reference
    log = _run_ray(cluster, model, src, tmp_path / "out.jsonl", tmp_path)
    got = _read_json_dir(tmp_path / "out.jsonl")
    assert len(got) == len(want)
    ids = [r["id"] for r in got if r["id"] is not None]
    assert len(ids) == len(set(ids)), "an id came out twice"
    assert sorted((_normalize(r) for r in got), key=_key) == want
    errors = {r["id"]: r["error"]["field"] for r in got if r["error"] is not None}
    assert errors == {"bad-max": "max_tokens", "bad-both": "prompt_token_ids", None: "id"}
    assert "generate_batch --ray" in log and "(3 errors)" in log, log[-2000:]  # the summary line
    # The generation window (first batch taken to last returned) lies inside the job's time.
    m = re.search(r"tokens in ([\d.]+) s .*; generating ([\d.]+) s", log)
    assert m, log[-2000:]
    assert 0 < float(m.group(2)) <= float(m.group(1))


def test_parquet_through_ray_equals_generate_batch(cluster, model, reference, tmp_path):
    _, want = reference
    recs = [r for r in _records() if "id" in r]  # a Parquet row without id: a null id, tested below
    recs.append({"id": None, "prompt": "null id"})
    for r in recs:
        r["id"] = None if r["id"] is None else str(r["id"])
    src = tmp_path / "in.parquet"
    columns = sorted({k for r in recs for k in r})  # from_pylist would take the first row's keys only
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in recs]), src)
    _run_ray(cluster, model, src, tmp_path / "out", tmp_path)
    got = pq.read_table(tmp_path / "out").to_pylist()
    assert len(got) == len(recs)
    # A null is a field not given, so the null id is "missing" as in the JSONL record without one.
    assert sorted((_normalize(r) for r in got), key=_key) == want


def test_killed_actor_rows_rerun_exactly_once(cluster, model, reference, tmp_path):
    """SIGKILL one engine actor after the first rows came out; Ray restarts it and re-runs its
    tasks, and the output still has every id once with generate_batch's tokens."""
    import jaxserve.ray
    import ray.data

    _, want = reference
    want_tokens = {r["id"]: r["token_ids"] for r in want if "token_ids" in r}
    address, env = cluster
    os.environ.update({k: env[k] for k in ("RAY_TMPDIR", "RAY_AUTH_MODE")})
    ray.init(address=address, log_to_driver=False)
    try:
        # Enough rows (tens of seconds of steps) that the actor killed at the first output row
        # still holds unfinished tasks.
        rows = [dict(r, id=f"{r['id']}-{k}") for k in range(24) for r in _records()
                if str(r.get("id")) in want_tokens]
        proc = jaxserve.ray.Processor(model=str(model), max_num_seqs=8, concurrency=2, batch_size=3,
                                      compilation_cache_dir=str(model.parent / "xla"))
        out = proc(ray.data.from_items(rows, override_num_blocks=12))
        got, killed = [], None
        deadline = time.monotonic() + JOB_S
        for row in out.iter_rows():
            got.append(row)
            assert time.monotonic() < deadline, "the job did not finish in time"
            if killed is None:  # the actor that ran this row's batch: it is running, with more queued
                busy = [a for a in proc.summary().values() if a["rows"] > 0]
                if busy:
                    killed, rows_when_killed = busy[0]["pid"], len(got)
                    os.kill(killed, signal.SIGKILL)
        assert killed is not None, "no actor reported rows; nothing was killed"
        assert rows_when_killed < len(rows)
        ids = [r["id"] for r in got]
        assert sorted(ids) == sorted(r["id"] for r in rows), "a row was lost or came out twice"
        for r in got:
            assert r["error"] is None, r
            assert r["token_ids"] == want_tokens[r["id"].rsplit("-", 1)[0]], r["id"]
        print(f"killed pid {killed} after {rows_when_killed} of {len(rows)} rows; actors seen: "
              f"{sorted((a['pid'], a['rows']) for a in proc.summary().values())}")
    finally:
        ray.shutdown()
