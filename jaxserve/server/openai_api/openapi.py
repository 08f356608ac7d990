"""What /openapi.json publishes: the request models' limits, every status each operation answers
(OpenAI's error body as the `ErrorResponse` component), the SSE and text media types, and this
server's own facts, so that the schema admits what the server accepts and nothing it refuses.

    Limits     JSON Schema keywords on a request field (protocol.py), from the constants its one
               check uses (types.py, messages.py): published here, checked there, once, as for
               gRPC. `served=` names a fact of the running server that `install` fills in.
    *_RESPONSES the `responses=` tables of the route decorators (routes.py)
    install    the app's `openapi()`: FastAPI's document with this server's facts (its model's
               name, its vocabulary, context and queue bounds, the bearer scheme where a token
               is configured) and without FastAPI's default 422, which this server never sends
               (request-shape errors are 400s naming the field)

What JSON Schema cannot say stays a 400 naming the field: rules across fields (min_tokens <=
max_tokens, one grammar field at a time, ...), a grammar's own validity, and the prompt's length
in tokens against the context. tests/test_openapi_sweep.py lists them.
"""

from __future__ import annotations

from typing import Literal

from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

SERVED = "x-jaxserve-served"  # a placeholder `install` replaces with the running server's value


class Limits:
    """Annotated metadata: `Annotated[int, Limits(minimum=1, maximum=MAX_N)]`. Documentation
    only; pydantic checks types, the server's own checks enforce the published limits."""

    def __init__(self, served: str | None = None, **keywords):
        self.keywords = keywords if served is None else {**keywords, SERVED: served}

    def __get_pydantic_json_schema__(self, core_schema, handler):
        return {**handler(core_schema), **self.keywords}


def unset(*fields: str) -> dict:
    """An object in which each of `fields` is absent or null."""
    return {"properties": {f: {"type": "null"} for f in fields}}


def when_set(field: str, *allowed: dict) -> dict:
    """A `dependentSchemas` entry: with `field` given (and not null), one of `allowed` holds."""
    return {field: {"anyOf": [unset(field), *allowed]}}


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


# ---- response bodies (documentation only: the handlers build plain dicts) ----------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None  # the request field to blame, as its path ("messages[0].content")
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion", "chat.completion"]
    created: int
    model: str
    choices: list[dict]
    usage: Usage


class Chunk(BaseModel):
    """One SSE event's data while streaming (usage only with stream_options.include_usage)."""
    id: str
    object: Literal["text_completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[dict]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokens(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class Text(BaseModel):
    prompt: str


# ---- the responses= tables ---------------------------------------------------------------------

_RETRY_AFTER = {"Retry-After": {"description": "seconds; where this replica will serve again",
                                "schema": {"type": "integer"}}}


def _error(description: str, retry_after: bool = False) -> dict:
    out = {"model": ErrorResponse, "description": description}
    return {**out, "headers": _RETRY_AFTER} if retry_after else out


ERRORS = {
    400: _error("a malformed body or a value outside its limit; `param` names the field"),
    401: _error("a missing or wrong bearer token"),
    404: _error("a model other than the one this server serves"),
    413: _error("a body over max_message_bytes"),
    429: _error("the waiting queue, the tokenizer pool or a tenant quota is full", True),
    500: _error("an engine fault (never the caller's mistake)"),
    503: _error("warming up, draining or failed; `code` says which", True),
}
# Each event (OpenAPI 3.1: `schema` describes one): `data: {chunk}`, a failure after the start as
# `data: {error}`, the last `data: [DONE]`.
_SSE = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": "#/components/schemas/Chunk"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}]}}}}


def errors(*statuses: int) -> dict:
    return {s: ERRORS[s] for s in statuses}


def generation(body: type[BaseModel]) -> dict:
    """/v1/completions and /v1/chat/completions: one JSON body, or SSE with stream: true."""
    return {200: {"model": body, "description": "the completion (JSON), or its stream (SSE)",
                  "content": {"text/event-stream": _SSE}},
            **errors(400, 404, 413, 429, 500, 503)}


TOKENIZE_RESPONSES = {200: {"model": Tokens}, **errors(400, 404, 413, 429)}
DETOKENIZE_RESPONSES = {200: {"model": Text}, **errors(400, 404, 413)}
MODELS_RESPONSES = {200: {"model": ModelList}}
_JSON_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
# The probes' own 200 is text; their 503 is still OpenAI's JSON error body.
PROBE_RESPONSES = {200: {"description": "`ok`", "content": {"text/plain": {"schema": {"const": "ok\n"}}}},
                   503: {"description": ERRORS[503]["description"], "headers": _RETRY_AFTER,
                         "content": _JSON_ERROR}}
METRICS_RESPONSES = {200: {"description": "the Prometheus exposition",
                           "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}


# ---- this server's facts -----------------------------------------------------------------------

def decimal_below(n: int, width: int = 10) -> str:
    """A regex for the strings of at most `width` ASCII digits (leading zeros allowed) whose
    value is below n, 1 <= n <= 10**width: logit_bias's keys, token ids as JSON object keys."""
    top = str(n - 1)
    d = len(top)
    # d digits, at most `top`: top's first i digits, then a smaller one, then any.
    alts = [top[:i] + (f"[0-{int(top[i]) - 1}]" if top[i] != "1" else "0") + "[0-9]" * (d - i - 1)
            for i in range(d) if top[i] != "0"] + [top]
    shorter = f"[0-9]{{1,{d - 1}}}|" if d > 1 else ""  # fewer digits: below 10**(d-1) <= n - 1
    return f"^(?:{shorter}0{{0,{width - d}}}(?:{'|'.join(alts)}))$"


def _fill(node, facts: dict) -> None:
    if isinstance(node, dict):
        if SERVED in node:
            node.update(facts[node.pop(SERVED)])
        for v in node.values():
            _fill(v, facts)
    elif isinstance(node, list):
        for v in node:
            _fill(v, facts)


def install(app, *, model: str, vocab_size: int, max_tokens: int, max_samples: int,
            bearer: bool, open_paths: tuple[str, ...]) -> None:
    """`app.openapi()` with this server's facts. `max_tokens`: the most any prompt leaves;
    `max_samples`: n's bound (MAX_N or the waiting queue, whichever is less); `bearer`: every
    path but `open_paths` needs the token (401 otherwise)."""
    facts = {"model": {"enum": [model]}, "token_id": {"maximum": vocab_size - 1},
             "token_key": {"propertyNames": {"pattern": decimal_below(vocab_size)}},
             "max_tokens": {"maximum": max_tokens}, "samples": {"maximum": max_samples}}

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _fill(doc, facts)
        schemas = doc["components"]["schemas"]
        chunk = Chunk.model_json_schema(ref_template="#/components/schemas/{model}")  # only _SSE names it
        schemas.update(chunk.pop("$defs", {}), Chunk=chunk)
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        error = {"description": ERRORS[401]["description"], "content": _JSON_ERROR}
        for path, ops in doc["paths"].items():
            for op in ops.values():
                op["responses"].pop("422", None)
                if bearer and path not in open_paths:
                    op["security"] = [{"bearer": []}]
                    op["responses"]["401"] = error
        if bearer:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = doc
        return doc
    app.openapi = openapi
