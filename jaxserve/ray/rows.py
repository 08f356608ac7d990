"""Ray Data rows <-> batch generation's records (jaxserve/batch_records.py, whose format
scripts/generate_batch.py documents): an input row checked and turned into `Work` or into an
error record naming the field; a record turned into a row of one fixed Arrow schema.

The differences from generate_batch's JSONL records, all forced by a distributed, columnar
dataset:
- no "line": a row of a distributed dataset has no input line; rows are keyed by id alone;
- "id" is always a string (an Arrow column has one type; an integer id comes back as its
  decimal string), and ids are not checked for uniqueness across the dataset (that would be a
  shuffle of the whole input): every input row gets exactly one output row;
- every column is in every row, null where the record has no such key (Parquet and Arrow have
  no optional keys), and a logprob's "top" is a list of {"token_id", "logprob"} pairs instead of
  [token_id, logprob] arrays (one Arrow type per element).
An input row's null fields are fields it does not give (a Parquet column that other rows use).

Standard library, pyarrow and jaxserve's record format only (no jax, no ray): the driver and the
tests use it without starting an engine.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from jaxserve.batch_records import RecordError, Work, parse_prompt, parse_sampling, unusable_id_message, usable_id

TOP = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("top", pa.list_(TOP))])
SAMPLE = pa.struct([("index", pa.int64()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
                    ("finish_reason", pa.string()), ("logprobs", pa.list_(LOGPROB)),
                    ("error_detail", pa.string())])
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("text", pa.string()),
    ("token_ids", pa.list_(pa.int64())),
    ("finish_reason", pa.string()),
    ("logprobs", pa.list_(LOGPROB)),
    ("error_detail", pa.string()),
    ("samples", pa.list_(SAMPLE)),
    ("usage", pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64())])),
    ("timings", pa.struct([(k, pa.float64()) for k in ("queue_time", "ttft", "tpot", "e2e")])),
    ("error", pa.struct([("field", pa.string()), ("message", pa.string())])),
])
JSONL_COLUMN = "text"  # ray.data.read_text's column: one raw input line per row


def work_of_row(row: dict, line: int = 0) -> Work | dict:
    """An input row -> Work, or an error record (the same checks as generate_batch's). `row` is
    a dict of fields, or {JSONL_COLUMN: raw line} when `jsonl` rows come from read_text."""
    rec = {k: v for k, v in row.items() if v is not None}
    rid = usable_id(rec)
    if rid is None:
        return _error(None, "id", unusable_id_message(rec))
    try:
        return Work(line, rid, parse_prompt(rec), parse_sampling(rec))
    except RecordError as e:
        return _error(rid, e.field, e.message)


def work_of_jsonl_line(raw: str) -> Work | dict | None:
    """One line of a JSONL input -> Work, an error record, or None for a blank line (blank lines
    are not records, as in generate_batch)."""
    if not raw.strip():
        return None
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        return _error(None, "id", f"line is not valid JSON: {e}")
    if not isinstance(rec, dict):
        return _error(None, "id", unusable_id_message(rec))
    return work_of_row(rec)


def _error(rid: Any, field: str, message: str) -> dict:
    return {"id": rid, "error": {"field": field, "message": message}}


def to_row(record: dict) -> dict:
    """A generate_batch record (result or error) -> a row of SCHEMA."""
    row = {name: record.get(name) for name in SCHEMA.names}
    row["id"] = None if record.get("id") is None else str(record["id"])
    if row["logprobs"] is not None:
        row["logprobs"] = _logprobs(row["logprobs"])
    if row["samples"] is not None:
        row["samples"] = [dict(s, logprobs=None if s.get("logprobs") is None else _logprobs(s["logprobs"]),
                               error_detail=s.get("error_detail")) for s in row["samples"]]
    return row


def _logprobs(lps: list[dict]) -> list[dict]:
    return [dict(lp, top=[{"token_id": t, "logprob": v} for t, v in lp["top"]]) for lp in lps]


def to_table(records: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([to_row(r) for r in records], schema=SCHEMA)


def plain(row: dict) -> dict:
    """A row with its null fields left out: what a JSONL record of it says."""
    return {k: v for k, v in row.items() if v is not None}
