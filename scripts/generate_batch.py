"""Batch generation: JSONL of requests in, JSONL of results out; resumable and shardable.

  python scripts/generate_batch.py IN.jsonl OUT.jsonl [--num-shards N --shard-index K]
      [--max-in-flight M] [--model PATH] [--dtype float32|bfloat16]
      [--quantize none|int8|int4|as-shipped] [--max-num-seqs 64] ...
  python scripts/generate_batch.py IN.jsonl|IN.parquet OUT_DIR --ray [ADDRESS] [--ray-actors N] ...

Input: one JSON object per line (blank lines are skipped, they are not records):
  {"id": "q1", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0.7, "seed": 1}
  {"id": "q2", "messages": [{"role": "user", "content": "Hi"}], "sampling": {"max_tokens": 32}}
  {"id": "q3", "prompt_token_ids": [1, 2, 3]}
"id" is a non-empty string or an integer. Exactly one of "prompt" (a string), "messages" (chat
messages, rendered by the model's chat template) or "prompt_token_ids". Sampling parameters go by
jaxserve.SamplingParams field names, top level or under "sampling" (not both for one name), and
take SamplingParams' defaults: a record without "temperature" samples at 1.0 (vLLM's and
OpenAI's default), so give "temperature": 0 for greedy output and a "seed" for a sample that a
rerun reproduces.

Output: one JSON object per input record, in completion order, every one with "line" (the
input line number, 1-based):
  {"id", "line", "text", "token_ids", "finish_reason", "usage": {...}, "timings": {...}}
  (plus "logprobs" when asked for, and "samples" with every sample when n > 1)
  {"id", "line", "error": {"field", "message"}}        an invalid record, never dropped
A record without a usable id gets an error record with "id": null; the second and later records
with an id already seen in the file get an error record (field "id") keyed by their line, so
every result record's id is unique.

Resuming: on start the output file is read back; a torn last line (a crash mid-write) is cut
off, and every record already answered is skipped (results and errors by id, "id"-field errors
by line). Each finished request's line is written as soon as it finishes, flushed and fsync'd
(one fsync per engine step), so a SIGKILL loses only requests still in flight, and a rerun
produces exactly one output record per input record.

Ray Data (--ray; `pip install 'jaxserve[ray]'`): the same records read and written by Ray, JSONL or
Parquet (columns named as the fields above, nulls meaning "not given"), through --ray-actors
engine actors; OUTPUT is a new directory of JSONL or Parquet files. Its rows differ from the
JSONL records above in what a columnar, distributed dataset forces (no "line", "id" a string,
every field in every row): jaxserve/ray/rows.py says how, jaxserve/ray/processor.py what Ray's
retries guarantee (exactly one row per input row when an actor dies).

Memory: at most --max-in-flight requests (default 4 x max_num_seqs) are inside the engine at a
time; the input is read lazily. Each process keeps the set of ids it has seen (duplicate check).

Sharding: record on 0-based line i belongs to shard i % N. --num-shards / --shard-index default
to jax.process_count() / jax.process_index(); the script first calls
sharding.mesh.initialize_distributed(), which joins the hosts when JAXSERVE_COORDINATOR /
JAXSERVE_NUM_PROCESSES / JAXSERVE_PROCESS_ID are set (otherwise a process counts 1). With N > 1
shard K writes OUT.shard-K-of-N.jsonl. Every shard reads the whole file, so "the first
occurrence of an id wins" means the same in every shard. One run at a time per output file
(an flock on it).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.batch_records import (RecordError, Work, error_record, field_message, id_key,  # noqa: E402
                                    is_line_keyed, parse_prompt, parse_sampling, result_record, unusable_id_message,
                                    usable_id)
from jaxserve import flags  # noqa: E402
from jaxserve.ray.batch_job import add_ray_flags  # noqa: E402  (no ray import until --ray runs)
from jaxserve.types import InvalidRequestError  # noqa: E402

FLUSH_ERRORS_EVERY = 1024  # error records buffered while feeding, before one write + fsync


# ---- input scan -----------------------------------------------------------------------------

@dataclasses.dataclass
class Done:
    """What the output file already answers."""

    ids: set[str] = dataclasses.field(default_factory=set)  # id_key of answered ids
    lines: set[int] = dataclasses.field(default_factory=set)  # lines of line-keyed errors

    def __len__(self) -> int:
        return len(self.ids) + len(self.lines)


def scan(input_path: Path, shard_index: int, num_shards: int, done: Done) -> Iterator[Work | dict]:
    """Yield this shard's unanswered records in file order: Work to run, or an error record."""
    seen: set[str] = set()  # ids of every line of the file, so duplicates agree across shards
    with open(input_path, "rb") as f:
        for i, raw in enumerate(f):
            line = i + 1
            mine = i % num_shards == shard_index
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if mine and line not in done.lines:
                    yield error_record(None, line, "id", f"line is not valid JSON (UTF-8): {e}")
                continue
            rid = usable_id(rec)
            if rid is None:
                if mine and line not in done.lines:
                    yield error_record(None, line, "id", unusable_id_message(rec))
                continue
            key = id_key(rid)
            if key in seen:
                if mine and line not in done.lines:
                    yield error_record(rid, line, "id", f"duplicate id {rid!r:.80}: an earlier line has it")
                continue
            seen.add(key)
            if not mine or key in done.ids:
                continue
            try:
                yield Work(line, rid, parse_prompt(rec), parse_sampling(rec))
            except RecordError as e:
                yield error_record(rid, line, e.field, e.message)


def count_shard_records(input_path: Path, shard_index: int, num_shards: int) -> int:
    with open(input_path, "rb") as f:
        return sum(1 for i, raw in enumerate(f) if i % num_shards == shard_index and raw.strip())


# ---- output -------------------------------------------------------------------------------

def shard_output_path(out: Path, shard_index: int, num_shards: int) -> Path:
    if num_shards == 1:
        return out
    tag = f".shard-{shard_index}-of-{num_shards}"
    if out.suffix == ".jsonl":
        return out.with_name(out.stem + tag + ".jsonl")
    return out.with_name(out.name + tag)


def recover_output(path: Path) -> Done:
    """Read back an existing output file; cut a torn last line; return what it answers."""
    done = Done()
    if not path.exists():
        return done
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
        if end < len(data):
            print(f"generate_batch: cutting a torn last line ({len(data) - end} bytes) from {path}",
                  file=sys.stderr)
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    for n, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SystemExit(f"generate_batch: {path} line {n} is not valid JSON ({e}); only the last "
                             f"line can be torn by a crash, so this file was edited or is not ours") from None
        if is_line_keyed(rec):
            done.lines.add(int(rec["line"]))
        else:
            done.ids.add(id_key(rec["id"]))
    return done


class Writer:
    """Appends records; every write is flushed and fsync'd before it returns."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        self.f = open(path, "ab")
        try:  # two runs appending to one file would answer records twice
            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.close()
            raise SystemExit(f"generate_batch: {path} is locked by another running generate_batch") from None
        if new:  # make the new file's directory entry durable too
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        self.f.write(b"".join(_dumps(r) + b"\n" for r in records))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


# Characters Python's str.splitlines (and other line readers) split on that json.dumps leaves raw
# in strings when ensure_ascii is off; the model's text can hold them (a byte-level model
# writes any byte), so they are escaped and a record stays one line for every reader, not only
# for those that split on "\n" (this script's own recover_output).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(rec: dict) -> bytes:
    try:
        return json.dumps(rec, ensure_ascii=False).translate(_LINE_BREAKS).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a "\ud800" escape in the input
        return json.dumps(rec, ensure_ascii=True).encode("ascii")


# ---- the run --------------------------------------------------------------------------------

@dataclasses.dataclass
class Summary:
    output: Path
    resumed: int = 0  # records already in the output file at start
    results: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run(engine, input_path: str | Path, output_path: str | Path, shard_index: int = 0,
        num_shards: int = 1, max_in_flight: int | None = None, progress: bool = True) -> Summary:
    """Answer every unanswered record of this shard of `input_path` with `engine` (an idle
    jaxserve Engine). Returns counts; the output file is the result."""
    from tqdm import tqdm

    if not (isinstance(num_shards, int) and num_shards >= 1 and 0 <= shard_index < num_shards):
        raise ValueError(f"need 0 <= shard_index < num_shards, got {shard_index} of {num_shards}")
    input_path = Path(input_path)
    out_path = shard_output_path(Path(output_path), shard_index, num_shards)
    max_in_flight = max_in_flight or 4 * engine.scheduler_config.max_num_seqs
    writer = Writer(out_path)  # takes the file's lock before reading it back
    try:
        done = recover_output(out_path)
    except BaseException:
        writer.close()
        raise
    summary = Summary(out_path, resumed=len(done))
    total = count_shard_records(input_path, shard_index, num_shards)
    in_flight: dict[str, Work] = {}
    todo = scan(input_path, shard_index, num_shards, done)
    exhausted = False
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=min(len(done), total), desc=f"shard {shard_index}/{num_shards}",
               unit="rec", disable=not progress, dynamic_ncols=True)

    def emit(records: list[dict]) -> None:
        writer.write(records)
        for r in records:
            if "error" in r:
                summary.errors += 1
            else:
                summary.results += 1
        bar.update(len(records))

    try:
        while True:
            errors: list[dict] = []
            while not exhausted and len(in_flight) < max_in_flight:
                item = next(todo, None)
                if item is None:
                    exhausted = True
                elif isinstance(item, dict):
                    errors.append(item)
                else:
                    try:
                        engine.add_request(item.prompt, item.params, request_id=item.request_id)
                        in_flight[item.request_id] = item
                    except InvalidRequestError as e:
                        errors.append(error_record(item.id, item.line, e.field, field_message(e)))
                if len(errors) >= FLUSH_ERRORS_EVERY:
                    emit(errors)
                    errors = []
            emit(errors)
            if not engine.has_unfinished():
                if exhausted:
                    break
                continue
            finished = []
            for d in engine.step():
                summary.tokens += len(d.token_ids)
                if d.finished and d.request_id in in_flight:
                    out = engine.pop_finished(d.request_id)
                    if out is not None:  # None until every sample of the request finished
                        finished.append(result_record(in_flight.pop(d.request_id), out))
            emit(finished)
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{summary.tokens / max(elapsed, 1e-9):.1f} tok/s, "
                                f"{len(in_flight)} in flight", refresh=False)
    finally:
        bar.close()
        writer.close()
    if in_flight:  # the engine went idle with requests of ours unanswered: a bug, not a user error
        raise RuntimeError(f"engine idle but {len(in_flight)} requests never finished: {sorted(in_flight)[:5]}")
    summary.seconds = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", type=Path, help="JSONL of requests")
    ap.add_argument("output", type=Path, help="JSONL of results (appended to when resuming)")
    ap.add_argument("--num-shards", type=int, default=None, help="default: jax.process_count()")
    ap.add_argument("--shard-index", type=int, default=None, help="default: jax.process_index()")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="requests inside the engine at once (default: 4 x max_num_seqs)")
    ap.add_argument("--no-progress", action="store_true")
    flags.add_engine_flags(ap)
    flags.add_log_flags(ap)
    add_ray_flags(ap)
    args = ap.parse_args(argv)
    flags.setup_logging(args.log_level)
    load, engine = flags.engine_configs_or_exit(args, "generate_batch")  # every check, before jax starts
    if args.ray is not None:
        return main_ray(ap, args, load, engine)

    import jax

    from sharding.mesh import initialize_distributed
    initialize_distributed()  # multi-host only when JAXSERVE_COORDINATOR / _NUM_PROCESSES are set
    num_shards = args.num_shards if args.num_shards is not None else jax.process_count()
    shard_index = args.shard_index if args.shard_index is not None else jax.process_index()
    if not 0 <= shard_index < num_shards:
        ap.error(f"--shard-index must be in [0, {num_shards}), got {shard_index}")
    if not args.input.is_file():
        ap.error(f"input file {args.input} not found")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        ap.error("--max-in-flight must be >= 1")

    from jaxserve.engine.build import build_llm
    llm = build_llm(args, "generate_batch")
    s = run(llm.engine, args.input, args.output, shard_index, num_shards, args.max_in_flight,
            progress=not args.no_progress)
    print(f"generate_batch: {s.output}: {s.results} results and {s.errors} error records written "
          f"({s.resumed} already there); {s.tokens} tokens in {s.seconds:.1f} s ({s.tok_s:.1f} tok/s)",
          file=sys.stderr)
    return 0


def main_ray(ap, args, load, engine) -> int:
    """--ray: the same records through Ray Data (jaxserve/ray/batch_job.py)."""
    from jaxserve.ray.batch_job import check_output_dir, run as run_ray
    try:
        import ray.data  # noqa: F401
    except ImportError:
        ap.error("--ray needs Ray Data: pip install 'jaxserve[ray]'")
    for name in ("num_shards", "shard_index", "max_in_flight"):
        if getattr(args, name) is not None:
            ap.error(f"--{name.replace('_', '-')} is not used with --ray: Ray distributes the rows "
                     f"(--ray-actors, --ray-batch-size, --ray-max-concurrent-batches)")
    for name in ("ray_actors", "ray_batch_size", "ray_max_concurrent_batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if "://" not in str(args.input) and not args.input.exists():
        ap.error(f"input {args.input} not found")
    why = check_output_dir(str(args.output))
    if why:
        ap.error(why)
    run_ray(args, load, engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
