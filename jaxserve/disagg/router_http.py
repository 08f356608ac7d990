"""The router's OpenAI HTTP door (`serve --role router --http-port P`): openai_api's own app
(routes.build_app) over the router, so a disaggregated deployment answers HTTP clients as a
colocated server does.

    HTTP -> openai_api (the same parsing, checks, JSON and SSE) -> RouterFrontend.submit(spec)
         -> messages.generate_request(spec) -> Router.generate (a prefill, then a decode server)
         -> the GenerateResponses turned back into the StepOutputs and RequestOutput openai_api
            renders

The prefill server tokenizes, checks and admits each request as it does the router's gRPC calls;
`submit` waits for the stream's first message, so its refusals (INVALID_ARGUMENT, RESOURCE_
EXHAUSTED, UNAVAILABLE) become the HTTP 400 / 429 / 503 a colocated server answers before any
body is sent. What the OpenAI shapes need on this side (logprobs' token texts, echo, /tokenize,
/detokenize) uses the model's tokenizer, loaded from the router's --model (tokenizer files only, no
weights); the prompt is tokenized here as well, and a count that differs from the prefill
server's fails the request naming both (the router was given another model's tokenizer).

The model's facts (name, context, vocabulary, output room, queue bound) are a prefill server's
ModelInfo: until one has answered, every path but /live and /metrics answers 503 warming_up, as a
warming server does. The caller's Authorization header goes on to the backends, as gRPC's does
(the same tenant and bearer token there).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from jaxserve.engine.request_check import render_chat, tokenize
from jaxserve.server import messages
from jaxserve.server.config import ServerConfig
from jaxserve.server.frontend import BoundedPool, ServingError, engine_prompt
from jaxserve.server.generation_service import ModelDescription
from jaxserve.server.openai_api.errors import RETRY_AFTER_S, ApiError
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.types import RequestMetrics, RequestOutput, CompletionOutput, StepOutput

log = logging.getLogger("jaxserve.router")

# The HTTP caller's Authorization header, set per request by RouterHttpApp (each ASGI request
# runs in a task of its own, so the handler below it reads its own caller's).
_authorization: contextvars.ContextVar[str | None] = contextvars.ContextVar("authorization", default=None)
_FINISH = {v: k for k, v in messages.FINISH_REASONS.items()}
_END = object()  # the router's stream ended


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """A prefill server's ModelInfo, what openai_api reads of a Frontend's engine."""

    model: str
    max_model_len: int
    vocab_size: int
    max_output_tokens: int
    max_queued_samples: int

    @classmethod
    def of(cls, info: pb.ModelInfoResponse) -> "ModelFacts":
        return cls(info.model, info.context_length, info.vocab_size, info.max_output_tokens,
                   info.max_queued_requests)


@dataclasses.dataclass(frozen=True)
class _Finished:
    output: RequestOutput


class RouterSubmission:
    def __init__(self, spec: messages.RequestSpec, prompt_ids: list[int]):
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.queue: asyncio.Queue = asyncio.Queue()  # GenerateResponses, then _END or an exception
        self.task: asyncio.Task | None = None
        self.first = None  # the message submit() waited for


class RouterFrontend:
    """What openai_api's routes and Serving use of a Frontend, over Router.generate."""

    def __init__(self, router, tokenizer, facts: ModelFacts, executor: ThreadPoolExecutor):
        self.router = router
        self.tokenizer = tokenizer
        self.facts = facts
        self.vocab_size = facts.vocab_size
        self.max_output_tokens = facts.max_output_tokens
        self.max_queued_samples = facts.max_queued_samples
        self.sched_config = facts  # routes read max_model_len
        self.pool = BoundedPool(executor, lambda tenant: router.metrics.rejections.labels("max_pool_backlog").inc(),
                                "the router's tokenizer pool")

    async def off_loop(self, fn, *args, tenant: str):
        """`fn(*args)` on the tokenizer pool, bounded as Frontend.off_loop is."""
        return await self.pool.run(fn, *args, tenant=tenant)

    def render_chat(self, msgs: list[dict[str, str]]) -> str:
        return render_chat(self.tokenizer, msgs)

    def _tokenize(self, spec: messages.RequestSpec) -> list[int]:
        return tokenize(engine_prompt(spec), self.tokenizer, spec.add_bos)[1]

    async def tokenize(self, spec: messages.RequestSpec) -> list[int]:
        return await self.off_loop(self._tokenize, spec, tenant=spec.tenant)

    async def submit(self, spec: messages.RequestSpec) -> RouterSubmission:
        """Send `spec` on; returns once the prefill server has streamed its first message (the
        request is accepted), raising its refusal otherwise. The caller must `close()` it."""
        request = messages.generate_request(spec)
        ids = spec.token_ids if spec.token_ids is not None else await self.tokenize(spec)
        sub = RouterSubmission(spec, list(ids))
        auth = _authorization.get()
        metadata = (("authorization", auth),) if auth else ()
        sub.task = asyncio.create_task(self._pump(sub, request, metadata))
        try:
            first = await sub.queue.get()
        except BaseException:  # the HTTP caller went away before the first message: end the call too
            sub.task.cancel()
            raise
        if isinstance(first, BaseException):
            raise first
        sub.first = first
        return sub

    async def _pump(self, sub: RouterSubmission, request: pb.GenerateRequest, metadata: tuple) -> None:
        try:
            async for msg in self.router.generate(request, metadata):
                sub.queue.put_nowait(msg)
            sub.queue.put_nowait(_END)
        except Exception as e:  # a ServingError naming the backend, raised to the handler by stream()
            sub.queue.put_nowait(e)

    async def stream(self, sub: RouterSubmission):
        """(deltas, None) per batch of relayed messages, then (deltas, finished) with the
        request's RequestOutput; a backend's failure raises its ServingError."""
        samples: dict[int, CompletionOutput] = {}
        want_lps = sub.spec.params.logprobs is not None
        while True:
            batch = [sub.first] if sub.first is not None else [await sub.queue.get()]
            sub.first = None
            while not sub.queue.empty():
                batch.append(sub.queue.get_nowait())
            deltas, last = [], None
            for item in batch:
                if isinstance(item, BaseException):
                    raise item
                if item is _END:
                    raise ServingError(grpc.StatusCode.INTERNAL, "the router's stream ended without the "
                                       "request's usage (a backend ended it early)", rejected=False)
                d = self._delta(item, want_lps)
                deltas.append(d)
                c = samples.setdefault(d.index, CompletionOutput(d.index, "", [], None, [] if want_lps else None))
                c.text += d.text
                c.token_ids += d.token_ids
                if d.logprobs:
                    c.logprobs += d.logprobs
                if d.finished:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                if item.HasField("usage"):
                    last = item
            if last is None:
                yield deltas, None
                continue
            yield deltas, _Finished(self._output(sub, samples, last))
            return

    @staticmethod
    def _delta(msg: pb.GenerateResponse, want_lps: bool) -> StepOutput:
        reason = _FINISH.get(msg.finish_reason)
        lps = messages.logprobs_from_proto(msg.logprobs) if want_lps and msg.token_ids else None
        return StepOutput(msg.request_id, msg.index, list(msg.token_ids), msg.text, lps, reason is not None,
                          reason, messages.stop_reason_of(msg))

    def _output(self, sub: RouterSubmission, samples: dict, last: pb.GenerateResponse) -> RequestOutput:
        counted = last.usage.prompt_tokens
        if counted != len(sub.prompt_ids):
            raise ServingError(grpc.StatusCode.INTERNAL,
                               f"the router's tokenizer made {len(sub.prompt_ids)} prompt tokens where the "
                               f"prefill server counted {counted}: start the router with the backends' --model",
                               rejected=False)
        prompt_lps = None
        if sub.spec.params.prompt_logprobs is not None:
            computed = messages.logprobs_from_proto(last.prompt_logprobs)
            prompt_lps = [None] + (computed if len(computed) == counted - 1 else [None] * (counted - 1))
        return RequestOutput(last.request_id, sub.spec.text, sub.prompt_ids,
                             [samples[i] for i in sorted(samples)], True, RequestMetrics(time.perf_counter()),
                             last.usage.cached_prompt_tokens, prompt_lps)

    def close(self, sub: RouterSubmission) -> None:
        """The handler is done: a call still running is cancelled, which cancels its backend
        call (Router.generate's `finally`), so the backend aborts it before its next step."""
        if sub.task is not None and not sub.task.done():
            sub.task.cancel()


class RouterHealth:
    """The probes' answers (routes.probe) from the router's own readiness."""

    def __init__(self, router):
        self.router = router

    def not_ready(self) -> tuple[str, str] | None:
        r = self.router
        if r.draining:
            return "draining", "the router is shutting down; retry on another one"
        if not r.ready:
            return "warming_up", ("no prefill server and decode server are both serving yet "
                                  f"({r.config.prefill_servers} / {r.config.decode_servers})")
        return None

    def not_live(self) -> tuple[str, str] | None:
        return None  # the router has no engine to fail; its process answering is its liveness


@dataclasses.dataclass
class _Facade:
    """The `server` routes.build_app takes."""

    frontend: RouterFrontend
    health: RouterHealth
    metrics: object
    description: ModelDescription
    config: ServerConfig


class RouterHttpApp:
    """The ASGI app on the router's HTTP port: the caller's Authorization header into the
    context, then openai_api's app once the model's facts are known (503 warming_up before)."""

    def __init__(self, router, tokenizer):
        self.router = router
        self.tokenizer = tokenizer
        self.app = None
        self._executor = ThreadPoolExecutor(router.config.tokenizer_threads, thread_name_prefix="jaxserve-tokenize")

    async def learn(self, backend) -> None:
        """Build the app from `backend`'s ModelInfo (a serving prefill server), once."""
        if self.app is not None:
            return
        from jaxserve.server.openai_api.routes import build_app
        try:
            info = await backend.generation.ModelInfo(pb.ModelInfoRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            log.warning("prefill server %s: ModelInfo failed (%s); the HTTP door stays warming up",
                        backend.address, e.details())
            return
        facts = ModelFacts.of(info)
        frontend = RouterFrontend(self.router, self.tokenizer, facts, self._executor)
        self.app = build_app(_Facade(frontend, RouterHealth(self.router), self.router.metrics,
                                     ModelDescription(facts.model), self.router.config))
        log.info("HTTP door open for %s (from %s's ModelInfo)", facts.model, backend.address)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        auth = dict(scope["headers"]).get(b"authorization")
        _authorization.set(auth.decode("latin-1") if auth else None)
        if self.app is not None:
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse, PlainTextResponse, Response
        if scope["path"] == "/live":
            response = PlainTextResponse("ok\n")
        elif scope["path"] == "/metrics":
            response = Response(self.router.metrics.exposition(), media_type="text/plain; version=0.0.4")
        else:
            err = ApiError(503, "the router has not yet heard the model's facts from a serving prefill server",
                           "service_unavailable", None, "warming_up", RETRY_AFTER_S)
            response = JSONResponse(err.body(), status_code=503, headers=err.headers())
        await response(scope, receive, send)
