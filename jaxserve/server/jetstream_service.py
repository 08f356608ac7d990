"""jetstream_proto.Orchestrator: JetStream's Decode and HealthCheck over jaxserve's engine.

Decode goes through the same Frontend as jaxserve.v1.Generate (same admission, queue limits,
cancellation); only the message shapes differ. One DecodeResponse per engine batch, with one
Sample per sample index, as JetStream's orchestrator sent. Errors name JetStream's fields.
"""

from __future__ import annotations

from jaxserve.server import messages, tenancy
from jaxserve.server.calls import streaming, unary, why_left
from jaxserve.server.frontend import Frontend, ServingError
from jaxserve.server.health import HealthState
from jaxserve.server.proto import jetstream_pb2 as js
from jaxserve.types import InvalidRequestError


def _jetstream_field(field: str | None, token_content: bool) -> str | None:
    prompt = "token_content.token_ids" if token_content else "text_content.text"
    return {"prompt": prompt, "prompt_token_ids": "token_content.token_ids",
            "n": "num_samples"}.get(field, field)


class OrchestratorService:
    def __init__(self, frontend: Frontend, health: HealthState):
        self.frontend = frontend
        self.metrics = frontend.metrics
        self.health = health

    @streaming
    async def Decode(self, request, context):
        token_content = request.WhichOneof("content") == "token_content"
        try:
            spec = tenancy.salt_request(messages.spec_from_decode(request), context)
            sub = await self.frontend.submit(spec)
        except InvalidRequestError as e:
            raise InvalidRequestError(_jetstream_field(e.field, token_content),
                                      str(e).split(": ", 1)[-1]) from None
        except ServingError as e:
            if e.field:
                new = _jetstream_field(e.field, token_content)
                if e.message.startswith(e.field + ":"):
                    e.message = new + e.message[len(e.field):]
                e.field = new
            raise
        try:
            async for deltas, _finished in self.frontend.stream(sub):
                msg = messages.decode_response(deltas, sub.n, spec.text_out)
                if msg is not None:
                    yield msg
        finally:
            self.frontend.close(sub, why_left(context))

    @unary
    async def HealthCheck(self, request, context):
        return js.HealthCheckResponse(is_live=self.health.ready)
