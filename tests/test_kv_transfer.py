"""KV pages moved between two processes (jaxserve/disagg/kv_transfer.py over
jax.experimental.transfer, the handover as JSON by jaxserve/disagg/wire.py): a prefill process
(tests/handover_prefill_worker.py) hands every request over after its first token; this
process pulls the pages into its own decode engine and decodes. The joined streams must equal a
colocated engine's in this process, exactly (test_handover.py says why); a transfer whose KV
never comes fails only its own request, with a message naming the transfer, and leaves the
decode engine's pool with no page held. The wire format refuses a malformed message by field."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import checkpoints
import pytest
from conftest import ROOT, byte_tokenizer, make_engine
from test_handover import SHAPE, _collect, _new_streams, colocated, workload

from jaxserve.disagg import wire
from jaxserve.disagg.kv_transfer import KVTransfer, TransferTimeout
from jaxserve.types import InvalidRequestError


def _prefill_process(work, drop=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    cmd = [sys.executable, str(ROOT / "tests" / "handover_prefill_worker.py"),
           "--work", json.dumps([[p, dataclasses.asdict(sp)] for p, sp in work]),
           "--shape", json.dumps(SHAPE), "--drop", ",".join(drop)]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _disaggregated_over_processes(d, work, drop=(), drop_timeout_s=60.0):
    """Decode engine `d` here, prefill in a subprocess: pull each handover's KV, import it,
    decode everything. A pull that times out ends its request as failed (recorded). The pulls
    of `drop`'s requests wait drop_timeout_s, the others 60 s (a loaded machine may take more
    than a short timeout to move even KBs over loopback)."""
    proc = _prefill_process(work, drop)
    streams, failed = _new_streams(), {}
    xfer = KVTransfer()
    try:
        address = json.loads(proc.stdout.readline())["address"]
        for line in proc.stdout:
            msg = json.loads(line)
            if "done" in msg:
                break
            if "delta" in msg:
                rid, idx, ids, text, fin, reason = msg["delta"]
                _collect(streams, [type("D", (), dict(request_id=rid, index=idx, token_ids=ids, text=text,
                                                      finished=fin, finish_reason=reason))])
                continue
            h = wire.from_json(msg["handover"].encode())
            pull = xfer.pull(address, msg["uuid"], d.runner.page_specs(h.full_pages, h.sliding_pages))
            try:
                data = pull.wait(drop_timeout_s if h.request_id in drop else 60.0)
            except TransferTimeout as e:
                failed[h.request_id] = str(e)
                continue
            d.import_request(h, data)
            _collect(streams, d.step())
        while d.has_unfinished():
            _collect(streams, d.step())
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert proc.returncode == 0
    return dict(streams), failed


@pytest.fixture(scope="module")
def tiny():
    model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", "float32")
    return model, byte_tokenizer(loaded.config.eos_token_ids)


def test_kv_pages_moved_between_processes_decode_as_colocated(tiny):
    model, tok = tiny
    work = workload(5)
    want = colocated(make_engine(model, tok, **SHAPE), work)
    d = make_engine(model, tok, handover=True, **SHAPE)
    got, failed = _disaggregated_over_processes(d, work)
    assert not failed
    assert got == want
    d.scheduler.check_idle_invariant()


def test_a_dropped_transfer_fails_its_request_alone(tiny):
    model, tok = tiny
    work = workload(6)
    want = colocated(make_engine(model, tok, **SHAPE), work)
    d = make_engine(model, tok, handover=True, **SHAPE)
    got, failed = _disaggregated_over_processes(d, work, drop=("2",), drop_timeout_s=3.0)
    assert list(failed) == ["2"] and "did not arrive within 3 s" in failed["2"]
    for key, stream in want.items():
        if key[0] != "2":
            assert got[key] == stream, key
    d.scheduler.check_idle_invariant()


def test_the_wire_format_refuses_a_malformed_handover_by_field():
    with pytest.raises(InvalidRequestError, match="handover.version"):
        wire.from_json(b'{"version": 99}')
    with pytest.raises(InvalidRequestError, match="handover"):
        wire.from_json(b'{"version": 1, "params": {"max_tokens": 4}}')
    with pytest.raises(InvalidRequestError, match="temperature"):
        wire.from_json(json.dumps({"version": 1, "params": {"temperature": -1}}).encode())


def test_a_handover_round_trips_through_the_wire_format_with_its_prompt_logprobs():
    """Every field comes back as sent; prompt logprobs too (the first prompt token has none),
    which the decode engine reports as its own (engine/handover.py)."""
    from jaxserve.engine.handover import HandedSample, Handover
    from jaxserve.scheduler.handover import HeldTable
    from jaxserve.types import SamplingParams, TokenLogprob
    sample = HandedSample(HeldTable(0, (7,), 3, 0, (4, 5), 0, ()), 11, [7], "x", 1,
                          [TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.25)])])
    h = Handover("s1", None, [3, 4, 5], SamplingParams(max_tokens=4, logprobs=1, prompt_logprobs=1), 11, 0,
                 "anonymous", [sample], "layout", 2, 96,
                 [None, TokenLogprob(4, -2.0, [(4, -2.0)]), TokenLogprob(5, -0.25, [(6, -0.125)])])
    assert wire.from_json(wire.to_json(h)) == h
