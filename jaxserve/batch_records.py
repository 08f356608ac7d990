"""The JSONL record format of batch generation (scripts/generate_batch.py; its docstring
describes the format): an input record checked and turned into work for the engine, or into an
error record naming the field; a finished request turned into its result record.

Standard library and jaxserve.types only (no jax import).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxserve.types import InvalidRequestError, SamplingParams

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
RECORD_KEYS = frozenset(("id", "sampling") + PROMPT_KEYS)
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclasses.dataclass
class Work:
    line: int  # 1-based input line
    id: Any  # as given in the input (str or int)
    prompt: Any  # str, chat messages, or {"prompt_token_ids": [...]}
    params: SamplingParams

    @property
    def request_id(self) -> str:  # the engine's id: unique per line, whatever the user's ids are
        return f"line-{self.line}"


class RecordError(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def usable_id(rec: Any) -> Any:
    """The record's id, or None when there is none usable (a non-empty string or an integer)."""
    if not isinstance(rec, dict):
        return None
    v = rec.get("id")
    if isinstance(v, str) and v:
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return None



def unusable_id_message(rec: Any) -> str:
    """Why `rec` (a parsed line, for which usable_id gave None) has no usable id: the error
    record's message for field "id"."""
    if not isinstance(rec, dict):
        return "the line is not a JSON object"
    if "id" not in rec:
        return "missing; every record needs an id (a non-empty string or an integer)"
    return f"must be a non-empty string or an integer, got {rec['id']!r:.80}"

def id_key(v: Any) -> str:
    return json.dumps(v)  # "5" and 5 are different ids


def parse_sampling(rec: dict) -> SamplingParams:
    """The record's SamplingParams fields; what it leaves out takes SamplingParams' default (a
    record without "temperature" samples at 1.0, as vLLM's and OpenAI's batch records do)."""
    kw: dict[str, Any] = {}
    for k, v in rec.items():
        if k in RECORD_KEYS:
            continue
        if k not in SAMPLING_FIELDS:
            raise RecordError(k, f"unknown field; expected id, one of {list(PROMPT_KEYS)}, "
                                 f"'sampling' or a SamplingParams field {sorted(SAMPLING_FIELDS)}")
        kw[k] = v
    nested = rec.get("sampling", {})
    if not isinstance(nested, dict):
        raise RecordError("sampling", f"must be an object, got {type(nested).__name__}")
    for k, v in nested.items():
        if k not in SAMPLING_FIELDS:
            raise RecordError(f"sampling.{k}", f"unknown sampling parameter; known: {sorted(SAMPLING_FIELDS)}")
        if k in kw:
            raise RecordError(k, "given both at the top level and under 'sampling'")
        kw[k] = v
    # SamplingParams iterates these; a scalar would raise a TypeError naming no field.
    if "stop" in kw and not (isinstance(kw["stop"], str) or isinstance(kw["stop"], list)):
        raise RecordError("stop", f"must be a string or a list of strings, got {type(kw['stop']).__name__}")
    if "stop_token_ids" in kw and not isinstance(kw["stop_token_ids"], list):
        raise RecordError("stop_token_ids",
                          f"must be a list of integers, got {type(kw['stop_token_ids']).__name__}")
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise RecordError(e.field, field_message(e)) from None


def parse_prompt(rec: dict) -> Any:
    given = [k for k in PROMPT_KEYS if k in rec]
    if not given:
        raise RecordError("prompt", f"one of {list(PROMPT_KEYS)} is required")
    if len(given) > 1:
        raise RecordError(given[1], f"give only one of {list(PROMPT_KEYS)}, got {given}")
    k = given[0]
    v = rec[k]
    if k == "prompt":
        if not isinstance(v, str):
            raise RecordError("prompt", f"must be a string, got {type(v).__name__}")
        return v
    if k == "messages":
        if not isinstance(v, list) or not v:
            raise RecordError("messages", "must be a non-empty list of {'role', 'content'} objects")
        return v
    return {"prompt_token_ids": v}


def field_message(e: InvalidRequestError) -> str:
    """The error's message without its leading field name (the record names the field)."""
    s = str(e)
    return s[len(e.field) + 2:] if s.startswith(e.field + ": ") else s


def error_record(rid: Any, line: int, field: str, message: str) -> dict:
    return {"id": rid, "line": line, "error": {"field": field, "message": message}}


def is_line_keyed(rec: dict) -> bool:
    """Errors about the id itself (missing, duplicate) are keyed by line; the rest by id."""
    err = rec.get("error")
    return isinstance(err, dict) and err.get("field") == "id"


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def result_record(work: Work, out) -> dict:
    m = out.metrics
    first = out.outputs[0]

    def sample(c) -> dict:
        d = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
        if c.logprobs is not None:
            d["logprobs"] = [{"token_id": lp.token_id, "logprob": _finite(lp.logprob),
                              "top": [[t, _finite(v)] for t, v in lp.top]} for lp in c.logprobs]
        if c.error is not None:
            d["error_detail"] = c.error
        return d

    rec = {"id": work.id, "line": work.line}
    rec.update({k: v for k, v in sample(first).items() if k != "index"})
    if len(out.outputs) > 1:
        rec["samples"] = [sample(c) for c in out.outputs]
    rec["usage"] = {"prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": sum(len(c.token_ids) for c in out.outputs)}
    rec["timings"] = {"queue_time": _finite(m.queue_time), "ttft": _finite(m.ttft),
                      "tpot": _finite(m.tpot(len(first.token_ids))), "e2e": _finite(m.e2e)}
    return rec
