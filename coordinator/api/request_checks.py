"""Checks on ClusterService requests other than BeginJob/EndJob (coordinator/api/job_requests.py).

Each ``check_*`` refuses a request no client of ours sends, naming the field,
before anything reads it: sizes (so a 10 MB job name never reaches a log
line or the event log), list limits (so one call cannot ask for the whole
database), enum values the descriptor knows, and finite numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from clusterwatch.coordinator.api.job_requests import MAX_JOB_CHARS, node_problem
from clusterwatch.errors import InvalidRequestError
from clusterwatch.v1 import cluster_pb2
from clusterwatch.wire.limits import MAX_ID_CHARS

# ListEvents / ListIncidents / ListActions: at most this many per call (0 means 1000).
MAX_LIST_LIMIT = 10_000
MAX_WATCH_INTERVAL_S = 3600.0
# GetSnapshot: names asked for at most (a client wanting more asks for everything).
MAX_SNAPSHOT_NAMES = 10_000
MAX_ACTION_CHARS = 64
# exclude_node_and_restart leaves out a few broken nodes, not a cluster.
MAX_EXCLUDE_NODES = 1024
# Detection settings: there are a few dozen, with short names and values.
MAX_SETTINGS = 64
MAX_SETTING_KEY_CHARS = 64
MAX_SETTING_VALUE_CHARS = 256

_INCIDENT_STATES = frozenset(cluster_pb2.IncidentState.values())


def check_get_snapshot(request: cluster_pb2.GetSnapshotRequest) -> None:
    """Raises: InvalidRequestError naming ``nodes`` or ``jobs``."""
    for field, names, max_chars in (
        ("nodes", request.nodes, MAX_ID_CHARS),
        ("jobs", request.jobs, MAX_JOB_CHARS),
    ):
        if len(names) > MAX_SNAPSHOT_NAMES:
            raise InvalidRequestError(f"{field}: at most {MAX_SNAPSHOT_NAMES} names, got {len(names)}")
        for name in names:
            _check_length(field, name, max_chars)


def check_watch(request: cluster_pb2.WatchRequest) -> None:
    """Raises: InvalidRequestError naming ``interval_seconds``."""
    interval = request.interval_seconds
    if not 0.0 <= interval <= MAX_WATCH_INTERVAL_S:  # False for NaN too
        raise InvalidRequestError(
            f"interval_seconds: must be 0 (the default) or at most {MAX_WATCH_INTERVAL_S:g} s, got {interval!r}"
        )


def check_list_events(request: cluster_pb2.ListEventsRequest) -> None:
    """Raises: InvalidRequestError naming ``after_id``, ``limit`` or ``node_id``."""
    if request.after_id < 0:
        raise InvalidRequestError(f"after_id: must be >= 0, got {request.after_id}")
    _check_limit(request.limit)
    _check_length("node_id", request.node_id, MAX_ID_CHARS)


def check_list_incidents(request: cluster_pb2.ListIncidentsRequest) -> None:
    """Raises: InvalidRequestError naming ``job`` or ``limit``."""
    _check_length("job", request.job, MAX_JOB_CHARS)
    _check_limit(request.limit)


def check_get_topology(request: cluster_pb2.GetTopologyRequest) -> None:
    """Raises: InvalidRequestError naming ``node`` or ``job``."""
    _check_length("node", request.node, MAX_ID_CHARS)
    _check_length("job", request.job, MAX_JOB_CHARS)


def check_list_actions(request: cluster_pb2.ListActionsRequest) -> None:
    """Raises: InvalidRequestError naming ``job``, ``incident_id`` or ``limit``."""
    _check_length("job", request.job, MAX_JOB_CHARS)
    _check_length("incident_id", request.incident_id, MAX_ID_CHARS)
    _check_limit(request.limit)


def check_update_incident(request: cluster_pb2.UpdateIncidentRequest) -> None:
    """Raises: InvalidRequestError naming ``id`` or ``state`` (an unknown enum value included)."""
    if not request.id:
        raise InvalidRequestError("id: must not be empty")
    _check_length("id", request.id, MAX_ID_CHARS)
    if request.state not in _INCIDENT_STATES:
        raise InvalidRequestError(f"state: unknown IncidentState value {request.state}")


def check_update_detection_settings(request: cluster_pb2.UpdateDetectionSettingsRequest) -> None:
    """Sizes and finite numbers; the settings' own rules are config's (ConfigError naming the key).

    Raises:
        InvalidRequestError: naming ``values`` or ``values[KEY]``.
    """
    values = request.values
    if len(values) > MAX_SETTINGS:
        raise InvalidRequestError(f"values: at most {MAX_SETTINGS} settings, got {len(values)}")
    for key, value in values.items():
        if not key or len(key) > MAX_SETTING_KEY_CHARS:
            raise InvalidRequestError(
                f"values: a setting name has 1 to {MAX_SETTING_KEY_CHARS} characters, got {len(key)} "
                f"({key[:32]!r}...)"
            )
        where = f"values[{key!r}]"
        _check_length(where, value, MAX_SETTING_VALUE_CHARS)
        if _non_finite(value):
            raise InvalidRequestError(f"{where}: must be a finite number, got {value!r}")


def check_action(request: cluster_pb2.ActionRequest) -> None:
    """Sizes and node ids; what the action means is Actions' (coordinator/recovery/actions.py).

    Raises:
        InvalidRequestError: naming ``job``, ``action``, ``idempotency_key`` or ``exclude_nodes[i]``.
    """
    _check_length("job", request.job, MAX_JOB_CHARS)
    _check_length("action", request.action, MAX_ACTION_CHARS)
    _check_length("idempotency_key", request.idempotency_key, MAX_ID_CHARS)
    check_node_list("exclude_nodes", request.exclude_nodes, MAX_EXCLUDE_NODES)


def check_node_list(field: str, nodes: Iterable[str], limit: int) -> None:
    """At most ``limit`` node ids, each well formed, none twice.

    Raises:
        InvalidRequestError: naming ``field`` or ``field[i]``.
    """
    nodes = list(nodes)
    if len(nodes) > limit:
        raise InvalidRequestError(f"{field}: at most {limit} nodes, got {len(nodes)}")
    seen: dict[str, int] = {}
    for index, node in enumerate(nodes):
        if problem := node_problem(node):
            raise InvalidRequestError(f"{field}[{index}]: {problem}")
        if node in seen:
            raise InvalidRequestError(
                f"{field}[{index}]: {node!r} is listed twice (also {field}[{seen[node]}])"
            )
        seen[node] = index


def _check_limit(limit: int) -> None:
    if limit > MAX_LIST_LIMIT:
        raise InvalidRequestError(f"limit: at most {MAX_LIST_LIMIT} (0 means 1000), got {limit}")


def _check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequestError(
            f"{field}: at most {limit} characters, got {len(value)} ({value[:32]!r}...)"
        )


def _non_finite(text: str) -> bool:
    """``text`` reads as NaN or an infinity ("nan", "-inf", "Infinity"...), which no setting allows."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False
