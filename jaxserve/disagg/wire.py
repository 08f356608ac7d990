"""A Handover (engine/handover.py) as JSON, the bytes a prefill process sends a decode process
beside the KV data: plain fields only (no pickle, which would run code from the wire), read back
through SamplingParams' own checks, so a malformed message is refused naming its field."""

from __future__ import annotations

import dataclasses
import json

from jaxserve.engine.handover import HandedSample, Handover
from jaxserve.scheduler.handover import HeldTable
from jaxserve.types import InvalidRequestError, SamplingParams, TokenLogprob

VERSION = 1


def to_json(h: Handover) -> bytes:
    d = dataclasses.asdict(h)
    d["version"] = VERSION
    return json.dumps(d, separators=(",", ":")).encode()


def from_json(raw: bytes) -> Handover:
    try:
        d = json.loads(raw)
        if d.pop("version", None) != VERSION:
            raise InvalidRequestError("handover.version", f"must be {VERSION}")
        params = SamplingParams(**d.pop("params"))
        samples = []
        for s in d.pop("samples"):
            t = s.pop("table")
            table = HeldTable(int(t["sample_index"]), tuple(t["output_ids"]), int(t["num_computed_tokens"]),
                              int(t["full_nulls"]), tuple(t["full_pages"]), int(t["sliding_nulls"]),
                              tuple(t["sliding_pages"]))
            lps = s.pop("logprobs")
            if lps is not None:
                lps = [_token_logprob(x) for x in lps]
            samples.append(HandedSample(table=table, logprobs=lps, **s))
        prompt_lps = d.pop("prompt_logprobs", None)
        if prompt_lps is not None:  # the first (and any not computed) is None
            prompt_lps = [None if x is None else _token_logprob(x) for x in prompt_lps]
        return Handover(params=params, samples=samples, prompt_logprobs=prompt_lps, **d)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise InvalidRequestError("handover", f"not a valid handover message: {type(e).__name__}: {e}") from e


def _token_logprob(x: dict) -> TokenLogprob:
    return TokenLogprob(int(x["token_id"]), float(x["logprob"]), [(int(t), float(v)) for t, v in x["top"]])
