"""scripts/generate_batch.py: JSONL in, JSONL out; invalid records become error records; a run
killed with SIGKILL and resumed answers every record exactly once; shards split a file.

One SmolLM2 engine (small buckets) serves the in-process runs; the SIGKILL test starts the
script itself in a subprocess on a tiny random model with a one-bucket engine so that it starts
quickly."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, drain, make_engine
from multiprocess import coordinator_address, run_job

import jaxserve
from jaxserve.batch_records import RECORD_KEYS
from jaxserve.types import SamplingParams

spec = importlib.util.spec_from_file_location("generate_batch", ROOT / "scripts" / "generate_batch.py")
gb = sys.modules["generate_batch"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gb)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# (record, expected error field or None); None as a record writes a blank line (not a record).
RECORDS = [
    ({"id": "a", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}, None),
    ({"id": "b", "messages": CHAT, "sampling": {"max_tokens": 10, "temperature": 0}}, None),
    ({"id": "c", "prompt_token_ids": [504, 3575, 282, 4649], "max_tokens": 5, "temperature": 0}, None),
    ({"id": "d", "prompt": "Once upon a time", "temperature": 0.8, "seed": 7, "max_tokens": 6}, None),
    ({"id": "e", "prompt": "", "max_tokens": 4}, "prompt"),
    ({"id": "f", "prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"id": "g", "prompt": "hi", "colour": "blue"}, "colour"),
    ({"prompt": "a record without an id"}, "id"),
    ({"id": "a", "prompt": "a duplicate id"}, "id"),
    (None, None),
    ({"id": "h", "prompt": "def fib(n):", "stop": ["\n"], "max_tokens": 8, "temperature": 0}, None),
    ({"id": "i", "prompt": "Roses are", "n": 2, "seed": 1, "temperature": 1.0, "max_tokens": 4}, None),
    ({"id": "j", "prompt_token_ids": [49152]}, "prompt_token_ids"),
    ({"id": "k", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"id": "l", "prompt": "hi", "sampling": {"top_p": 1.5}}, "top_p"),
    ({"id": "m", "prompt": "hi", "messages": CHAT}, "messages"),
    ({"id": "n", "prompt": "Hello", "logprobs": 2, "max_tokens": 3, "temperature": 0}, None),
    ({"id": 17, "prompt": "1, 2, 3,", "max_tokens": 6, "temperature": 0}, None),
    ({"id": "p", "prompt": "hi", "max_tokens": 600}, "max_tokens"),  # over max_model_len 512
    ({"id": "q", "prompt": 5}, "prompt"),
    ("not json", "id"),
    # No temperature: SamplingParams' 1.0, so a seed makes it reproducible (the reference's).
    ({"id": "r", "prompt": "The three primary colours are", "max_tokens": 6, "seed": 11}, None),
]
SMALL = dict(max_model_len=512, page_size=16, num_pages=160, max_num_seqs=8,
             max_num_batched_tokens=64, token_buckets=(8, 64))


def write_input(path: Path, records) -> dict[int, tuple]:
    """Write records one per line; returns {line: (record, expected error field)}."""
    by_line, lines = {}, []
    for n, (rec, field) in enumerate(records, 1):
        if rec is None:
            lines.append("")
            continue
        lines.append(rec if isinstance(rec, str) else json.dumps(rec))
        by_line[n] = (rec, field)
    path.write_text("\n".join(lines) + "\n")
    return by_line


def read_output(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def prompt_of(rec):
    if "prompt" in rec:
        return rec["prompt"]
    if "messages" in rec:
        return rec["messages"]
    return {"prompt_token_ids": rec["prompt_token_ids"]}


def params_of(rec):
    kw = {k: v for k, v in rec.items() if k not in RECORD_KEYS}
    kw.update(rec.get("sampling", {}))
    return SamplingParams(**kw)


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2.model, smollm2.tokenizer, smollm2.eos_token_ids, **SMALL)


@pytest.fixture(scope="module")
def reference(engine):
    """LLM.generate's outputs for the valid records (an LLM around the shared engine, so the
    model is not loaded twice), keyed by id."""
    llm = object.__new__(jaxserve.LLM)
    llm.engine = engine
    valid = [rec for rec, field in RECORDS if isinstance(rec, dict) and field is None]
    outs = llm.generate([prompt_of(r) for r in valid], [params_of(r) for r in valid], use_tqdm=False)
    return {r["id"]: o for r, o in zip(valid, outs)}


def check_against_reference(rec: dict, ref) -> None:
    assert rec["token_ids"] == ref.outputs[0].token_ids, rec["id"]
    assert rec["text"] == ref.outputs[0].text
    assert rec["finish_reason"] == ref.outputs[0].finish_reason
    assert rec["usage"] == {"prompt_tokens": len(ref.prompt_token_ids),
                            "completion_tokens": sum(len(c.token_ids) for c in ref.outputs)}
    if len(ref.outputs) > 1:
        assert [s["token_ids"] for s in rec["samples"]] == [c.token_ids for c in ref.outputs]


def test_end_to_end_with_invalid_records(engine, reference, tmp_path):
    by_line = write_input(tmp_path / "in.jsonl", RECORDS)
    s = gb.run(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    out = read_output(tmp_path / "out.jsonl")
    assert sorted(r["line"] for r in out) == sorted(by_line), "one output record per input record"
    assert (s.results, s.errors) == (9, 12)
    for r in out:
        rec, field = by_line[r["line"]]
        if field is None:
            assert "error" not in r, r
            assert r["id"] == rec["id"]
            check_against_reference(r, reference[rec["id"]])
            t = r["timings"]
            assert 0 <= t["queue_time"] <= t["ttft"] <= t["e2e"]
        else:
            assert r["error"]["field"] == field, r
            assert r["error"]["message"]
            assert r["id"] == (rec.get("id") if isinstance(rec, dict) else None)
    by_id = {r["id"]: r for r in out if "error" not in r}
    assert len(by_id["n"]["logprobs"]) == 3 and len(by_id["n"]["logprobs"][0]["top"]) == 2
    assert len(by_id["i"]["samples"]) == 2
    assert by_id["b"]["finish_reason"] == "stop"  # the chat turn ends on <|im_end|>
    assert engine.compiles_after_warmup == 0

    # A second run over a complete output file answers nothing again.
    again = gb.run(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert (again.resumed, again.results, again.errors) == (len(by_line), 0, 0)
    assert len(read_output(tmp_path / "out.jsonl")) == len(by_line)


def test_two_shards_cover_every_record_once(engine, reference, tmp_path):
    by_line = write_input(tmp_path / "in.jsonl", RECORDS)
    for k in range(2):
        gb.run(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", shard_index=k, num_shards=2,
               progress=False)
    shards = [read_output(tmp_path / f"out.shard-{k}-of-2.jsonl") for k in range(2)]
    assert not (tmp_path / "out.jsonl").exists()
    for k, recs in enumerate(shards):
        assert all((r["line"] - 1) % 2 == k for r in recs), "record on 0-based line i goes to shard i % 2"
    lines = [r["line"] for recs in shards for r in recs]
    assert sorted(lines) == sorted(by_line), "every record exactly once over both shards"
    # The duplicate "a" (line 9, shard 0) and its first occurrence (line 1, shard 0) are in one
    # shard here; the duplicate check still sees ids of the other shard's lines:
    ids = [r["id"] for recs in shards for r in recs if "error" not in r]
    assert len(ids) == len(set(ids)) == 9
    for r in (r for recs in shards for r in recs if "error" not in r):
        check_against_reference(r, reference[r["id"]])


def test_a_record_takes_sampling_params_defaults_so_no_temperature_samples():
    """The record format's documented rule (scripts/generate_batch.py): what a record leaves
    out is SamplingParams' default, so no "temperature" is vLLM's and OpenAI's 1.0, not greedy."""
    from jaxserve.batch_records import parse_sampling
    assert parse_sampling({"id": 1, "prompt": "x"}) == SamplingParams() and SamplingParams().temperature == 1.0
    assert parse_sampling({"id": 1, "prompt": "x", "sampling": {"temperature": 0}}).greedy


def test_duplicate_in_other_shard_is_still_a_duplicate(engine, tmp_path):
    recs = [({"id": "x", "prompt_token_ids": [1, 2], "max_tokens": 2}, None),
            ({"id": "x", "prompt_token_ids": [3, 4], "max_tokens": 2}, "id")]
    write_input(tmp_path / "in.jsonl", recs)
    gb.run(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", shard_index=1, num_shards=2,
           progress=False)
    (r,) = read_output(tmp_path / "out.shard-1-of-2.jsonl")
    assert (r["id"], r["line"], r["error"]["field"]) == ("x", 2, "id")


def test_sigkill_mid_run_then_resume_answers_every_id_once(tmp_path):
    """The script runs the tiny random model of tp_cases (byte tokenizer) in its subprocess, and
    the resume an engine on the same weights: what is tested is the output file's bookkeeping,
    which no model property touches, so SmolLM2's load and compile would be only cost."""
    from conftest import byte_tokenizer
    from tp_cases import tiny_tp_model, write_tiny_tp_folder
    model_dir = write_tiny_tp_folder(tmp_path / "model")
    n = 24
    # Outputs of 40-51 tokens through at most two rows a step: hundreds of steps, so the run is
    # still going when the first records have been written and the kill comes.
    lengths = [40 + (i * 7) % 12 for i in range(n)]
    recs = [({"id": f"r{i}", "prompt_token_ids": [10 + i, 100 + i, 200 + i],
              "max_tokens": lengths[i], "ignore_eos": True}, None) for i in range(n)]
    recs.insert(5, ({"id": "bad", "prompt": "hi", "top_k": -2}, "top_k"))
    write_input(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out.jsonl"
    engine_flags = ["--max-model-len", "256", "--num-pages", "64", "--max-num-seqs", "2",
                    "--max-num-batched-tokens", "8", "--token-buckets", "8"]
    cmd = [sys.executable, str(ROOT / "scripts" / "generate_batch.py"), str(tmp_path / "in.jsonl"),
           str(out), "--model", str(model_dir), "--no-progress", *engine_flags,
           "--compilation-cache-dir", "none", "--max-in-flight", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and sum('"token_ids"' in x for x in out.read_text().splitlines()) >= 2:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        log = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{log[-3000:]}"
    before = out.read_bytes()
    partial = read_output(out)
    assert 2 <= len([r for r in partial if "error" not in r]) < n, log[-3000:]

    # A crash in the middle of a write leaves a torn last line; the resume cuts it off.
    with open(out, "ab") as f:
        f.write(b'{"id": "r23", "line": 25, "text": "torn')
    engine = make_engine(tiny_tp_model(), byte_tokenizer(), max_model_len=256, num_pages=64,
                         max_num_seqs=8, max_num_batched_tokens=8, token_buckets=(8,))
    s = gb.run(engine, tmp_path / "in.jsonl", out, max_in_flight=8, progress=False)
    assert s.resumed == len(partial)
    assert out.read_bytes().startswith(before), "records written before the kill are kept as they were"
    final = read_output(out)
    ids = [r["id"] for r in final]
    assert sorted(ids) == sorted([f"r{i}" for i in range(n)] + ["bad"]), "each id exactly once"
    for r in final:
        if r["id"] == "bad":
            assert r["error"]["field"] == "top_k"
        else:
            assert len(r["token_ids"]) == lengths[int(r["id"][1:])] and r["finish_reason"] == "length"


def test_recover_output_rejects_a_corrupt_middle_line(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_bytes(b'{"id": "a", "line": 1, "text": ""}\nnot json\n{"id": "b", "line": 2, "text": ""}\n')
    with pytest.raises(SystemExit, match="line 2 is not valid JSON"):
        gb.recover_output(p)
    p.write_bytes(b'{"id": "a", "line": 1, "text": ""}\n{"id": null, "line": 3, "error": {"field": "id", '
                  b'"message": "x"}}\n{"id": "b", "li')
    done = gb.recover_output(p)
    assert done.ids == {'"a"'} and done.lines == {3}
    assert p.read_bytes().endswith(b'"x"}}\n')


def test_shard_output_names():
    assert gb.shard_output_path(Path("o.jsonl"), 0, 1) == Path("o.jsonl")
    assert gb.shard_output_path(Path("d/o.jsonl"), 2, 4) == Path("d/o.shard-2-of-4.jsonl")
    assert gb.shard_output_path(Path("o.out"), 1, 2) == Path("o.out.shard-1-of-2")


def test_two_processes_are_two_tensor_parallel_replicas(tmp_path):
    """Two processes joined by jax.distributed (two fake CPU devices each), `--tp 2`: each is a
    replica over its own two devices with its own half of the input, and together they give
    the single-device greedy tokens for every record."""

    import numpy as np
    from tp_cases import write_tiny_tp_folder

    from jaxserve import loading
    model_dir = write_tiny_tp_folder(tmp_path / "model")
    prompts = [np.random.default_rng(2).integers(0, 256, n).tolist() for n in (3, 17, 40, 9)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 6, "ignore_eos": True,
                                       "temperature": 0}) + "\n"
                           for i, p in enumerate(prompts)))
    lm = loading.load(model_dir)
    eng = make_engine(lm.model, lm.tokenizer, token_buckets=(8, 32))
    for i, p in enumerate(prompts):
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), request_id=str(i))
    drain(eng)
    want = {i: eng.pop_finished(str(i)).outputs[0].token_ids for i in range(len(prompts))}

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAXSERVE_COORDINATOR=coordinator_address(), JAXSERVE_NUM_PROCESSES="2")
    cmd = [sys.executable, str(ROOT / "scripts" / "generate_batch.py"), str(inp), str(tmp_path / "out.jsonl"),
           "--model", str(model_dir), "--tp", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
           "--token-buckets", "8,32", "--compilation-cache-dir", "none", "--no-progress"]
    run_job([cmd, cmd], [dict(env, JAXSERVE_PROCESS_ID=str(i)) for i in range(2)])
    got = {}
    for k in range(2):
        for line in (tmp_path / f"out.shard-{k}-of-2.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert rec["id"] % 2 == k  # record i belongs to shard i % 2
            got[rec["id"]] = rec["token_ids"]
    assert got == want


def test_a_record_stays_one_line_for_every_line_reader(tmp_path):
    """A byte-level model's text can hold U+0085, U+2028 or U+2029, which json.dumps leaves raw
    and str.splitlines splits on (a resume test once read a record as two torn lines): the
    writer escapes them, so any line reader sees one record a line, and the text round-trips."""
    text = "a\x85b\u2028c\u2029d\x1ce\x1ef ď 🎉"
    w = gb.Writer(tmp_path / "out.jsonl")
    w.write([{"id": "x", "text": text}, {"id": "y", "text": "plain"}])
    w.close()
    raw = (tmp_path / "out.jsonl").read_text(encoding="utf-8")
    lines = raw.splitlines()
    assert len(lines) == 2 and raw.count("\n") == 2
    assert [json.loads(x)["text"] for x in lines] == [text, "plain"]
    assert gb.recover_output(tmp_path / "out.jsonl").ids == {gb.id_key("x"), gb.id_key("y")}
