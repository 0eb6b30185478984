"""OpenAI's error shape and which HTTP status each failure gets.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

A worker's gRPC status maps to the HTTP status a client of the OpenAI API expects: INVALID_ARGUMENT 400 (the
worker's message names the field first: "temperature: must be ..."), UNAUTHENTICATED 401 (the gateway's own
credentials toward the worker are wrong: 502 to the client, it is not their key), RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504.
"""

from __future__ import annotations

import grpc

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 502: "server_error",
          503: "server_error", 504: "timeout_error"}

_GRPC_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAUTHENTICATED: 502,
    grpc.StatusCode.PERMISSION_DENIED: 502,
}


class APIError(Exception):
    """A failure the client gets as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def from_grpc(e: grpc.aio.AioRpcError | grpc.RpcError, worker: str = "") -> APIError:
    code = e.code()
    details = e.details() or code.name
    status = _GRPC_HTTP.get(code, 500)
    param = None
    if status == 400 and ":" in details:
        # The worker names the field first (ragcore.errors.InvalidArgument): "temperature: must be ..."
        head = details.split(":", 1)[0]
        if head and " " not in head:
            param = head
    where = f" (worker {worker})" if worker and status >= 500 else ""
    return APIError(status, f"{details}{where}", param=param, code=code.name.lower())
