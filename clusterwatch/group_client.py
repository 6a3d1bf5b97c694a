"""Read a whole cluster from a group of coordinators: ask the one configured, then every other member
it lists (CoordinatorHealth.group), and merge.

Each coordinator holds the nodes homed on it and the jobs it owns (clusterwatch/wire/placement.py),
so the union is the cluster; a node or job that moved while the answers were gathered may appear at
two of them, and the first answer that has it wins. A member that does not answer leaves its share
out, and its answer says why.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import grpc

from clusterwatch.client import ClusterClient
from clusterwatch.v1 import cluster_pb2

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Answer(Generic[T]):
    """One coordinator's answer: ``value``, or ``error`` ("UNAVAILABLE: ...") when it failed."""

    shard_id: str
    address: str
    value: T | None
    error: str = ""


def snapshots(
    first: ClusterClient,
    client_for: Callable[[str], ClusterClient],
    summary_only: bool = False,
    nodes: Sequence[str] = (),
    jobs: Sequence[str] = (),
) -> list[Answer[cluster_pb2.ClusterSnapshot]]:
    """The snapshot of ``first``, then of every other member of its group (asked concurrently).

    Raises:
        grpc.RpcError: ``first`` did not answer.
    """
    snapshot = first.snapshot(summary_only=summary_only, nodes=nodes, jobs=jobs)
    here = snapshot.coordinator.shard_id
    others = [m for m in snapshot.coordinator.group if m.shard_id != here]
    return [
        Answer(here, first.address, snapshot),
        *ask_each(
            others, client_for, lambda c: c.snapshot(summary_only=summary_only, nodes=nodes, jobs=jobs)
        ),
    ]


def from_each(
    first: ClusterClient, client_for: Callable[[str], ClusterClient], ask: Callable[[ClusterClient], T]
) -> list[Answer[T]]:
    """``ask`` ``first``, then every other member of its group (concurrently).

    Raises:
        grpc.RpcError: ``first`` did not answer.
    """
    # A snapshot of no node and no job: its health alone, which lists the group.
    health = first.snapshot(summary_only=True, nodes=[""], jobs=[""]).coordinator
    others = [m for m in health.group if m.shard_id != health.shard_id]
    return [Answer(health.shard_id, first.address, ask(first)), *ask_each(others, client_for, ask)]


def ask_each(
    members: Sequence[cluster_pb2.GroupMember],
    client_for: Callable[[str], ClusterClient],
    ask: Callable[[ClusterClient], T],
) -> list[Answer[T]]:
    """``ask`` each member, concurrently; a failure is its answer's ``error``."""

    def one(member: cluster_pb2.GroupMember) -> Answer[T]:
        address = member.api_address or member.address
        try:
            with client_for(address) as client:
                return Answer(member.shard_id, address, ask(client))
        except grpc.RpcError as exc:
            return Answer(member.shard_id, address, None, f"{exc.code().name}: {exc.details()}")

    if not members:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(members))) as pool:
        return list(pool.map(one, members))


def merged(answers: Iterable[Answer[cluster_pb2.ClusterSnapshot]]) -> cluster_pb2.ClusterSnapshot:
    """One snapshot of the whole cluster: every answer's nodes, jobs and incidents, each once.

    Its ``coordinator`` is the first answer's.
    """
    result = cluster_pb2.ClusterSnapshot()
    seen_nodes: set[str] = set()
    seen_jobs: set[str] = set()
    seen_incidents: set[str] = set()
    for answer in answers:
        snapshot = answer.value
        if snapshot is None:
            continue
        if not result.HasField("coordinator"):
            result.timestamp_unix_seconds = snapshot.timestamp_unix_seconds
            result.coordinator_version = snapshot.coordinator_version
            result.coordinator.CopyFrom(snapshot.coordinator)
        result.nodes.extend(_new(snapshot.nodes, seen_nodes, lambda n: n.node_id))
        result.jobs.extend(_new(snapshot.jobs, seen_jobs, lambda j: j.job))
        result.incidents.extend(_new(snapshot.incidents, seen_incidents, lambda i: i.id))
    result.nodes.sort(key=lambda n: n.node_id)
    result.jobs.sort(key=lambda j: j.job)
    result.incidents.sort(key=lambda i: i.opened_unix_seconds)
    return result


def _new(items: Iterable[T], seen: set[str], key: Callable[[T], str]) -> list[T]:
    fresh = []
    for item in items:
        name = key(item)
        if name not in seen:
            seen.add(name)
            fresh.append(item)
    return fresh
