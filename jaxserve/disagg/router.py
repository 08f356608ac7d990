"""The router of a disaggregated deployment (`jaxserve serve --role router --prefill-servers ...
--decode-servers ...`): the clients' jaxserve.v1.Generation front door, no model of its own.

    client ──Generate──> router ──Disagg.Prefill──> a prefill server: deltas (the first token),
                                                    then the KV ticket
                                ──Disagg.Decode───> a decode server: pulls the KV, streams on
           <──one stream, the client's request id, usage and the router's own timings──

Which engine: the prefill server that last ran the prompt's longest known prefix, whose prefix
cache likely still holds it (prefix_affinity.py), unless it has AFFINITY_SLACK_TOKENS more prompt
tokens in flight than the least loaded one; else the one with the fewest prompt tokens in flight
from this router (the router does not tokenize: a prompt's size is its token ids, or its
characters / 4); a decode server with the fewest requests in flight from this router; only
servers whose gRPC health says SERVING (polled every `HEALTH_PERIOD_S`). What a call keeps across the handover: the
stream (one client call, the router relays), cancellation (the router's handler is cancelled
and cancels its backend call, which aborts the request there before its next step, or drops
its pending pull), the deadline (each backend call gets the time the client has left), the
tenant (the client's `authorization` metadata is forwarded, so each server derives the same
tenant and checks the same token).

Faults: a prefill server that fails a call UNAVAILABLE before anything was streamed to the
client (it died, drained, or was warming up) is marked unhealthy and the call is retried on
another one; after that, and on a decode server, the client gets the backend's status with the
server named ("decode server localhost:5 failed mid-stream: ..."): nothing accepted ends
without a status. SIGTERM drains: readiness NOT_SERVING, new calls UNAVAILABLE, calls in flight
get the grace period.

Security: the router's own door takes the server flags (TLS, mTLS, bearer token); to its
backends it speaks TLS with --backend-tls-ca (mTLS with --backend-tls-cert / --backend-tls-key)
and forwards each client's bearer token, which every backend checks as its own door does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.config import ConfigError
from jaxserve.disagg.prefix_affinity import PrefixAffinity
from jaxserve.server.calls import FIELD_METADATA_KEY, generic_handler, streaming, unary
from jaxserve.server.config import ServerConfig
from jaxserve.server.frontend import ServingError
from jaxserve.server.proto import GENERATION_SERVICE
from jaxserve.server.proto import generation_grpc
from jaxserve.server.proto import generation_pb2 as pb
from jaxserve.server.security import TokenAuthInterceptor, channel_credentials, server_credentials

log = logging.getLogger("jaxserve.router")

HEALTH_PERIOD_S = 0.5
_FORWARDED = ("authorization",)  # metadata a backend needs to see as the client sent it


@dataclasses.dataclass(eq=False)
class Backend:
    role: str  # "prefill" | "decode"
    address: str
    healthy: bool = False
    inflight: int = 0
    inflight_tokens: int = 0

    def open(self, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.channel = (grpc.aio.insecure_channel(self.address) if credentials is None
                        else grpc.aio.secure_channel(self.address, credentials))
        self.disagg = generation_grpc.DisaggStub(self.channel)
        self.generation = generation_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


def prompt_size(req: pb.GenerateRequest) -> int:
    """The router's estimate of a prompt's tokens (it has no tokenizer)."""
    which = req.WhichOneof("input")
    if which == "prompt_token_ids":
        return len(req.prompt_token_ids.ids)
    if which == "messages":
        return sum(len(m.content) for m in req.messages.messages) // 4 + 1
    return len(req.prompt) // 4 + 1


class RouterMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "jaxserve_router_"
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival at the router to the first token.",
                              buckets=buckets, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival at the router to the last token.",
                             buckets=buckets, registry=r)
        self.handover_gap = Histogram(p + "handover_gap_seconds", "The prefill server's handover message to "
                                      "the decode server's first message (the KV transfer and admission, "
                                      "seen by the client as one long inter-token gap).", buckets=buckets,
                                      registry=r)
        self.inflight = Gauge(p + "backend_inflight", "Requests in flight per backend.", ["role", "backend"],
                              registry=r)
        self.healthy = Gauge(p + "backend_healthy", "1 while the backend's health says SERVING.",
                             ["role", "backend"], registry=r)
        self.finished = Counter(p + "finished_requests", "Requests ended, by outcome.", ["outcome"], registry=r)
        self.retries = Counter(p + "prefill_retries", "Calls retried on another prefill server.", registry=r)
        self.prefix_routed = Counter(p + "prefix_routed_requests", "Prefill servers chosen for holding the "
                                     "prompt's longest known prefix (prefix_affinity.py).", registry=r)
        self.rejections = Counter(p + "rejected_requests", "Requests refused, by reason.", ["reason"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Router:
    def __init__(self, config: ServerConfig, prefill: list[str], decode: list[str], tokenizer=None):
        if not prefill or not decode:
            raise ConfigError("prefill_servers: a router needs at least one prefill and one decode server "
                              f"(got {len(prefill)} prefill, {len(decode)} decode)")
        self.config = config
        self.backends = [Backend("prefill", a) for a in prefill] + [Backend("decode", a) for a in decode]
        self.metrics = RouterMetrics()
        for b in self.backends:  # every backend's series from the first scrape, not its first request
            self.metrics.inflight.labels(b.role, b.address).set(0)
            self.metrics.healthy.labels(b.role, b.address).set(0)
        self.draining = False
        self.inflight = 0
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._ids = itertools.count()
        self.affinity = PrefixAffinity()
        self.tokenizer = tokenizer  # the model's, for the HTTP door (router_http.py); gRPC needs none
        self.http = self.http_app = None
        self.http_port: int | None = None

    # ---- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        # TLS to the backends when a CA or a client certificate is given (mTLS with the latter);
        # a backend the handshake fails with never passes a health check, so never gets a call.
        creds = None
        if cfg.backend_tls_ca or cfg.backend_tls_cert:
            creds = channel_credentials(cfg.backend_tls_ca, cfg.backend_tls_cert, cfg.backend_tls_key)
        for b in self.backends:
            b.open(creds)
        interceptors = [TokenAuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes), ("grpc.so_reuseport", 0)]
        self.grpc_server = grpc.aio.server(interceptors=interceptors, options=options)
        self.grpc_server.add_generic_rpc_handlers((
            generic_handler(pb.DESCRIPTOR.services_by_name["Generation"], RouterService(self)),))
        self.health = grpc_health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection((GENERATION_SERVICE, grpc_health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), self.grpc_server)
        creds = server_credentials(cfg)
        try:
            self.port = (self.grpc_server.add_insecure_port(cfg.address) if creds is None
                         else self.grpc_server.add_secure_port(cfg.address, creds))
        except RuntimeError as e:
            raise ConfigError(f"port: cannot listen on {cfg.address}: {e}") from None
        if cfg.http_port is not None:
            await self._start_http()
        await self._publish()
        await self.grpc_server.start()
        if cfg.metrics_port is not None:
            from jaxserve.server.metrics_http import start_metrics_http
            self._metrics_http = start_metrics_http(self.metrics.registry, cfg.metrics_host, cfg.metrics_port)
            self.metrics_port = self._metrics_http.server_port
        self._watch = asyncio.create_task(self._watch_backends())

    async def _start_http(self) -> None:
        cfg = self.config
        if self.tokenizer is None:
            raise ConfigError("http_port: the router's OpenAI door needs the model's tokenizer "
                              "(serve loads it from --model)")
        from jaxserve.disagg.router_http import RouterHttpApp
        from jaxserve.server.openai_api.http_server import HttpFrontDoor
        self.http_app = RouterHttpApp(self, self.tokenizer)
        self.http = HttpFrontDoor(self.http_app, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key,
                                  cfg.tls_client_ca)
        self.http_port = self.http.port
        await self.http.start()

    @property
    def ready(self) -> bool:
        return not self.draining and all(any(b.healthy for b in self.backends if b.role == r)
                                         for r in ("prefill", "decode"))

    async def _publish(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)

    async def _watch_backends(self) -> None:
        while True:
            await asyncio.gather(*(self._check(b) for b in self.backends))
            if self.http_app is not None and self.http_app.app is None:
                serving = [b for b in self.backends if b.role == "prefill" and b.healthy]
                if serving:
                    await self.http_app.learn(serving[0])
            await self._publish()
            await asyncio.sleep(HEALTH_PERIOD_S)

    async def _check(self, b: Backend) -> None:
        try:
            r = await b.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(1.0, HEALTH_PERIOD_S))
            healthy = r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            healthy = False
        if healthy != b.healthy:
            log.info("%s server %s is %s", b.role, b.address, "in rotation" if healthy else "out of rotation")
        self.set_healthy(b, healthy)
        self.metrics.healthy.labels(b.role, b.address).set(int(healthy))

    async def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.ready:
            if time.monotonic() > end:
                return False
            await asyncio.sleep(0.05)
        return True

    async def drain(self, grace_s: float | None = None) -> None:
        self.draining = True
        await self._publish()
        end = time.monotonic() + (self.config.grace_period_s if grace_s is None else grace_s)
        while self.inflight and time.monotonic() < end:
            await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        self._watch.cancel()
        if self.http is not None:
            await self.http.stop()
            self.http_app.close()
        await self.grpc_server.stop(grace=0.5)
        for b in self.backends:
            await b.channel.close()
        if self.metrics_port is not None:
            self._metrics_http.shutdown()

    # ---- choosing ----------------------------------------------------------------------------

    def set_healthy(self, b: Backend, healthy: bool) -> None:
        if b.healthy and not healthy and b.role == "prefill":
            self.affinity.forget(b.address)  # it may come back restarted, its prefix cache empty
        b.healthy = healthy

    def pick(self, role: str, exclude=(), chain: list[int] | None = None) -> Backend:
        """A serving `role` server not in `exclude`; for prefill with the prompt's prefix `chain`
        (PrefixAffinity.chain), the prefix holder within the slack, recorded as this prompt's."""
        live = [b for b in self.backends if b.role == role and b.healthy and b not in exclude]
        if not live:
            raise ServingError(grpc.StatusCode.UNAVAILABLE, f"no {role} server is serving "
                               f"({sum(b.role == role for b in self.backends)} configured); retry later")
        if role != "prefill":
            return min(live, key=lambda b: b.inflight)
        b, matched = self.affinity.choose(chain or [], live, lambda b: (b.inflight_tokens, b.inflight))
        if matched:
            self.metrics.prefix_routed.inc()
        self.affinity.record(chain or [], b.address)
        return b

    def _enter(self, b: Backend, tokens: int) -> None:
        b.inflight += 1
        b.inflight_tokens += tokens
        self.metrics.inflight.labels(b.role, b.address).set(b.inflight)

    def _leave(self, b: Backend, tokens: int) -> None:
        b.inflight -= 1
        b.inflight_tokens -= tokens
        self.metrics.inflight.labels(b.role, b.address).set(b.inflight)

    # ---- one request ---------------------------------------------------------------------------

    async def generate(self, request: pb.GenerateRequest, metadata: tuple = (), time_left=lambda: None):
        """`request` through a prefill and a decode server: the GenerateResponses for its client
        (both front doors). `metadata`: what each backend call carries (the caller's
        authorization); `time_left()`: the caller's seconds left (None: no deadline)."""
        if self.draining:
            raise ServingError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down; retry on another one")
        for role in ("prefill", "decode"):  # both halves before any work: no prefill whose KV nobody takes
            if not any(b.healthy for b in self.backends if b.role == role):
                self.pick(role)  # raises UNAVAILABLE naming the role
        arrival = time.perf_counter()
        client_id = request.request_id or f"r{next(self._ids)}"
        size = prompt_size(request)
        chain = self.affinity.chain(request)
        self.inflight += 1
        outcome = "cancelled"
        first_at = handover_at = None
        relayed = 0
        try:
            tried: list[Backend] = []
            ticket = None
            while True:
                b = self.pick("prefill", tried, chain)
                tried.append(b)
                streamed = False
                self._enter(b, size)
                call = b.disagg.Prefill(request, timeout=time_left(), metadata=metadata)
                try:
                    async for msg in call:
                        if msg.HasField("handover"):
                            ticket, handover_at = msg.handover, time.perf_counter()
                            continue
                        d = msg.delta
                        d.request_id = client_id
                        if first_at is None and (d.token_ids or d.text):
                            first_at = time.perf_counter()
                            self.metrics.ttft.observe(first_at - arrival)
                        relayed += len(d.token_ids)
                        if d.HasField("usage"):  # finished during prefill: the stream's last
                            _timings(d, arrival, first_at)
                        streamed = True
                        yield d
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE and not streamed:
                        self.set_healthy(b, False)  # out of rotation until its health says otherwise
                        if any(x.healthy and x.role == "prefill" and x not in tried for x in self.backends):
                            self.metrics.retries.inc()
                            log.warning("prefill server %s: %s; retrying elsewhere", b.address, e.details())
                            continue
                    outcome = e.code().name.lower()
                    raise _backend_error(b, e, "failed" if not streamed else "failed mid-stream") from None
                finally:
                    call.cancel()
                    self._leave(b, size)
                break
            if ticket is not None:
                d = self.pick("decode")
                self._enter(d, 0)
                call = d.disagg.Decode(pb.DecodeRequest(handover=ticket), timeout=time_left(),
                                       metadata=metadata)
                try:
                    async for msg in call:
                        if handover_at is not None:
                            self.metrics.handover_gap.observe(time.perf_counter() - handover_at)
                            handover_at = None
                        msg.request_id = client_id
                        relayed += len(msg.token_ids)
                        if msg.HasField("usage"):  # the stream's last: the router's own clock
                            _timings(msg, arrival, first_at)
                            # Every token the client got: a sample that ended during prefill
                            # (n > 1) is not in the decode server's count.
                            msg.usage.completion_tokens = relayed
                            msg.usage.total_tokens = msg.usage.prompt_tokens + relayed
                        yield msg
                except grpc.aio.AioRpcError as e:
                    outcome = e.code().name.lower()
                    raise _backend_error(d, e, "failed mid-stream") from None
                finally:
                    call.cancel()
                    self._leave(d, 0)
            outcome = "ok"
            self.metrics.e2e.observe(time.perf_counter() - arrival)
        finally:
            self.inflight -= 1
            self.metrics.finished.labels(outcome).inc()


def _timings(msg, arrival: float, first_at: float | None) -> None:
    now = time.perf_counter()
    t = pb.Timings(e2e_s=now - arrival)
    if first_at is not None:
        t.ttft_s = first_at - arrival
    if msg.timings.HasField("tpot_s"):
        t.tpot_s = msg.timings.tpot_s  # the decode server's, which runs every later token
    msg.timings.CopyFrom(t)


def _backend_error(b: Backend, e: grpc.aio.AioRpcError, when: str) -> ServingError:
    field = dict(e.trailing_metadata() or ()).get(FIELD_METADATA_KEY)
    details = e.details() or ""
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the client's mistake: the server's words as they are
        return ServingError(e.code(), details, field)
    return ServingError(e.code(), f"{b.role} server {b.address} {when}: {details}", field, rejected=False)


class RouterService:
    """jaxserve.v1.Generation over the router's backends."""

    def __init__(self, router: Router):
        self.router = router
        self.metrics = router.metrics  # calls.py counts refusals here

    @staticmethod
    def _metadata(context) -> tuple:
        return tuple((k, v) for k, v in context.invocation_metadata() if k in _FORWARDED)

    async def _stream(self, request, context):
        async for msg in self.router.generate(request, self._metadata(context), context.time_remaining):
            yield msg

    @streaming
    async def Generate(self, request, context):
        async for msg in self._stream(request, context):
            yield msg

    @unary
    async def GenerateUnary(self, request, context):
        completions: dict[int, pb.Completion] = {}
        last = None
        async for msg in self._stream(request, context):
            c = completions.setdefault(msg.index, pb.Completion(index=msg.index))
            c.text += msg.text
            c.token_ids.extend(msg.token_ids)
            c.logprobs.extend(msg.logprobs)
            if msg.finish_reason:
                c.finish_reason = msg.finish_reason
            last = msg
        out = pb.GenerateUnaryResponse(request_id=last.request_id if last else request.request_id,
                                       completions=[completions[i] for i in sorted(completions)])
        if last is not None:
            out.usage.CopyFrom(last.usage)
            out.timings.CopyFrom(last.timings)
            out.prompt_logprobs.extend(last.prompt_logprobs)
        return out

    async def _forward(self, method: str, request, context):
        b = self.router.pick("prefill")
        try:
            return await getattr(b.generation, method)(request, timeout=context.time_remaining(),
                                                       metadata=self._metadata(context))
        except grpc.aio.AioRpcError as e:
            raise _backend_error(b, e, "failed") from None

    @unary
    async def Tokenize(self, request, context):
        return await self._forward("Tokenize", request, context)

    @unary
    async def Detokenize(self, request, context):
        return await self._forward("Detokenize", request, context)

    @unary
    async def ModelInfo(self, request, context):
        return await self._forward("ModelInfo", request, context)


def serve_router(config: ServerConfig, announce, tokenizer=None) -> int:
    """`jaxserve serve --role router`: in the foreground until SIGTERM / SIGINT, then drain."""
    import signal

    async def main() -> int:
        router = Router(config, config.addresses("prefill_servers"), config.addresses("decode_servers"),
                        tokenizer)
        await router.start()
        announce(f"jaxserve: listening on {config.host}:{router.port} (router over "
                 f"{config.prefill_servers} prefill, {config.decode_servers} decode)"
                 + (f", OpenAI HTTP on :{router.http_port}" if router.http_port is not None else "")
                 + (f", metrics on :{router.metrics_port}/metrics" if router.metrics_port else ""))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        async def report_ready() -> None:
            while not stop.is_set():
                if await router.wait_ready(3600):
                    announce("jaxserve: ready")
                    return
        ready = asyncio.create_task(report_ready())
        await stop.wait()
        ready.cancel()
        announce(f"jaxserve: draining (grace period {config.grace_period_s:g} s)")
        await router.drain()
        announce("jaxserve: stopped")
        return 0

    return asyncio.run(main())
