"""The exception hierarchy shared by every component.

Each subsystem raises subclasses of these; every servicer (the coordinator's
and the agent's hook server) maps them to gRPC status codes with one table
(clusterwatch/wire/grpc_status.py), and the CLI maps ConfigError to exit code 2.
"""

from __future__ import annotations


class ClusterwatchError(Exception):
    """Base of every error clusterwatch raises on purpose."""


class ConfigError(ClusterwatchError):
    """A configuration value is missing, malformed or out of range.

    Attributes:
        key: the dotted setting name, e.g. ``agent.interval_s``.
        source: where the bad value came from (file path, env var or flag).
    """

    def __init__(self, key: str, message: str, source: str = "") -> None:
        self.key = key
        self.source = source
        where = f" (from {source})" if source else ""
        super().__init__(f"{key}: {message}{where}")


class InvalidReportError(ClusterwatchError):
    """A message from an agent breaks the protocol (maps to INVALID_ARGUMENT)."""


class InvalidRequestError(ClusterwatchError):
    """A client's request is malformed or out of range (maps to INVALID_ARGUMENT)."""


class NotFoundError(ClusterwatchError):
    """A request names something the coordinator does not know, e.g. a job (maps to NOT_FOUND)."""


class FailedPreconditionError(ClusterwatchError):
    """A valid request the cluster cannot carry out in its current state (maps to FAILED_PRECONDITION)."""


class MovedError(FailedPreconditionError):
    """This coordinator is not the node's home: its agent reports to another (clusterwatch/wire/placement.py).

    Attributes:
        home_address: where the node's agent reports instead, HOST:PORT.
    """

    def __init__(self, message: str, home_address: str) -> None:
        self.home_address = home_address
        super().__init__(message)


class UnimplementedError(ClusterwatchError):
    """A request this version does not support yet (maps to UNIMPLEMENTED)."""


class UnauthenticatedError(ClusterwatchError):
    """The caller presented a credential that is not valid (maps to UNAUTHENTICATED)."""


class PermissionDeniedError(ClusterwatchError):
    """The caller may not do this: an action without admin rights, or a node
    reporting under another node's name (maps to PERMISSION_DENIED)."""


class ResourceExhaustedError(ClusterwatchError):
    """The coordinator refuses this node's input for now: a penalty after bad input,
    or reports far faster than its interval (maps to RESOURCE_EXHAUSTED).

    Attributes:
        retry_after_s: when trying again can succeed.
    """

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class AbortedError(ClusterwatchError):
    """A newer stream of the same agent took over this one (maps to ABORTED).

    Raised, not aborted with, so that the stream's writer stops before the
    status goes out (see AgentSession.stopping).
    """


class UnreachableError(ClusterwatchError):
    """No call can reach the server: the message says why in one line (refused, not found, TLS, the
    wrong port; clusterwatch/runtime/reach.py). Commands exit 1 with it."""


class ListenError(ClusterwatchError):
    """A port this process must serve on cannot be bound: the message names the setting, the
    address and why (clusterwatch/runtime/listen.py). The process exits 1 with it."""
