"""The one error table: every error a client can get is a ServiceError subclass, and its class decides the gRPC
status code. Handlers raise; the gRPC shell (grpc_shell.ShellInterceptor) turns the exception into the status, so no
servicer maps exceptions by hand and nothing parses exception text.

| class              | gRPC code           | meaning                                                         |
|--------------------|---------------------|-----------------------------------------------------------------|
| InvalidArgument    | INVALID_ARGUMENT    | a request field is wrong; `field` names it, the message starts with it |
| FailedPrecondition | FAILED_PRECONDITION | the request is fine but this server is not set up for it        |
| Unavailable        | UNAVAILABLE         | a dependency (datastore, Redis, KB, retrieval) cannot answer now |
| ResourceExhausted  | RESOURCE_EXHAUSTED  | overload: a queue or a memory bound is full; retry later        |
| DeadlineExceeded   | DEADLINE_EXCEEDED   | the caller's deadline passed mid-way                            |
| Cancelled          | CANCELLED           | the caller left                                                  |
| DataLoss           | DATA_LOSS           | an index on disk is corrupted                                    |
| (anything else)    | INTERNAL            | a bug: logged with its traceback, the type named in the message  |

    raise InvalidArgument("top_k", f"{top_k} exceeds the vocabulary size {vocab}")   # -> "top_k: 70000 exceeds ..."
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base of every error that reaches a client as a status; `code` is that status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem

    def __reduce__(self):  # keeps the two-argument form picklable across process pools
        return type(self), (self.field, self.problem)


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class DataLoss(ServiceError):
    code = grpc.StatusCode.DATA_LOSS


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, details) a client gets for `exc`."""
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def abort(context: grpc.ServicerContext, exc: BaseException):
    """End the call with `exc`'s status (raises, like context.abort)."""
    context.abort(*status_of(exc))
