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
    MovedError,
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


# gRPC's own name (gRFC A6) for "retry after this many milliseconds": every RESOURCE_EXHAUSTED
# a coordinator sends carries it, and the agent's uplink waits that long.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
# A refused agent waits between the delay it was given and this many times it (jitter), so agents
# refused together do not come back together.
PUSHBACK_JITTER_FACTOR = 1.5


# Where a node's agent reports instead (MovedError): the address of its home coordinator, HOST:PORT.
HOME_KEY = "clusterwatch-home"


def trailing_metadata(exc: ClusterwatchError) -> tuple[tuple[str, str], ...]:
    """What a refusal tells the agent beyond its status: when to retry, or where to go (else empty)."""
    if isinstance(exc, ResourceExhaustedError):
        return ((RETRY_PUSHBACK_KEY, str(round(exc.retry_after_s * 1000))),)
    if isinstance(exc, MovedError):
        return ((HOME_KEY, exc.home_address),)
    return ()


def home_address(trailing: object) -> str | None:
    """The home a refusal's trailing metadata names (MovedError), or None."""
    for key, value in trailing or ():  # type: ignore[attr-defined]
        if key == HOME_KEY and isinstance(value, str) and value:
            return value
    return None


def retry_pushback_s(trailing_metadata: object) -> float | None:
    """The retry delay a refusal's trailing metadata asks for, seconds; None if it names none (or a bad one)."""
    for key, value in trailing_metadata or ():  # type: ignore[attr-defined]
        if key == RETRY_PUSHBACK_KEY:
            try:
                milliseconds = int(value)
            except (TypeError, ValueError):
                return None
            return milliseconds / 1000.0 if milliseconds >= 0 else None
    return None
