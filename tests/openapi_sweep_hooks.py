"""Schemathesis hooks for tests/test_openapi_sweep.py (loaded by `st run` via SCHEMATHESIS_HOOKS).

`positive_data_acceptance` (ST202) says every request the schema admits is accepted. The schema
(jaxserve/server/openai_api/openapi.py) states each field's type, range, length and enum, the
server's model, vocabulary and context bounds, and the rules across fields that JSON Schema can
say (dependentSchemas). What it cannot say is listed in RULES: a 400 for a schema-valid request
passes only if its `param` and message are one of these; any other is still ST202. Each pass is
appended to $SWEEP_TALLY (one rule name a line), so the test reports how often each one fired.
"""

from __future__ import annotations

import json
import os
import re

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance as _builtin

# name: (the error's param, fully matched; a regex its message matches)
RULES = {
    # Values compared with each other: JSON Schema has no keyword for it.
    "min_tokens <= max_tokens": (r"min_tokens", r"max_tokens="),
    "best_of == n": (r"best_of", r"must equal n"),
    # The schema's own validity: a JSON schema or regex llguidance compiles (engine/grammar.py).
    "a grammar that compiles": (r"guided_json|guided_regex|guided_choice|response_format\.json_schema\.schema",
                                r"not a valid grammar|at most \d+ characters"),
    # The prompt in tokens (after the chat template) against the context, the KV cache and the
    # waiting queue: known once tokenized, not from the JSON.
    "prompt tokens within the context": (r"prompt|prompt_token_ids|max_tokens|messages",
                                         r"max_model_len|max_prompt_len|max_output_len|KV pages|"
                                         r"max_queued_tokens"),
    # Sums over a list's items (each item's own bound is in the schema).
    "all messages' characters together": (r"messages", r"characters of roles and content"),
    "logit_bias: one key per token id": (r"logit_bias", r"given twice"),  # "7" and "07"
}


def allowed_by(response) -> str | None:
    if response.status_code != 400:
        return None
    try:
        err = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    for name, (param, message) in RULES.items():
        if re.fullmatch(param, err.get("param") or "") and re.search(message, err.get("message") or ""):
            return name
    return None


@schemathesis.check
def positive_data_acceptance_but_unsayable_rules(ctx, response, case):
    """The built-in check (run with --exclude-checks positive_data_acceptance), except RULES."""
    try:
        return _builtin(ctx, response, case)
    except RejectedPositiveData:
        rule = allowed_by(response)
        if rule is None:
            raise
        if os.environ.get("SWEEP_TALLY"):
            with open(os.environ["SWEEP_TALLY"], "a") as f:
                f.write(rule + "\n")
        return None
