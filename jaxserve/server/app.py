"""The server, wired: gRPC on an asyncio event loop, the engine on its own thread.

Threads of one server:
    event loop (whoever awaits `Server.start()`): gRPC calls, Frontend, health, watchdog
    jaxserve-engine (EngineLoop): warm-up, then add / abort / step; the only user of the engine
    jaxserve-tokenize (a small pool): tokenization and chat templates, off the event loop
    prometheus_client's HTTP thread, when a metrics port is set

Life cycle:
    start()  bind, publish health (readiness NOT_SERVING), start the engine thread, which warms
             up (compiles every bucket) and reports "warm": readiness turns SERVING
    drain()  readiness NOT_SERVING at once, new generation calls UNAVAILABLE, in-flight calls get
             `grace_period_s` to finish; what is left then ends UNAVAILABLE (retry elsewhere);
             then stop()
    stop()   stop gRPC and the engine thread

`BackgroundServer` runs a Server on an event loop of its own thread (tests, benchmarks,
notebooks); `serve()` runs one in the foreground until SIGTERM / SIGINT and drains it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import ConfigError
from jaxserve.server.admin_service import AdminService
from jaxserve.server.backpressure import QueueLimiter
from jaxserve.server.calls import generic_handler
from jaxserve.server.config import ServerConfig
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.loop_events import LoopStatus
from jaxserve.server.frontend import Frontend
from jaxserve.server.generation_service import GenerationService, ModelDescription
from jaxserve.server.health import HealthState
from jaxserve.server.jetstream_service import OrchestratorService
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.vllm_metrics import register_vllm_names
from jaxserve.server.proto import (ADMIN_SERVICE, GENERATION_SERVICE, JETSTREAM_SERVICE, generation_pb2,
                                   jetstream_pb2)
from jaxserve.server.security import TokenAuthInterceptor, server_credentials

log = logging.getLogger("jaxserve.server")


class Server:
    def __init__(self, engine, config: ServerConfig | None = None,
                 description: ModelDescription | None = None, on_step=None, kv_port=None,
                 extra_services=()):
        self.engine = engine
        # Disaggregated roles (jaxserve/disagg/ builds both): the engine loop's KV port, and
        # more gRPC services, each `(server) -> (generic handler, service name)`.
        self.kv_port = kv_port
        self._extra_services = tuple(extra_services)
        self.config = config or ServerConfig()
        self.description = description or ModelDescription()
        self._on_step = on_step
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.http = None
        self._stopped = False
        self._drain_deadline: float | None = None

    @property
    def security(self) -> str:
        c = self.config
        tls = "mutual TLS" if c.tls_client_ca else "TLS" if c.tls_cert else "plaintext"
        return tls + (", bearer token" if c.auth_token else "")

    async def start(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self.metrics = ServerMetrics()
        register_vllm_names(self.metrics, self.description.model)
        self.health = HealthState()
        self.fatal = asyncio.Event()  # set once the engine cannot serve again: `serve` exits 1
        self.limiter = QueueLimiter(cfg.max_queued_requests, cfg.max_queued_tokens)
        self._executor = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="jaxserve-tokenize")
        self.engine_loop = EngineLoop(self.engine, self.limiter, self._from_engine_thread,
                                      warmup=cfg.warmup, progress=cfg.progress, metrics=self.metrics,
                                      on_step=self._on_step,
                                      max_step_faults=cfg.max_consecutive_step_faults,
                                      kv_port=self.kv_port)
        self.frontend = Frontend(self.engine_loop, self.limiter, self.metrics, self._executor,
                                 self.health.unavailable_reason)
        if cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None:
            from jaxserve.engine import SloAdmission
            sc = self.engine.scheduler_config
            ms = lambda v: None if v is None else v / 1000  # noqa: E731
            self.engine_loop.slo = SloAdmission(ms(cfg.slo_ttft_ms), tuple(self.engine.runner.buckets),
                                                sc.max_num_batched_tokens, ms(cfg.slo_tpot_ms))
            self.engine_loop.slo.size_steps(self.engine.scheduler)  # caps for the first step too
        if cfg.tenant_limits.any:
            from jaxserve.engine import TenantQuotas
            self.frontend.quotas = TenantQuotas(cfg.tenant_limits)
        self.grpc_server = None
        if cfg.grpc_enabled:
            await self._start_grpc()
        await self.health.publish()
        if cfg.http_port is not None:  # the OpenAI-compatible API, on this same event loop
            from jaxserve.server.openai_api.http_server import HttpFrontDoor
            from jaxserve.server.openai_api.routes import build_app
            self.http = HttpFrontDoor(build_app(self), cfg.host, cfg.http_port, cfg.tls_cert,
                                      cfg.tls_key, cfg.tls_client_ca)
            self.http_port = self.http.port
            await self.http.start()
        if cfg.metrics_port is not None:
            self._metrics_http = self.metrics.start_http(cfg.metrics_host, cfg.metrics_port)
            self.metrics_port = self._metrics_http.server_port
        self.engine_loop.start()
        self._watchdog = asyncio.create_task(self._watch())
        self._stats_log = None
        if cfg.stats_log_interval_s:  # the periodic one-line stats log (stats_log.py)
            from jaxserve.server import stats_log
            self._stats_log = asyncio.create_task(stats_log.run(self.metrics, cfg.stats_log_interval_s))

    async def _start_grpc(self) -> None:
        cfg = self.config
        interceptors = []
        if cfg.auth_token:
            interceptors.append(TokenAuthInterceptor(
                cfg.auth_token, on_reject=lambda: self.metrics.rejections.labels("unauthenticated").inc()))
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # a port already in use must fail, not be shared
        self.grpc_server = grpc.aio.server(interceptors=interceptors, options=options)
        self.grpc_server.add_generic_rpc_handlers((
            generic_handler(generation_pb2.DESCRIPTOR.services_by_name["Generation"],
                            GenerationService(self.frontend, self.description)),
            generic_handler(jetstream_pb2.DESCRIPTOR.services_by_name["Orchestrator"],
                            OrchestratorService(self.frontend, self.health)),
            generic_handler(generation_pb2.DESCRIPTOR.services_by_name["Admin"],
                            AdminService(self.engine_loop, self.metrics)),
        ))
        extra = [make(self) for make in self._extra_services]
        if extra:
            self.grpc_server.add_generic_rpc_handlers(tuple(h for h, _ in extra))
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.grpc_server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, ADMIN_SERVICE, JETSTREAM_SERVICE, *(name for _, name in extra),
             grpc_health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.grpc_server)
        creds = server_credentials(cfg)
        try:
            if creds is None:
                self.port = self.grpc_server.add_insecure_port(cfg.address)
            else:
                self.port = self.grpc_server.add_secure_port(cfg.address, creds)
        except RuntimeError as e:  # grpc says only "Failed to bind"
            raise ConfigError(f"port: cannot listen on {cfg.address} (in use, or not an address "
                              f"of this machine): {e}") from None
        await self.grpc_server.start()

    # ---- engine events ---------------------------------------------------------------------

    def _from_engine_thread(self, batch: list) -> None:
        """On the engine thread: hand the batch to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, batch)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _dispatch(self, batch: list) -> None:
        statuses = [e for e in batch if isinstance(e, LoopStatus)]
        self.frontend.dispatch([e for e in batch if not isinstance(e, LoopStatus)])
        for st in statuses:
            if st.kind == "warm":
                self.health.warming = False
                log.info("ready")
            elif st.kind == "degraded":
                self.health.degraded = st.detail or "a step failed"
                log.warning("engine step fault (requests to blame failed, serving on): %s", st.detail)
            elif st.kind == "recovered":
                self.health.degraded = None
                log.info("engine recovered from the step fault")
            elif st.kind == "failed":
                self.health.failed = st.detail
                # The engine already failed every request it knew of (earlier in this batch);
                # anything accepted since would wait on an engine that no longer steps.
                self.frontend.fail_all(grpc.StatusCode.UNAVAILABLE,
                                       f"the engine failed ({st.detail}); the server must be restarted")
                self.fatal.set()
        if statuses:
            self.health.changed()

    async def _watch(self) -> None:
        """A dead engine thread or a stalled step turns health NOT_SERVING (and back, for a stall
        that ends)."""
        period = min(1.0, self.config.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            el = self.engine_loop
            if not el.alive and self.health.failed is None:
                self.health.failed = "the engine thread died"
                self.frontend.fail_all(grpc.StatusCode.INTERNAL, "the engine thread died")
                self.fatal.set()
            started = el.step_started_at
            stalled = started is not None and time.monotonic() - started > self.config.stall_timeout_s
            if stalled != self.health.stalled:
                self.health.stalled = stalled
                log.warning("engine step %s", "stalled" if stalled else "resumed")
            await self.health.publish()

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """True once warm; False if the engine failed first or `timeout` passed."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.health.ready:
            if self.health.failed or (end is not None and time.monotonic() > end):
                return False
            await asyncio.sleep(0.02)
        return True

    # ---- shutdown --------------------------------------------------------------------------

    async def drain(self, grace_s: float | None = None) -> None:
        grace = self.config.grace_period_s if grace_s is None else grace_s
        self.health.draining = True
        await self.health.publish()
        self._drain_deadline = time.monotonic() + grace
        while self.frontend.inflight and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.02)
        end = time.monotonic() + 5.0
        while self.frontend.inflight and time.monotonic() < end:
            self.frontend.fail_all(grpc.StatusCode.UNAVAILABLE,
                                   f"the server shut down before this request finished (grace period "
                                   f"{grace:g} s); retry on another replica")
            await asyncio.sleep(0.02)
        await self.stop()

    def cut_drain_short(self) -> None:
        self._drain_deadline = time.monotonic()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._watchdog.cancel()
        if getattr(self, "_stats_log", None) is not None:
            self._stats_log.cancel()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=0.5)
        if self.http is not None:
            await self.http.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop, 10.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.metrics_port is not None:
            self._metrics_http.shutdown()


class BackgroundServer:
    """A Server on its own event-loop thread; `with BackgroundServer(engine, cfg) as s: s.address`."""

    def __init__(self, engine, config: ServerConfig | None = None, **server_kw):
        self.server = Server(engine, config, **server_kw)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-grpc", daemon=True)

    def start(self, ready_timeout: float | None = 60.0) -> "BackgroundServer":
        self._thread.start()
        self.call(self.server.start())
        if ready_timeout is not None and not self.call(self.server.wait_ready(ready_timeout)):
            raise RuntimeError(f"server not ready after {ready_timeout} s "
                               f"(failed: {self.server.health.failed})")
        return self

    def call(self, coro, timeout: float | None = None):
        """Run a coroutine on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call_soon(self, fn, *args) -> None:
        self._loop.call_soon_threadsafe(fn, *args)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        host = self.server.config.host
        return f"{'localhost' if host in ('127.0.0.1', '::1') else host}:{self.port}"

    def drain(self, grace_s: float | None = None) -> None:
        self.call(self.server.drain(grace_s))
        self._shutdown_loop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call(self.server.stop())
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "BackgroundServer":
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc) -> None:
        self.stop()


def announce_line(line: str) -> None:
    # One write with its newline: print() writes the two apart, and a log line from the engine
    # thread (stderr, often the same pipe) landing between them broke scripts reading "listening".
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(engine, config: ServerConfig, description: ModelDescription | None = None,
          announce=announce_line, **server_kw) -> int:
    """Serve in the foreground until SIGTERM / SIGINT, then drain (a second signal cuts the grace
    period short). `announce` gets one line per state change (scripts wait for "ready");
    `server_kw` go to Server (a disaggregated role's kv_port and extra_services)."""

    async def main() -> int:
        server = Server(engine, config, description, **server_kw)
        await server.start()
        if server.port is not None:
            line = f"jaxserve: listening on {config.host}:{server.port} ({server.security})"
            if config.role != "colocated":
                line += f", role {config.role}"
            if server.http_port is not None:
                line += f", OpenAI HTTP API on {config.host}:{server.http_port}"
        else:
            line = (f"jaxserve: listening on {config.host}:{server.http_port} (OpenAI HTTP API only; "
                    f"{server.security})")
        announce(line + (f", metrics on :{server.metrics_port}/metrics" if server.metrics_port else ""))
        if not config.is_loopback and not config.auth_token and not config.tls_cert:
            announce("jaxserve: warning: listening beyond loopback without TLS or a token")
        stop = asyncio.Event()

        def on_signal(name: str) -> None:
            if stop.is_set():
                announce(f"jaxserve: {name} again: cutting the grace period short")
                server.cut_drain_short()
                return
            announce(f"jaxserve: {name}: draining (grace period {config.grace_period_s:g} s)")
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig.name)

        failed: list[str] = []

        async def report_ready() -> None:
            if await server.wait_ready():
                announce("jaxserve: ready")

        async def watch_fatal() -> None:
            # The engine cannot serve again (a failed warm-up, a dead engine thread, or an
            # unrecoverable step fault: engine/faults.py). Every request has been ended and
            # liveness says NOT_SERVING; exit non-zero at once so a supervisor restarts us.
            await server.fatal.wait()
            what = "engine failed during warm-up" if server.health.warming else "unrecoverable engine fault"
            announce(f"jaxserve: error: {what}: {server.health.failed}; exiting")
            failed.append(server.health.failed)
            stop.set()
        ready = asyncio.create_task(report_ready())
        fatal = asyncio.create_task(watch_fatal())
        await stop.wait()
        ready.cancel()
        await server.drain(0.0 if failed else None)
        fatal.cancel()
        announce("jaxserve: stopped")
        return 1 if failed else 0

    return asyncio.run(main())
