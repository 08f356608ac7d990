"""OpenAI request bodies (pydantic, so FastAPI publishes them as the OpenAPI schema) and their
conversion into the server's one `RequestSpec`.

Shapes are checked by pydantic (a wrong type is a 400 naming the field's path); ranges are
checked once, by `SamplingParams` (types.py), exactly as for gRPC. Unknown fields are ignored,
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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine import GrammarCompiler
from jaxserve.server.messages import RequestSpec, _check_request_id
from jaxserve.types import MAX_LOGIT_BIAS, InvalidRequestError, SamplingParams, StructuredOutputsParams

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 64  # prompts in one /v1/completions call (each is its own engine request)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """Fields shared by both endpoints (OpenAI's and vLLM's extra sampling parameters)."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's guided_* (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's extra
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Body):
    role: str
    # A string, or OpenAI's list of content parts of which only text parts are supported.
    content: str | list[dict] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


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
    given = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema.schema", "is required for type "
                                                                                "'json_schema'")
            given.append(("response_format.json_schema.schema",
                          StructuredOutputsParams(json=json.dumps(rf.json_schema.schema_))))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        given.append(("guided_json", StructuredOutputsParams(json=text)))
    if req.guided_regex is not None:
        given.append(("guided_regex", StructuredOutputsParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        given.append(("guided_choice", StructuredOutputsParams(choice=tuple(req.guided_choice))))
    if len(given) > 1:
        raise InvalidRequestError(given[1][0], f"only one of response_format (json), guided_json, "
                                               f"guided_regex, guided_choice may be given; got "
                                               f"{[g[0] for g in given]}")
    if not given:
        return None
    field, sop = given[0]
    try:
        GrammarCompiler.check(sop)
    except InvalidRequestError as e:
        raise InvalidRequestError(field, str(e).split(": ", 1)[1]) from None
    return sop


def sampling_params(req: _Sampling, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
    if req.max_tokens is None:
        raise InvalidRequestError("max_tokens", "must be set for completions")
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
    out = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidRequestError(f"messages[{i}].role", "must not be empty")
        out.append({"role": m.role, "content": message_text(i, m)})
    return out


def chat_spec(req: ChatCompletionRequest) -> tuple[RequestSpec, bool]:
    """The spec and whether max_tokens is "up to the context" (resolved once tokenized)."""
    if req.tools:
        raise InvalidRequestError("tools", "tool calling is not supported by this server")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs)
    spec = RequestSpec(params, messages=chat_messages(req.messages))
    return _common(spec, req), max_tokens is None
