"""OpenAI-style errors: one status per rule, mapped from the statuses gRPC already answers.

Every refusal in the server is a `ServingError` carrying a gRPC status code (frontend.py); the
HTTP API does not decide anything again, it only translates:

    INVALID_ARGUMENT    400 invalid_request_error, `param` = the field
    UNAUTHENTICATED     401 authentication_error
    NOT_FOUND           404 not_found_error (an unknown model name)
    RESOURCE_EXHAUSTED  429 rate_limit_error + Retry-After (the queue bound of backpressure.py)
    UNAVAILABLE         503 service_unavailable + Retry-After (warming up, draining, failed)
    DEADLINE_EXCEEDED   504
    INTERNAL / other    500 server_error (an engine fault; never a client's mistake)
"""

from __future__ import annotations

import grpc

from jaxserve.server.frontend import ServingError

RETRY_AFTER_S = 1

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @classmethod
    def from_serving(cls, e: ServingError) -> "ApiError":
        status, type_, code = _BY_CODE.get(e.code, (500, "server_error", e.code.name.lower()))
        retry = RETRY_AFTER_S if status in (429, 503) else None
        return cls(status, e.message, type_, e.field, code, retry)

    @classmethod
    def invalid(cls, field: str | None, message: str) -> "ApiError":
        return cls(400, message, "invalid_request_error", field)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
