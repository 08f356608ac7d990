"""OpenAI request bodies (pydantic, so FastAPI publishes them as the OpenAPI schema) and their
conversion into the server's one `RequestSpec`.

Shapes are checked by pydantic, strictly (a wrong type, "5" for 5 included, is a 400 naming the
field's path); ranges are checked once, by `SamplingParams` (types.py), exactly as for gRPC, and
published in /openapi.json from the same constants (openapi.Limits), with the rules across
fields JSON Schema can state. Unknown fields are ignored,
as vLLM does, so clients that send newer OpenAI fields still work. Fields jaxserve cannot honour
(`suffix`, `best_of` > n, echo with logprobs while streaming, `tools`) are refused
with a 400 naming them, never silently dropped. Structured outputs (`response_format` json_object
/ json_schema, vLLM's `guided_json` / `guided_regex` / `guided_choice`) become one
`StructuredOutputsParams`, whose grammar is compiled here, before queuing.

Defaults follow OpenAI's API, not jaxserve's offline defaults: temperature 1.0, completions'
max_tokens 16, chat's max_tokens "up to the context" (resolved by the frontend once the prompt
is tokenized).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from jaxserve.engine import GrammarCompiler
from jaxserve.server.messages import (MAX_MESSAGES, MAX_REQUEST_ID_CHARS, MAX_ROLE_CHARS, REQUEST_ID_PATTERN,
                                      RequestSpec, _check_request_id, check_message_count, check_role)
from jaxserve.server.openai_api.openapi import Limits, unset, when_set
from jaxserve.types import (INT32_MAX, MAX_ABS_LOGIT_BIAS, MAX_ABS_PENALTY, MAX_ABS_PRIORITY, MAX_GRAMMAR_CHARS,
                            MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_PROMPT_CHARS, MAX_REPETITION_PENALTY,
                            MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE, MIN_DIVISOR,
                            InvalidRequestError, SamplingParams, StructuredOutputsParams, check_priority)

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each is its own engine request)


class _Body(BaseModel):
    # strict: a JSON string is not an integer, nor 1 a boolean (the schema's types, as sent).
    model_config = ConfigDict(extra="ignore", strict=True)


# Field types with the limits their checks enforce (published by openapi.Limits; `served`: this
# server's value, filled in by openapi.install).
def _integral(v):
    """JSON Schema's integer includes 2.0: an integral float is that integer (strings are not)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _int(lo: int, hi: int, served: str | None = None):
    return Annotated[int, BeforeValidator(_integral), Limits(served, minimum=lo, maximum=hi)]


def _num(lo: float, hi: float, above: bool = False):
    """A number in [lo, hi], or in (lo, hi] when `above`."""
    return Annotated[float, Limits(**{"exclusiveMinimum" if above else "minimum": lo}, maximum=hi)]


def _text(lo: int = 0, hi: int | None = None, **kw):
    return Annotated[str, Limits(**({"minLength": lo} if lo else {}), **({"maxLength": hi} if hi is not None else {}),
                                 **kw)]


# The integers JSON carries exactly (RFC 8259 section 6: most parsers hold numbers as float64), so
# HTTP's seeds stop there, below MAX_SEED: a larger one would not reach the server as sent.
MAX_JSON_INT = 2**53 - 1
Model = Annotated[str, Limits("model")]
TokenId = _int(0, INT32_MAX, "token_id")
MaxTokens = _int(1, INT32_MAX, "max_tokens")
Samples = _int(1, MAX_N, "samples")
TopLogprobs = _int(0, MAX_LOGPROBS)
StopString = _text(1, MAX_STOP_STRING_CHARS)
Grammar = _text(1, MAX_GRAMMAR_CHARS)
PromptText = _text(1, MAX_PROMPT_CHARS)
TokenList = Annotated[list[TokenId], Limits(minItems=1)]
# logit_bias: token ids as object keys (the vocabulary bound as a pattern), biases in range.
LogitBias = Annotated[dict[str, float], Limits(
    "token_key", maxProperties=MAX_LOGIT_BIAS, propertyNames={"pattern": "^[0-9]{1,10}$"},
    additionalProperties={"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS, "maximum": MAX_ABS_LOGIT_BIAS})]
# OpenAI's content parts, of which only text parts are supported (message_text checks).
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    # type json_schema needs json_schema.schema (structured() checks it).
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}}},
        {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Rules across fields, as JSON Schema (their checks: structured(), chat_spec, completion_specs),
# spelled with few branches (schemathesis' generator gives up on a product of many):
# - one grammar at a time (of guided_*, a response_format other than text), none with ignore_eos
_GRAMMARS = ("guided_json", "guided_regex", "guided_choice")
_TEXT_FORMAT = {"properties": {"type": {"const": "text"}}}  # holds for null too (not an object)


def _grammar_only(field: str | None) -> dict:
    """Every grammar field but `field` unset; with one set, no ignore_eos."""
    props = {g: {"type": "null"} for g in _GRAMMARS if g != field}
    if field != "response_format":
        props["response_format"] = _TEXT_FORMAT
    return {"properties": props if field is None else {**props, "ignore_eos": {"const": False}}}


_ONE_GRAMMAR = [_grammar_only(f) for f in (None, *_GRAMMARS, "response_format")]
# - streamed: no prompt logprobs (prompt_logprobs, or echo with logprobs)
_STREAM_RULE = when_set("stream", {"properties": {"stream": {"const": False}}}, {"allOf": [
    unset("prompt_logprobs"), {"anyOf": [{"properties": {"echo": {"const": False}}}, unset("logprobs")]}]})
# - request_id names one request: one prompt (a string, token ids, or a list of one)
_REQUEST_ID_RULE = when_set("request_id", {"properties": {"prompt": {"anyOf": [
    {"type": "string"}, {"type": "array", "items": {"type": "integer"}}, {"type": "array", "maxItems": 1}]}}})
# - top_logprobs needs logprobs; max_tokens or max_completion_tokens, not both
_CHAT_RULES = {**when_set("top_logprobs", {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
               **when_set("max_tokens", unset("max_completion_tokens"))}


class _Sampling(_Body):
    """Fields shared by both endpoints (OpenAI's and vLLM's extra sampling parameters)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": _ONE_GRAMMAR})

    model: Model
    n: Samples = 1
    # 0 is greedy; otherwise at least MIN_DIVISOR (below it float32 logits overflow).
    temperature: Annotated[float, Limits(anyOf=[{"const": 0}, {"minimum": MIN_DIVISOR,
                                                               "maximum": MAX_TEMPERATURE}])] | None = None
    top_p: _num(0, 1, above=True) | None = None
    seed: _int(0, MAX_JSON_INT) | None = None
    stop: StopString | Annotated[list[StopString], Limits(maxItems=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _num(-MAX_ABS_PENALTY, MAX_ABS_PENALTY) | None = None
    frequency_penalty: _num(-MAX_ABS_PENALTY, MAX_ABS_PENALTY) | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM's extras
    top_k: _int(-1, INT32_MAX) | None = None
    min_p: _num(0, 1) | None = None
    repetition_penalty: _num(MIN_DIVISOR, MAX_REPETITION_PENALTY) | None = None
    ignore_eos: bool = False
    min_tokens: _int(0, INT32_MAX, "max_tokens") = 0  # and at most max_tokens
    stop_token_ids: Annotated[list[TokenId], Limits(maxItems=MAX_STOP_STRINGS)] | None = None
    skip_special_tokens: bool = True
    priority: _int(-MAX_ABS_PRIORITY, MAX_ABS_PRIORITY) = 0
    request_id: _text(0, MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN) | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | Grammar | None = None
    guided_regex: Grammar | None = None
    guided_choice: Annotated[list[_text(1)], Limits(minItems=1)] | None = None


class CompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"anyOf": _ONE_GRAMMAR,
                                                 "dependentSchemas": {**_STREAM_RULE, **_REQUEST_ID_RULE}})

    prompt: (PromptText | Annotated[list[PromptText], Limits(minItems=1, maxItems=MAX_PROMPTS)] | TokenList
             | Annotated[list[TokenList], Limits(minItems=1, maxItems=MAX_PROMPTS)])
    max_tokens: MaxTokens = COMPLETIONS_DEFAULT_MAX_TOKENS  # an integer: null is a 400
    logprobs: TopLogprobs | None = None
    echo: bool = False
    prompt_logprobs: TopLogprobs | None = None  # vLLM's extra
    suffix: _text(0, 0) | None = None  # not supported: only empty
    best_of: Samples | None = None  # only equal to n


class ChatMessage(_Body):
    role: _text(1, MAX_ROLE_CHARS)
    # A string, or OpenAI's list of content parts of which only text parts are supported.
    content: str | Annotated[list[dict], Limits(items=TEXT_PART)] | None = None
    name: str | None = None


Messages = Annotated[list[ChatMessage], Limits(maxItems=MAX_MESSAGES)]


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(json_schema_extra={"anyOf": _ONE_GRAMMAR, "dependentSchemas": _CHAT_RULES})

    messages: Annotated[Messages, Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[dict], Limits(maxItems=0)] | None = None  # tool calling is not supported


class TokenizeRequest(_Body):
    # Exactly one of prompt and messages (the handler checks it).
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})

    model: Model | None = None
    prompt: _text(0, MAX_PROMPT_CHARS) | None = None
    messages: Messages | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: Model | None = None
    tokens: list[TokenId]


def logit_bias(req: _Sampling) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); SamplingParams checks the rest."""
    if not req.logit_bias:
        return None
    if len(req.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}")
    out = {}
    for k, v in req.logit_bias.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10):
            raise InvalidRequestError("logit_bias", f"keys must be token ids (non-negative integers), got {k!r:.40}")
        if int(k) in out:  # "7" and "07"
            raise InvalidRequestError("logit_bias", f"token id {int(k)} given twice")
        out[int(k)] = v
    return out


def has_grammar(req: _Sampling) -> bool:
    rf = req.response_format
    return ((rf is not None and rf.type != "text") or req.guided_json is not None
            or req.guided_regex is not None or req.guided_choice is not None)


def structured(req: _Sampling) -> StructuredOutputsParams | None:
    """response_format / guided_json / guided_regex / guided_choice -> one grammar, checked now
    (a bad schema is a 400 naming the field before anything is queued)."""
    given = []  # (the field, StructuredOutputsParams' arguments)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema.schema", "is required for type "
                                                                                "'json_schema'")
            given.append(("response_format.json_schema.schema", {"json": json.dumps(rf.json_schema.schema_)}))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        given.append(("guided_json", {"json": text}))
    if req.guided_regex is not None:
        given.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        given.append(("guided_choice", {"choice": tuple(req.guided_choice)}))
    if len(given) > 1:
        raise InvalidRequestError(given[1][0], f"only one of response_format (json), guided_json, "
                                               f"guided_regex, guided_choice may be given; got "
                                               f"{[g[0] for g in given]}")
    if not given:
        return None
    field, kw = given[0]
    try:  # the HTTP field named, not StructuredOutputsParams' (an empty regex, a huge schema)
        sop = StructuredOutputsParams(**kw)
        GrammarCompiler.check(sop)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, str(e).split(": ", 1)[1]) from None
    return sop


def sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.seed is not None and not 0 <= req.seed <= MAX_JSON_INT:
        raise InvalidRequestError("seed", f"must be an integer in [0, 2^53-1] (JSON's exact integers), "
                                          f"got {req.seed}")
    stop = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    kw = dict(n=req.n, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
              ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs, min_tokens=req.min_tokens,
              skip_special_tokens=req.skip_special_tokens,
              temperature=OPENAI_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature)
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    kw["structured_outputs"] = structured(req)
    kw["logit_bias"] = logit_bias(req)
    return SamplingParams(**kw)


def _common(spec: RequestSpec, req: _Sampling) -> RequestSpec:
    check_priority(req.priority)  # before queuing (the scheduler's check is too late to 400)
    if req.request_id is not None:
        _check_request_id(req.request_id)
        spec.request_id = req.request_id
    spec.priority = req.priority
    return spec


def completion_specs(req: CompletionRequest) -> list[RequestSpec]:
    """One spec per prompt (a list of strings or of token lists is a batch of prompts)."""
    if req.suffix:
        raise InvalidRequestError("suffix", "is not supported by this server")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of", f"must equal n ({req.n}) on this server, got {req.best_of}")
    # echo + logprobs reports the prompt tokens' logprobs too (OpenAI's legacy completions);
    # they are known only once the prompt is computed, so not with the echo chunk of a stream.
    echo_lps = req.echo and req.logprobs is not None
    if req.stream and (echo_lps or req.prompt_logprobs is not None):
        raise InvalidRequestError("echo" if echo_lps else "prompt_logprobs",
                                  "prompt logprobs are returned without stream only")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    want = [v for v in (req.logprobs if echo_lps else None, req.prompt_logprobs) if v is not None]
    if want:
        params = dataclasses.replace(params, prompt_logprobs=max(want))
    p = req.prompt
    if isinstance(p, str):
        prompts: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = list(p)
    if not prompts:
        raise InvalidRequestError("prompt", "must not be an empty list")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError("prompt", f"at most {MAX_PROMPTS} prompts per call, got {len(prompts)}")
    if len(prompts) > 1 and req.request_id is not None:
        raise InvalidRequestError("request_id", "applies to one prompt; send one prompt per call")
    specs = []
    for x in prompts:
        spec = RequestSpec(params, text=x) if isinstance(x, str) else RequestSpec(params, token_ids=list(x))
        specs.append(_common(spec, req))
    return specs


def message_text(i: int, m: ChatMessage) -> str:
    c = m.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, part in enumerate(c):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{i}].content[{j}]",
                                      "only text parts ({'type': 'text', 'text': ...}) are supported")
        parts.append(part["text"])
    return "".join(parts)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """gRPC's limits too (messages.messages_from_proto): the count, each role's length."""
    check_message_count(len(messages))
    out = []
    for i, m in enumerate(messages):
        check_role(m.role, f"messages[{i}].role")
        out.append({"role": m.role, "content": message_text(i, m)})
    return out


def chat_spec(req: ChatCompletionRequest) -> tuple[RequestSpec, bool]:
    """The spec and whether max_tokens is "up to the context" (resolved once tokenized)."""
    if req.tools:
        raise InvalidRequestError("tools", "tool calling is not supported by this server")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    if req.max_tokens is not None and req.max_completion_tokens is not None:  # else one goes unchecked
        raise InvalidRequestError("max_tokens", "give max_completion_tokens or max_tokens (its older name), "
                                                "not both")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    # Up to the context: until it is known (fill_context, once tokenized), as few as min_tokens
    # allows, not SamplingParams' 16 (which would refuse a min_tokens the context has room for).
    params = sampling_params(req, max_tokens if max_tokens is not None else max(1, req.min_tokens), logprobs)
    spec = RequestSpec(params, messages=chat_messages(req.messages))
    return _common(spec, req), max_tokens is None
