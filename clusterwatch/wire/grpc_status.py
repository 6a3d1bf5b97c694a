"""The one table from clusterwatch errors to gRPC status codes, for every server (coordinator and agent).

Each subsystem raises subclasses of the shared errors (clusterwatch/errors.py):
the agent's hook errors are InvalidReportError, UnauthenticatedError... of
their own, so one table maps them all, most specific first.
"""

from __future__ import annotations

import grpc

from clusterwatch.errors import (
    AbortedError,
    ClusterwatchError,
    ConfigError,
    FailedPreconditionError,
    InvalidReportError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnimplementedError,
)

STATUS_BY_ERROR: tuple[tuple[type[ClusterwatchError], grpc.StatusCode], ...] = (
    (InvalidReportError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnimplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AbortedError, grpc.StatusCode.ABORTED),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
)


def status_for(exc: ClusterwatchError) -> grpc.StatusCode:
    """The status a servicer ends the call with for ``exc`` (INTERNAL for none of the above)."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL
