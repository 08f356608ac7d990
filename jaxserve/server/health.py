"""Readiness and liveness, published through the standard grpc.health.v1 service.

    readiness  services "", "jaxserve.v1.Generation", "jetstream_proto.Orchestrator"
               SERVING only when warm, not draining, the engine not failed, no step stalled and
               no step fault since the last step that ran (degraded: engine/faults.py)
    liveness   service "liveness"
               NOT_SERVING only when the engine failed, its thread died or a step stalled:
               a restart is the cure. Warm-up and drain are healthy states of a live process.

HTTP (openai_api/routes.py) answers the same two: `/health` (and its alias `/ready`) is
readiness, as vLLM's and TGI's /health are (200 only once a completion sent now would be
accepted; else 503 with `not_ready()`'s reason), and `/live` is liveness.

The flags change on the event loop thread (engine events arrive there, the watchdog runs there)
and `publish()` pushes the derived statuses to the health servicer, whose Watch streams see
every change. `unavailable_reason()` is what generation calls get as UNAVAILABLE details;
a stalled step does not refuse calls (they queue), it only tells load balancers to go elsewhere.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from jaxserve.server.proto import GENERATION_SERVICE, JETSTREAM_SERVICE

READINESS_SERVICES = ("", GENERATION_SERVICE, JETSTREAM_SERVICE)
LIVENESS_SERVICE = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthState:
    def __init__(self):
        self.servicer = health_aio.HealthServicer()
        self.warming = True
        self.draining = False
        self.failed: str | None = None
        self.stalled = False
        self.degraded: str | None = None  # a recoverable step fault, until a step runs again
        self._published: dict[str, int] = {}

    @property
    def ready(self) -> bool:
        return not (self.warming or self.draining or self.failed or self.stalled or self.degraded)

    @property
    def live(self) -> bool:
        return not (self.failed or self.stalled)

    def unavailable_reason(self) -> str | None:
        if self.failed:
            return f"the engine failed ({self.failed}); the server must be restarted"
        if self.draining:
            return "the server is shutting down; retry on another replica"
        if self.warming:
            return "the server is warming up (compiling the step buckets); retry shortly"
        return None

    def not_ready(self) -> tuple[str, str] | None:
        """Why readiness is NOT_SERVING, as (code, message), or None when ready. The first three
        are also why generation calls are refused (`unavailable_reason`); a stall and a
        recovered-from step fault only send load balancers elsewhere."""
        reason = self.unavailable_reason()
        if self.failed:
            return "engine_failed", reason
        if self.draining:
            return "draining", reason
        if self.warming:
            return "warming_up", reason
        if self.stalled:
            return "stalled", "an engine step has run past the stall timeout; requests queue until it ends"
        if self.degraded:
            return "degraded", f"an engine step failed ({self.degraded}); ready again once a step runs"
        return None

    def not_live(self) -> tuple[str, str] | None:
        """Why liveness is NOT_SERVING, as (code, message), or None while live."""
        if self.failed:
            return "engine_failed", self.unavailable_reason()
        if self.stalled:
            return "stalled", "an engine step has run past the stall timeout; restart the server"
        return None

    async def publish(self) -> None:
        statuses = {s: SERVING if self.ready else NOT_SERVING for s in READINESS_SERVICES}
        statuses[LIVENESS_SERVICE] = SERVING if self.live else NOT_SERVING
        for service, status in statuses.items():
            if self._published.get(service) != status:
                self._published[service] = status
                await self.servicer.set(service, status)

    def changed(self) -> None:
        """Publish soon (from synchronous code on the event loop)."""
        asyncio.get_running_loop().create_task(self.publish())
