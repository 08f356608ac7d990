"""A prefill process for tests/test_kv_transfer.py: the tiny model's engine with every request
handed over after its first token, its KV offered on this process's transfer server. Prints
one JSON line per event: {"address"} first, then {"delta"} for each of its stream deltas and
{"handover", "uuid"} per handover (the wire bytes as text); requests named in --drop are
handed over but their KV is never offered (a dropped transfer). Exits when stdin closes."""

from __future__ import annotations

import argparse
import json
import sys

import checkpoints
from conftest import ROOT, byte_tokenizer, make_engine

from jaxserve.disagg import wire
from jaxserve.disagg.kv_transfer import KVTransfer
from jaxserve.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True, help="JSON list of [prompt ids, SamplingParams dict]")
    ap.add_argument("--shape", required=True, help="JSON engine config")
    ap.add_argument("--drop", default="")
    args = ap.parse_args()
    model, loaded = checkpoints.load_model(ROOT / "tests" / "data" / "llama_mqa", "float32")
    eng = make_engine(model, byte_tokenizer(loaded.config.eos_token_ids), handover=True, **json.loads(args.shape))
    xfer = KVTransfer()
    print(json.dumps({"address": xfer.address}), flush=True)
    drop = set(filter(None, args.drop.split(",")))
    for i, (prompt, params) in enumerate(json.loads(args.work)):
        eng.add_request({"prompt_token_ids": prompt}, SamplingParams(**params), request_id=str(i), hand_over=True)
    uuid = 1000
    while eng.has_unfinished():
        for d in eng.step():
            print(json.dumps({"delta": [d.request_id, d.index, list(d.token_ids), d.text, d.finished,
                                        d.finish_reason]}), flush=True)
        for rid in list(eng.handovers):
            h, data = eng.pop_handover(rid)
            uuid += 1
            if rid not in drop:
                xfer.offer(uuid, data, timeout_s=120)
            print(json.dumps({"handover": wire.to_json(h).decode(), "uuid": uuid}), flush=True)
    eng.scheduler.check_idle_invariant()
    print(json.dumps({"done": True}), flush=True)
    sys.stdin.read()  # the offers live as long as this process: until the test has pulled


if __name__ == "__main__":
    main()
