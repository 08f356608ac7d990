"""What every RPC handler shares: turning errors into statuses, and registering handlers.

`unary` / `streaming` wrap a servicer method so that an unparsable request (`BadMessage`), an
`InvalidRequestError` or a `ServingError` become one non-OK status with the field named in the
details and in the `jaxserve-field` trailing metadata; a refusal (as opposed to the failure of an
accepted request) is counted by the servicer's `metrics.rejections`. Any other exception is a
bug and is left to grpcio, which answers UNKNOWN (loudly, so tests and fuzzing catch it).

`generic_handler` registers a servicer for a service descriptor with the safe deserializers of
decoding.py, instead of the generated `add_*_to_server` (which would answer a bad message with
INTERNAL).
"""

from __future__ import annotations

import functools

import grpc
from google.protobuf import message_factory

from jaxserve.server.decoding import BadMessage, safe_deserializer
from jaxserve.server.frontend import ServingError
from jaxserve.types import InvalidRequestError

FIELD_METADATA_KEY = "jaxserve-field"


def as_serving_error(e: BaseException) -> ServingError | None:
    if isinstance(e, ServingError):
        return e
    if isinstance(e, InvalidRequestError):
        return ServingError.invalid(e)
    return None


# The client's deadline timer and the server's run on two clocks that start apart: the server's
# deadline is the client's plus the time the request's headers took to arrive. When the client's
# timer fires first it cancels the call (RST_STREAM), and the server sees a cancel with a few
# milliseconds to tens of milliseconds left on a loaded machine. A call that goes away this close
# to its deadline is counted as a deadline expiry; a real cancel this close to it is rare and
# would be the same thing a moment later.
DEADLINE_SLACK_S = 0.5


def why_left(context) -> str:
    """The metrics outcome of a call that ended before its request: its deadline passed
    ("deadline_exceeded", within DEADLINE_SLACK_S) or the caller cancelled or went away
    ("cancelled")."""
    remaining = context.time_remaining()
    return ("deadline_exceeded" if remaining is not None and remaining <= DEADLINE_SLACK_S
            else "cancelled")


def check_parsed(request) -> None:
    if isinstance(request, BadMessage):
        raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{request.field}: {request.message}",
                           request.field)


async def abort(context, err: ServingError):
    md = ((FIELD_METADATA_KEY, err.field),) if err.field else ()
    await context.abort(err.code, err.message, trailing_metadata=md)


_REJECTION_REASONS = {grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
                      grpc.StatusCode.RESOURCE_EXHAUSTED: "queue_full",
                      grpc.StatusCode.UNAVAILABLE: "unavailable"}


async def _answer(servicer, context, err: ServingError) -> None:
    if err.rejected:
        servicer.metrics.rejections.labels(_REJECTION_REASONS.get(err.code, err.code.name.lower())).inc()
    await abort(context, err)


def unary(fn):
    @functools.wraps(fn)
    async def handler(self, request, context):
        try:
            check_parsed(request)
            return await fn(self, request, context)
        except (ServingError, InvalidRequestError) as e:
            err = as_serving_error(e)
        await _answer(self, context, err)
    return handler


def streaming(fn):
    @functools.wraps(fn)
    async def handler(self, request, context):
        try:
            check_parsed(request)
            async for msg in fn(self, request, context):
                yield msg
            return
        except (ServingError, InvalidRequestError) as e:
            err = as_serving_error(e)
        await _answer(self, context, err)
    return handler


def generic_handler(service_descriptor, servicer) -> grpc.GenericRpcHandler:
    """Handlers for every method of the service, from its descriptor (unary or server-streaming)."""
    handlers = {}
    for method in service_descriptor.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client streaming is not supported here")
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=safe_deserializer(req_cls),
                                     response_serializer=resp_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers)
