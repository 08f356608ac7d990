"""The FastAPI app: OpenAI's endpoints, vLLM's /tokenize and /detokenize, health and metrics.

    GET  /v1/models                 the served model
    POST /v1/completions            OpenAI completions (stream: SSE ending `data: [DONE]`)
    POST /v1/chat/completions       OpenAI chat completions (the model's chat template)
    POST /tokenize, /detokenize     vLLM's shapes
    GET  /health                    readiness, as vLLM's and TGI's: the gRPC health service's ""
                                    status; 200 only once warm and while not draining, not failed,
                                    not stalled; else 503 with an OpenAI error body whose `code`
                                    says why (warming_up, draining, engine_failed, stalled,
                                    degraded). So a client that polls /health until 200 and then
                                    sends is never refused 503 by warm-up.
    GET  /ready                     an alias of /health
    GET  /live                      liveness, the gRPC service "liveness": 200 while the process is
                                    up and its engine thread alive, warm-up and drain included; 503
                                    once the engine failed unrecoverably, its thread died or a step
                                    stalled past --stall-timeout (a restart is the cure)
    GET  /metrics                   the same Prometheus registry as --metrics-port

The probes also answer HEAD. Auth: with a token configured every path but /health, /ready,
/live and /metrics needs
`Authorization: Bearer <token>` (security.bearer_problem, the rule gRPC's interceptor uses); the
probes are exempt as gRPC's health service is. Every error body is OpenAI's
`{"error": {"message", "type", "param", "code"}}` (Starlette's own 404 and 405 too);
request-shape errors (pydantic) are 400s naming the field's path, never FastAPI's default 422.
/openapi.json says all of it (openapi.py).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxserve.types import MAX_N, MAX_PROMPT_CHARS
from jaxserve.server.calls import _REJECTION_REASONS
from jaxserve.server.frontend import ServingError
from jaxserve.server.openai_api import openapi, protocol
from jaxserve.server.openai_api.errors import RETRY_AFTER_S, ApiError
from jaxserve.server.openai_api.serving import DONE, Serving, _sse
from jaxserve.server.security import bearer_problem
from jaxserve.server.tenancy import tenant_of_http
from jaxserve.types import TokenizerError
from jaxserve.types import InvalidRequestError

OPEN_PATHS = ("/health", "/ready", "/live", "/metrics")


def _field_path(errs: list[dict]) -> str:
    """The field an error names: the path all of the first field's errors share (a union type
    reports one error per member, whose paths end in the member's type name)."""
    if not errs:
        return "body"
    first = tuple(errs[0].get("loc", ()))
    same = [tuple(e.get("loc", ())) for e in errs if tuple(e.get("loc", ()))[:2] == first[:2]]
    common = []
    for parts in zip(*same):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    parts = [str(p) for p in common if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class _Guard:
    """Pure ASGI (not BaseHTTPMiddleware, which would get between a stream and its client's
    disconnect): the bearer token and the body-size bound, before anything is parsed.

    A body with a Content-Length over the bound is refused from the header. A body without one
    (`Transfer-Encoding: chunked`) is read here, counting bytes, and refused as soon as it passes
    the bound (so a client cannot stream an unbounded body into the JSON parser); a body within
    it is handed on, followed by the client's later messages (its disconnect)."""

    def __init__(self, app, token: str | None, max_body: int, metrics):
        self.app, self.token, self.max_body, self.metrics = app, token, max_body, metrics

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, f"request body of {size} bytes exceeds the limit of {self.max_body} "
                             f"(max_message_bytes)", "invalid_request_error", "body")

    async def _read_capped(self, receive) -> list[dict] | None:
        """The body's messages, or None once more than max_body bytes arrived."""
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                return messages  # a disconnect: the app will see it
            size += len(msg.get("body", b""))
            if size > self.max_body:
                return None
            if not msg.get("more_body", False):
                return messages

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        err = None
        if self.token and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization")
            problem = bearer_problem(self.token, got)
            if problem is not None:
                self.metrics.rejections.labels("unauthenticated").inc()
                err = ApiError(401, problem, "authentication_error", None, "invalid_api_key")
        length = dict(scope["headers"]).get(b"content-length")
        if err is None and length is not None and length.isdigit() and int(length) > self.max_body:
            err = self._too_large(str(int(length)))
        if err is None and length is None:
            read = await self._read_capped(receive)
            if read is None:
                err = self._too_large(f"more than {self.max_body}")
            else:
                receive = _replay(read, receive)
        if err is None:
            return await self.app(scope, receive, send)
        await _error_response(err)(scope, receive, send)


def _replay(messages: list[dict], receive):
    """An ASGI receive that returns `messages` first, then the client's own."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()
    return replayed


def build_app(server) -> FastAPI:
    """`server`: the started jaxserve.server.app.Server whose frontend, health and metrics
    this app shares."""
    frontend, health, metrics = server.frontend, server.health, server.metrics
    model_name = server.description.model
    serving = Serving(frontend, model_name)
    token = server.config.auth_token
    max_body = server.config.max_message_bytes
    created = int(time.time())
    app = FastAPI(title="jaxserve OpenAI-compatible API", version=_version(),
                  docs_url=None, redoc_url=None)

    def reject(err: ApiError, code=None) -> JSONResponse:
        if code is not None:
            metrics.rejections.labels(_REJECTION_REASONS.get(code, code.name.lower())).inc()
        return _error_response(err)

    app.add_middleware(_Guard, token=token, max_body=max_body, metrics=metrics)
    openapi.install(app, model=model_name, vocab_size=frontend.vocab_size,
                    max_tokens=frontend.max_output_tokens,
                    max_samples=min(MAX_N, frontend.max_queued_samples), bearer=bool(token),
                    open_paths=OPEN_PATHS)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        # Starlette's own: an unknown path (404), a method the path does not take (405, Allow).
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, exc.detail, type_).body(), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_shape_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid body"}
        field = _field_path(list(errs))
        metrics.rejections.labels("invalid_argument").inc()
        return _error_response(ApiError.invalid(field, f"{field}: {first.get('msg')}"))

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(ServingError)
    async def on_serving_error(request: Request, exc: ServingError):
        if exc.rejected:
            metrics.rejections.labels(_REJECTION_REASONS.get(exc.code, exc.code.name.lower())).inc()
        return _error_response(ApiError.from_serving(exc))

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError):
        metrics.rejections.labels("invalid_argument").inc()
        return _error_response(ApiError.invalid(exc.field, str(exc)))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{model_name!r}", "not_found_error", "model", "model_not_found")

    async def until_disconnect(request: Request, work):
        """Run `work`; if the client disconnects first, cancel it (its `finally` aborts the
        engine request). Bodies are read before this, so `receive` only reports a disconnect."""
        task = asyncio.ensure_future(work)

        async def watch():
            while True:
                if (await request.receive())["type"] == "http.disconnect":
                    return
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            watcher.cancel()
        if task.cancelled():
            return Response(status_code=499)  # nobody is listening; for the access log only
        return task.result()

    def stream(gen) -> StreamingResponse:
        async def body():
            try:
                async for piece in gen:
                    yield piece
            except ServingError as e:  # an accepted request failed after the stream began
                yield _sse(ApiError.from_serving(e).body())
                yield DONE
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/v1/models", responses=openapi.MODELS_RESPONSES)
    async def models():
        sc = frontend.sched_config
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxserve", "root": model_name,
                                            "max_model_len": sc.max_model_len}]}

    async def generate(req, request: Request, handler):
        # Both generation endpoints: the model named, the caller's tenant, then SSE or one body.
        check_model(req.model)
        result = handler(req, tenant_of_http(request.headers))
        if req.stream:
            return stream(await result)
        return await until_disconnect(request, result)

    @app.post("/v1/completions", responses=openapi.generation(openapi.Completion))
    async def completions(req: protocol.CompletionRequest, request: Request):
        return await generate(req, request, serving.completions)

    @app.post("/v1/chat/completions", responses=openapi.generation(openapi.Completion))
    async def chat(req: protocol.ChatCompletionRequest, request: Request):
        return await generate(req, request, serving.chat)

    @app.post("/tokenize", responses=openapi.TOKENIZE_RESPONSES)
    async def tokenize(req: protocol.TokenizeRequest, request: Request):
        check_model(req.model)
        from jaxserve.server.messages import RequestSpec
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt", "exactly one of prompt or messages is required")
        if req.prompt is not None:
            text = req.prompt
        else:
            msgs = protocol.chat_messages(req.messages)
            if sum(len(m["content"]) for m in msgs) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("messages", f"content exceeds the limit of {MAX_PROMPT_CHARS} characters")
            text = frontend.render_chat(msgs)
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidRequestError("prompt", f"{len(text)} characters exceeds the limit of {MAX_PROMPT_CHARS}")
        spec = RequestSpec(None, text=text, tenant=tenant_of_http(request.headers))
        ids = await frontend.tokenize(spec) if text else []
        return {"count": len(ids), "max_model_len": frontend.sched_config.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=openapi.DETOKENIZE_RESPONSES)
    async def detokenize(req: protocol.DetokenizeRequest):
        check_model(req.model)
        tok = frontend.tokenizer
        try:
            tok.check_ids(req.tokens)
        except TokenizerError as e:
            raise InvalidRequestError("tokens", str(e)) from None
        text = await asyncio.get_running_loop().run_in_executor(None, tok.decode, req.tokens)
        return {"prompt": text}

    def probe(problem: tuple[str, str] | None) -> Response:
        if problem is None:
            return PlainTextResponse("ok\n")
        code, message = problem
        # Retry-After only where this replica itself will come back (draining and a failed
        # engine end with the process).
        retry = RETRY_AFTER_S if code in ("warming_up", "stalled", "degraded") else None
        return _error_response(ApiError(503, message, "service_unavailable", None, code, retry))

    async def ready():
        return probe(health.not_ready())

    async def live():
        return probe(health.not_live())

    for path, endpoint in (("/health", ready), ("/ready", ready), ("/live", live)):
        for method in ("GET", "HEAD"):
            app.add_api_route(path, endpoint, methods=[method], response_class=PlainTextResponse,
                              responses=openapi.PROBE_RESPONSES)

    @app.get("/metrics", response_class=openapi.PrometheusResponse, responses=openapi.METRICS_RESPONSES)
    async def prom():
        return openapi.PrometheusResponse(metrics.exposition())

    return app


def _version() -> str:
    import jaxserve
    return jaxserve.__version__
