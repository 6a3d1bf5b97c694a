"""``clusterwatch coordinator drain``: hand a coordinator's share to the others of its group
(coordinator/group/drain.py), and wait until it holds nothing."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import grpc

from clusterwatch.client import ClusterClient
from clusterwatch.config import CoordinatorSettings
from clusterwatch.coordinator.group.drain import set_draining
from clusterwatch.coordinator.group.membership import Member
from clusterwatch.errors import ClusterwatchError
from clusterwatch.runtime.etcd import Etcd, parse_endpoints
from clusterwatch.runtime.tls import credentials, etcd_credentials

POLL_S = 0.5


def drain(settings: CoordinatorSettings, undo: bool, timeout_s: float) -> int:
    """Exit code: 0 drained (or undone), 1 etcd or the coordinator failed us or the wait timed out,
    2 no etcd given."""
    if not settings.etcd:
        print(
            "clusterwatch coordinator drain: coordinator.etcd: give the group's etcd (--etcd)",
            file=sys.stderr,
        )
        return 2
    parse_endpoints(settings.etcd, "coordinator.etcd")
    tls = credentials(settings, "coordinator")
    etcd_tls = etcd_credentials(settings)
    shard_id = settings.shard_id or socket.gethostname()

    async def mark() -> Member:
        async with Etcd(settings.etcd, tls=etcd_tls) as etcd:
            return await set_draining(etcd, settings.etcd_prefix, shard_id, draining=not undo)

    try:
        member = asyncio.run(mark())
    except ClusterwatchError as exc:
        print(f"clusterwatch coordinator drain: {exc}", file=sys.stderr)
        return 1
    if undo:
        print(f"coordinator {shard_id} takes its share back")
        return 0
    print(f"coordinator {shard_id} is draining: its jobs and nodes go to the others", flush=True)
    address = member.api_address or member.address
    deadline = time.monotonic() + timeout_s
    with ClusterClient(
        address, timeout_s=10, credentials=tls.channel_credentials() if tls else None
    ) as client:
        while True:
            try:
                snapshot = client.snapshot(summary_only=True)
            except grpc.RpcError as exc:
                print(
                    f"clusterwatch coordinator drain: {address}: {exc.code().name}: {exc.details()}",
                    file=sys.stderr,
                )
                return 1
            nodes, jobs = len(snapshot.nodes), len(snapshot.jobs)
            if not nodes and not jobs:
                print(f"coordinator {shard_id} holds no node and no job: stop it when you like")
                return 0
            if time.monotonic() > deadline:
                print(
                    f"clusterwatch coordinator drain: coordinator {shard_id} still holds {nodes} nodes and {jobs} "
                    f"jobs after {timeout_s:g} s",
                    file=sys.stderr,
                )
                return 1
            time.sleep(POLL_S)
