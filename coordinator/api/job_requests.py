"""Checks on BeginJob and EndJob requests, so bad input is refused by field name before anything changes."""

from __future__ import annotations

from clusterwatch.errors import InvalidRequestError
from clusterwatch.v1 import cluster_pb2
from clusterwatch.wire.job_labels import labels_problem

MAX_JOB_CHARS = 256
MAX_NODE_CHARS = 253  # a DNS name
MAX_NODES = 65536
MAX_REASON_CHARS = 1024


def check_begin(request: cluster_pb2.BeginJobRequest) -> None:
    """Refuse a BeginJobRequest no Prolog would send.

    Raises:
        InvalidRequestError: naming the field (``job``, ``labels``, ``nodes[i]``).
    """
    _check_job(request.job)
    if request.labels and (problem := labels_problem(request.labels)):
        raise InvalidRequestError(f"labels: {problem}")
    if len(request.nodes) > MAX_NODES:
        raise InvalidRequestError(f"nodes: at most {MAX_NODES}, got {len(request.nodes)}")
    seen: dict[str, int] = {}
    for index, node in enumerate(request.nodes):
        if problem := node_problem(node):
            raise InvalidRequestError(f"nodes[{index}]: {problem}")
        if node in seen:
            raise InvalidRequestError(f"nodes[{index}]: {node!r} is listed twice (also nodes[{seen[node]}])")
        seen[node] = index


def node_problem(node: str) -> str:
    """What makes ``node`` no node id, or '' (1 to MAX_NODE_CHARS printable characters, no whitespace)."""
    if not node or len(node) > MAX_NODE_CHARS or not node.isprintable() or any(c.isspace() for c in node):
        return f"{node[:64]!r} is not a node id (1 to {MAX_NODE_CHARS} printable characters, no spaces)"
    return ""


def check_end(request: cluster_pb2.EndJobRequest) -> None:
    """Refuse an EndJobRequest no Epilog would send.

    Raises:
        InvalidRequestError: naming the field (``job``, ``reason``).
    """
    _check_job(request.job)
    if len(request.reason) > MAX_REASON_CHARS:
        raise InvalidRequestError(f"reason: at most {MAX_REASON_CHARS} characters, got {len(request.reason)}")


def _check_job(job: str) -> None:
    if not job:
        raise InvalidRequestError("job is empty")
    if len(job) > MAX_JOB_CHARS:
        raise InvalidRequestError(f"job: at most {MAX_JOB_CHARS} characters, got {len(job)}")
