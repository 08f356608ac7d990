"""jaxserve.v1.Generation: streaming and unary generation, tokenize, detokenize, model info.

Each generation call runs as one task on the event loop: spec_from_generate -> Frontend.submit
-> messages built from the engine's deltas as they arrive -> Frontend.close in `finally`, which
is also where a cancel, a deadline or a disconnect lands (the task is cancelled inside
`stream()`), so the engine aborts the request before its next step.
"""

from __future__ import annotations

import dataclasses

from jaxserve.server import messages, tenancy
from jaxserve.server.calls import streaming, unary, why_left
from jaxserve.server.messages import MAX_PROMPT_CHARS
from jaxserve.server.frontend import Frontend
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import TokenizerError
from jaxserve.types import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """What ModelInfo reports besides the engine's own limits (the loader knows these)."""

    model: str = "unknown"
    source: str = ""
    dtype: str = ""
    quantization: str = "none"
    mesh: str = ""


def stream_messages(deltas, finished, client_id: str) -> list[pb.GenerateResponse]:
    """Generate's messages for one batch of a request's deltas; with the request's Finished
    event, the last one carries usage, timings and prompt logprobs."""
    msgs = [messages.generate_response(d, client_id)
            for d in messages.merge_deltas(deltas) if d.token_ids or d.text or d.finished]
    if finished is not None:
        if not msgs:
            msgs = [pb.GenerateResponse(request_id=client_id)]
        msgs[-1].usage.CopyFrom(messages.usage(finished.output))
        msgs[-1].timings.CopyFrom(messages.timings(finished.output))
        msgs[-1].prompt_logprobs.extend(messages.prompt_logprobs(finished.output))
    return msgs


class GenerationService:
    def __init__(self, frontend: Frontend, description: ModelDescription):
        self.frontend = frontend
        self.metrics = frontend.metrics
        self.description = description

    async def _spec(self, request, context) -> messages.RequestSpec:
        """The request salted with its caller's tenant. A request with a grammar is converted on
        the tokenizer pool: compiling its schema or regex can take long enough to stall every
        other call on the event loop."""
        tenant = tenancy.tenant_of(context)
        if request.HasField("structured_outputs"):
            spec = await self.frontend.off_loop(messages.spec_from_generate, request, tenant=tenant)
        else:
            spec = messages.spec_from_generate(request)
        return tenancy.salt(spec, tenant)

    @streaming
    async def Generate(self, request, context):
        spec = await self._spec(request, context)
        sub = await self.frontend.submit(spec)
        try:
            async for deltas, finished in self.frontend.stream(sub):
                for m in stream_messages(deltas, finished, sub.client_id):
                    yield m
        finally:
            self.frontend.close(sub, why_left(context))

    @unary
    async def GenerateUnary(self, request, context):
        spec = await self._spec(request, context)
        sub = await self.frontend.submit(spec)
        try:
            async for _deltas, finished in self.frontend.stream(sub):
                if finished is not None:
                    return messages.unary_response(finished.output, sub.client_id)
        finally:
            self.frontend.close(sub, why_left(context))

    @unary
    async def Tokenize(self, request, context):
        which = request.WhichOneof("input")
        if which == "text":
            if len(request.text) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("text", f"{len(request.text)} characters exceeds the limit "
                                                  f"of {MAX_PROMPT_CHARS}")
            spec = messages.RequestSpec(None, text=request.text, tenant=tenancy.tenant_of(context))
        elif which == "messages":
            spec = messages.RequestSpec(None, messages=messages.messages_from_proto(request.messages),
                                        tenant=tenancy.tenant_of(context))
        else:
            raise InvalidRequestError("input", "one of text or messages is required")
        rendered, ids = await self.frontend.render_and_tokenize(spec)  # off the event loop
        return pb.TokenizeResponse(token_ids=ids, text=rendered)

    @unary
    async def Detokenize(self, request, context):
        tok = self.frontend.tokenizer
        n = len(request.token_ids)
        if n > messages.MAX_PROMPT_TOKEN_IDS:
            raise InvalidRequestError("token_ids", f"{n} token ids exceeds the limit of "
                                                   f"{messages.MAX_PROMPT_TOKEN_IDS}")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True

        def detokenize(ids):
            try:
                tok.check_ids(ids)
            except TokenizerError as e:
                raise InvalidRequestError("token_ids", str(e)) from None
            return tok.decode(ids, skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=await self.frontend.off_loop(detokenize, list(request.token_ids),
                                                                       tenant=tenancy.tenant_of(context)))

    @unary
    async def ModelInfo(self, request, context):
        f, d = self.frontend, self.description
        sc = f.sched_config
        return pb.ModelInfoResponse(
            model=d.model, source=d.source, context_length=sc.max_model_len, dtype=d.dtype,
            quantization=d.quantization, vocab_size=f.vocab_size,
            token_buckets=list(f.engine_loop.engine.runner.buckets), mesh=d.mesh,
            page_size=sc.page_size, num_kv_pages=sc.num_pages - 1, max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens, eos_token_ids=list(f.eos_token_ids),
            max_queued_requests=f.limiter.max_samples, max_queued_tokens=f.limiter.max_tokens,
            version=_version(), max_output_tokens=f.max_output_tokens)


def _version() -> str:
    import jaxserve
    return jaxserve.__version__
