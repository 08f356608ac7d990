"""jaxserve.v1.Disagg on a prefill or a decode server (`serve --role prefill|decode`): the two
calls a router makes (generation.proto says what each streams).

    Prefill  GenerateRequest -> Frontend.submit(hand_over=True): the usual checks, queue, tenant
             and deltas; the request's HandedOver event becomes the stream's last message, the
             ticket of its KV (port.py).
    Decode   KVHandover -> Frontend.submit_handover: the pull and the import on the engine
             thread, then the rest of the stream as Generate's.

A server answers only its own role's call (FAILED_PRECONDITION otherwise), so a router given the
wrong address fails loudly. Cancellation and deadlines are Generate's: the handler's `finally`
closes the submission, which aborts the request (or drops its pending pull) before the next step.
"""

from __future__ import annotations

import grpc

from jaxserve.disagg.port import TransferPort
from jaxserve.server import tenancy
from jaxserve.server.calls import generic_handler, streaming, why_left
from jaxserve.server.loop_events import HandedOver
from jaxserve.server.frontend import ServingError
from jaxserve.server.generation_service import GenerationService, stream_messages
from jaxserve.server.proto import DISAGG_SERVICE
from jaxserve.server.proto import generation_pb2 as pb

ROLES = ("prefill", "decode")


class DisaggService:
    def __init__(self, server, role: str):
        if role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {role!r}")
        self.role = role
        self.frontend = server.frontend
        self.metrics = server.metrics
        self._generation = GenerationService(server.frontend, server.description)

    def _only(self, role: str) -> None:
        if self.role != role:
            raise ServingError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this server's role is {self.role}; {role} calls go to a --role {role} server",
                               rejected=True)

    @streaming
    async def Prefill(self, request, context):
        self._only("prefill")
        spec = await self._generation._spec(request, context)
        sub = await self.frontend.submit(spec, hand_over=True)
        try:
            async for deltas, end in self.frontend.stream(sub):
                handed = isinstance(end, HandedOver)
                for m in stream_messages(deltas, None if handed else end, sub.client_id):
                    yield pb.PrefillResponse(delta=m)
                if handed:
                    yield pb.PrefillResponse(handover=end.ticket)
        finally:
            self.frontend.close(sub, why_left(context))

    @streaming
    async def Decode(self, request, context):
        self._only("decode")
        incoming = TransferPort.incoming(request.handover)
        sub = self.frontend.submit_handover(incoming, tenancy.tenant_of(context))
        client_id = incoming.handover.request_id  # this server's own id; the router keeps the caller's
        try:
            async for deltas, finished in self.frontend.stream(sub):
                for m in stream_messages(deltas, finished, client_id):
                    yield m
        finally:
            self.frontend.close(sub, why_left(context))


def service_factory(role: str):
    """`Server(extra_services=...)`'s entry for this role."""
    def make(server):
        desc = pb.DESCRIPTOR.services_by_name["Disagg"]
        return generic_handler(desc, DisaggService(server, role)), DISAGG_SERVICE
    return make
