"""Proto messages <-> engine values, for both APIs. Pure functions, no I/O, no threads.

A request becomes a `RequestSpec` (prompt in one of three forms + `SamplingParams`); every
check that needs no tokenizer and no engine happens here and raises `InvalidRequestError`
naming the field. Engine outputs become response messages here too.
"""

from __future__ import annotations

import dataclasses
import re

from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.server.proto import jetstream_pb2 as js
from jaxserve.types import (MAX_LOGIT_BIAS, MAX_PROMPT_CHARS, CompletionOutput, InvalidRequestError, RequestOutput,
                            SamplingParams, StepOutput, StructuredOutputsParams, TokenLogprob)

MAX_REQUEST_ID_CHARS = 256
# Printable ASCII (echoed in responses and logs); one pattern for the check and the HTTP schema.
REQUEST_ID_PATTERN = "^[ -~]*$"
MAX_CLIENT_CACHE_SALT_CHARS = 256  # the server prefixes the tenant's own salt (tenancy.py)
DEFAULT_MAX_TOKENS = 16
GRPC_DEFAULT_TEMPERATURE = 0.0  # a GenerateRequest without a temperature is greedy
# Caps on everything the server parses, checked here before anything walks or renders it (the
# whole message is bounded by ServerConfig.max_message_bytes, the transport's limit). A chat
# request counts its roles and contents together against the prompt's character limit; a role
# is a short name ("system", "user", "assistant", "tool") and the message count is bounded so a
# request of 300,000 empty messages is refused before the chat template iterates over it.
MAX_MESSAGES = 4096
MAX_ROLE_CHARS = 64
MAX_PROMPT_TOKEN_IDS = 1_000_000  # before the ids are copied; the context bounds them further

# GenerateRequest fields with explicit presence that map 1:1 onto SamplingParams.
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "n", "logprobs",
                    "skip_special_tokens", "min_tokens", "prompt_logprobs")

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}


@dataclasses.dataclass
class RequestSpec:
    """One request, whichever API it came from. Exactly one of the three prompt forms is set."""

    params: SamplingParams
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    token_ids: list[int] | None = None
    request_id: str = ""  # the caller's id ("" = none given)
    priority: int = 0
    text_out: bool = True  # False: the caller detokenizes (JetStream token content)
    client_cache_salt: str | None = None  # the request's own; tenancy.py adds the tenant's
    # Engine.validate's add_bos: None = the model's BOS rule for text, none for token ids;
    # JetStream's has_bos sets it for both (has_bos=false: add the BOS the content lacks).
    add_bos: bool | None = None
    # True: params.max_tokens is replaced, once the prompt is tokenized, by what the context has
    # left (OpenAI chat's default when max_tokens is not given).
    max_tokens_to_context: bool = False
    tenant: str = ""  # the authenticated caller (tenancy.salt_request sets it): fairness, quotas


def _check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS or not re.fullmatch(REQUEST_ID_PATTERN, rid):
        raise InvalidRequestError("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} printable "
                                                f"ASCII characters, got {len(rid)} characters")


def check_message_count(n: int, field: str = "messages") -> None:
    """A chat's length bound, on both doors (gRPC here, HTTP in openai_api.protocol), before any
    message is touched. (An empty chat is each caller's rule: /tokenize takes one.)"""
    if n > MAX_MESSAGES:
        raise InvalidRequestError(field, f"{n} messages exceeds the limit of {MAX_MESSAGES}")


def check_role(role: str, field: str) -> None:
    if not role:
        raise InvalidRequestError(field, "must not be empty")
    if len(role) > MAX_ROLE_CHARS:
        raise InvalidRequestError(field, f"{len(role)} characters exceeds the limit of {MAX_ROLE_CHARS}")


def messages_from_proto(msgs, field: str = "messages") -> list[dict[str, str]]:
    if not msgs.messages:
        raise InvalidRequestError(field, "must hold at least one message")
    check_message_count(len(msgs.messages), field)
    out = []
    chars = 0
    for i, m in enumerate(msgs.messages):
        role = m.role
        check_role(role, f"{field}[{i}].role")
        content = m.content
        chars += len(role) + len(content)
        if chars > MAX_PROMPT_CHARS:
            raise InvalidRequestError(field, f"more than {MAX_PROMPT_CHARS} characters of roles and "
                                             f"content (the limit, checked before rendering)")
        out.append({"role": role, "content": content})
    return out


def token_ids_from_proto(ids, field: str) -> list[int]:
    if len(ids) > MAX_PROMPT_TOKEN_IDS:  # before copying them
        raise InvalidRequestError(field, f"{len(ids)} token ids exceeds the limit of {MAX_PROMPT_TOKEN_IDS}")
    return list(ids)


def spec_from_generate(req: pb.GenerateRequest) -> RequestSpec:
    _check_request_id(req.request_id)
    kwargs = {f: getattr(req, f) for f in _SAMPLING_FIELDS if req.HasField(f)}
    if req.max_tokens_to_context:
        if req.HasField("max_tokens"):
            raise InvalidRequestError("max_tokens_to_context", f"replaces max_tokens, which is set "
                                                               f"({req.max_tokens}); give one of them")
        # Until the prompt is tokenized (Engine.validate's fill_context), as few as min_tokens
        # allows, as the HTTP chat door does (a min_tokens over 16 the context has room for passes).
        kwargs["max_tokens"] = max(1, kwargs.get("min_tokens", 0))
    kwargs.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    # Unset is greedy, as generation.proto documents (proto3's zero), not SamplingParams' 1.0.
    kwargs.setdefault("temperature", GRPC_DEFAULT_TEMPERATURE)
    if req.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(req.structured_outputs)
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:  # before copying them
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}")
        kwargs["logit_bias"] = dict(req.logit_bias)
    params = SamplingParams(stop=tuple(req.stop), stop_token_ids=tuple(req.stop_token_ids),
                            ignore_eos=req.ignore_eos, **kwargs)
    spec = RequestSpec(params, request_id=req.request_id, priority=req.priority,
                       max_tokens_to_context=req.max_tokens_to_context)
    if req.HasField("cache_salt"):
        if len(req.cache_salt) > MAX_CLIENT_CACHE_SALT_CHARS:
            raise InvalidRequestError("cache_salt", f"at most {MAX_CLIENT_CACHE_SALT_CHARS} characters, "
                                                    f"got {len(req.cache_salt)}")
        spec.client_cache_salt = req.cache_salt
    which = req.WhichOneof("input")
    if which == "prompt":
        spec.text = req.prompt
    elif which == "prompt_token_ids":
        spec.token_ids = token_ids_from_proto(req.prompt_token_ids.ids, "prompt_token_ids")
    elif which == "messages":
        spec.messages = messages_from_proto(req.messages)
    else:
        raise InvalidRequestError("prompt", "one of prompt, prompt_token_ids or messages is required")
    return spec


def generate_request(spec: RequestSpec) -> pb.GenerateRequest:
    """The GenerateRequest that `spec_from_generate` turns back into `spec` (the router's HTTP
    door sends its OpenAI requests on as its gRPC clients' go). What gRPC cannot say is refused
    naming the field, never dropped: the BOS override and token-only output (JetStream's)."""
    if spec.add_bos is not None or not spec.text_out:
        raise InvalidRequestError("add_bos" if spec.add_bos is not None else "text_out",
                                  "cannot be passed on by the router (GenerateRequest has no such field)")
    p = spec.params
    req = pb.GenerateRequest(request_id=spec.request_id, priority=spec.priority, stop=list(p.stop),
                             stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                             max_tokens_to_context=spec.max_tokens_to_context)
    for f in _SAMPLING_FIELDS:  # every one set, so neither side's defaults matter
        v = getattr(p, f)
        if v is not None and not (f == "max_tokens" and spec.max_tokens_to_context):
            setattr(req, f, v)  # (with max_tokens_to_context the prefill server fills max_tokens)
    if p.logit_bias:
        req.logit_bias.update(dict(p.logit_bias))
    so = p.structured_outputs
    if so is not None:
        if so.json is not None:
            req.structured_outputs.json_schema = so.json
        elif so.json_object:
            req.structured_outputs.json_object = True
        elif so.regex is not None:
            req.structured_outputs.regex = so.regex
        else:
            req.structured_outputs.choice.choices.extend(so.choice)
    if spec.client_cache_salt is not None:
        req.cache_salt = spec.client_cache_salt  # the tenant's part is each server's to add
    if spec.text is not None:
        req.prompt = spec.text
    elif spec.messages is not None:
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in spec.messages)
    else:
        req.prompt_token_ids.ids.extend(spec.token_ids)
    return req


def structured_from_proto(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    from jaxserve.engine import GrammarCompiler
    which = so.WhichOneof("kind")
    if which == "json_schema":
        sop = StructuredOutputsParams(json=so.json_schema)
    elif which == "json_object" and so.json_object:
        sop = StructuredOutputsParams(json_object=True)
    elif which == "regex":
        sop = StructuredOutputsParams(regex=so.regex)
    elif which == "choice":
        sop = StructuredOutputsParams(choice=tuple(so.choice.choices))
    else:
        raise InvalidRequestError("structured_outputs", "one of json_schema, json_object (true), regex "
                                                        "or choice is required")
    GrammarCompiler.check(sop)
    return sop


def spec_from_decode(req: js.DecodeRequest) -> RequestSpec:
    """JetStream semantics: greedy, stop at EOS, max_tokens required, num_samples 0 means 1,
    the model's BOS prepended unless has_bos says the content has it."""
    if req.max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
    if req.lora_adapter_id:
        raise InvalidRequestError("lora_adapter_id", f"no LoRA adapters are loaded on this server, got "
                                                     f"{req.lora_adapter_id!r:.80} (leave it empty for "
                                                     f"the base model)")
    params = SamplingParams(max_tokens=req.max_tokens, n=req.num_samples or 1, temperature=0.0)
    which = req.WhichOneof("content")
    if which == "text_content":
        return RequestSpec(params, text=req.text_content.text, add_bos=not req.has_bos)
    if which == "token_content":
        return RequestSpec(params, token_ids=token_ids_from_proto(req.token_content.token_ids, "prompt_token_ids"),
                           text_out=False, add_bos=not req.has_bos)
    raise InvalidRequestError("content", "one of text_content or token_content is required")


# ---- responses -----------------------------------------------------------------------------

def _logprobs(lps: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    if not lps:
        return []
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in lps]


def logprobs_from_proto(lps) -> list[TokenLogprob]:
    """`_logprobs`' inverse: a response's TokenLogprob messages as the engine's (the router's
    HTTP door reads its backends' streams with it)."""
    return [TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in lps]


def usage(out: RequestOutput) -> pb.Usage:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    cached_prompt_tokens=out.num_cached_tokens)


def timings(out: RequestOutput) -> pb.Timings:
    m = out.metrics
    t = pb.Timings(e2e_s=m.e2e or 0.0)
    n_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
    for name, value in (("queue_s", m.queue_time), ("ttft_s", m.ttft), ("tpot_s", m.tpot(n_tokens))):
        if value is not None:
            setattr(t, name, value)
    return t


def merge_deltas(deltas: list[StepOutput]) -> list[StepOutput]:
    """Join consecutive deltas of one sample (a slow reader gets fewer, larger messages)."""
    out: list[StepOutput] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and prev.index == d.index and not prev.finished:
            lps = (prev.logprobs or []) + (d.logprobs or []) if (prev.logprobs or d.logprobs) else None
            out[-1] = StepOutput(d.request_id, d.index, prev.token_ids + d.token_ids,
                                 prev.text + d.text, lps, d.finished, d.finish_reason, d.stop_reason)
        else:
            out.append(d)
    return out


def generate_response(d: StepOutput, request_id: str) -> pb.GenerateResponse:
    r = pb.GenerateResponse(request_id=request_id, index=d.index, token_ids=d.token_ids, text=d.text,
                            logprobs=_logprobs(d.logprobs))
    if d.finished:
        r.finish_reason = FINISH_REASONS[d.finish_reason]
        _set_stop_reason(r, d.stop_reason)
    return r


def _set_stop_reason(msg, reason: int | str | None) -> None:
    if isinstance(reason, str):
        msg.stop_string = reason
    elif reason is not None:
        msg.stop_token_id = reason


def stop_reason_of(msg) -> int | str | None:
    """A GenerateResponse's or Completion's stop_reason as CompletionOutput has it."""
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def completion(c: CompletionOutput) -> pb.Completion:
    msg = pb.Completion(index=c.index, text=c.text, token_ids=c.token_ids,
                        logprobs=_logprobs(c.logprobs),
                        finish_reason=FINISH_REASONS.get(c.finish_reason, 0))
    _set_stop_reason(msg, c.stop_reason)
    return msg


def prompt_logprobs(out: RequestOutput) -> list[pb.TokenLogprob]:
    """Prompt tokens 1 .. P-1 (the first has no logprob); none unless every one was computed."""
    lps = (out.prompt_logprobs or [None])[1:]
    return _logprobs(lps) if all(lp is not None for lp in lps) else []


def unary_response(out: RequestOutput, request_id: str) -> pb.GenerateUnaryResponse:
    return pb.GenerateUnaryResponse(request_id=request_id,
                                    completions=[completion(c) for c in out.outputs],
                                    usage=usage(out), timings=timings(out),
                                    prompt_logprobs=prompt_logprobs(out))


def decode_response(deltas: list[StepOutput], n: int, text_out: bool) -> js.DecodeResponse | None:
    """One JetStream message for one batch: a Sample per sample index (empty where that sample
    produced nothing). None if nothing was produced at all."""
    samples = [js.DecodeResponse.StreamContent.Sample() for _ in range(n)]
    produced = False
    for d in deltas:
        s = samples[d.index]
        s.token_ids.extend(d.token_ids)
        if text_out:
            s.text += d.text
        produced = produced or bool(d.token_ids) or bool(d.text)
    if not produced:
        return None
    return js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(samples=samples))
