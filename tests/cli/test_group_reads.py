"""`clusterwatch status` and `incidents` show the whole cluster whichever coordinator of a group they
ask, and an incident is acknowledged where it is kept (issue 21, item 4).

Two real coordinators in a group on a real etcd, raw agent streams with ranks, the real CLI.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from etcd_server import EtcdServer
from helpers import ADMIN_TOKEN_FILE, eventually, group_settings, run_cli
from training_builders import EXITED, AgentStream, rank_report, step

from clusterwatch.config import RecoverySettings
from clusterwatch.coordinator.group.membership import Member
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.runtime.etcd import Etcd
from clusterwatch.v1 import training_pb2
from clusterwatch.wire.placement import job_owner

pytestmark = pytest.mark.timeout(120)

SHARDS = ["c1", "c2"]
STEPS = [step(n) for n in range(1, 6)]
KILLED = training_pb2.RankExit(
    timestamp_unix_seconds=1.0, signal=9, description="killed by signal 9 (SIGKILL)"
)


def job_of(shard_id: str) -> str:
    return next(f"train-{i}" for i in range(1000) if job_owner(f"train-{i}", SHARDS) == shard_id)


async def test_status_and_incidents_read_every_coordinator_of_the_group(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    jobs = {shard: job_of(shard) for shard in SHARDS}
    servers = {
        shard: CoordinatorServer(
            group_settings(tmp_path, etcd.endpoint, etcd_prefix, shard, admin_token_file=ADMIN_TOKEN_FILE),
            recovery=RecoverySettings(opt_out_jobs=list(jobs.values())),  # incidents stay as detected
        )
        for shard in SHARDS
    }
    for server in servers.values():
        await server.start()
    try:
        await eventually(
            lambda: all(
                s.membership is not None and len(s.membership.members) == 2 for s in servers.values()
            ),
            30,
            "both in the group",
        )
        for shard, server in servers.items():  # each node homed with its job, at the job's owner
            address = f"127.0.0.1:{server.grpc_port}"
            async with AgentStream(address, f"node-{shard}", ranks_by_job={jobs[shard]: 2}) as node:
                await node.report(
                    rank_report(0, job=jobs[shard], steps=STEPS), rank_report(1, job=jobs[shard], steps=STEPS)
                )
                await node.report(rank_report(1, job=jobs[shard], state=EXITED, exit=KILLED))
                await eventually(
                    lambda s=server: len(s.watchdog.book.live()) == 1, 30, f"a failure at {shard}"
                )
        ask_c1 = ("--coordinator", f"127.0.0.1:{servers['c1'].grpc_port}", "--insecure")

        status = await asyncio.to_thread(run_cli, "status", "--json", *ask_c1)
        assert status.returncode == 0, status.stderr
        document = json.loads(status.stdout)
        assert {n["node_id"] for n in document["nodes"]} == {"node-c1", "node-c2"}
        assert {j["job"] for j in document["jobs"]} == set(jobs.values())
        assert [c["shard_id"] for c in document["coordinators"]] == SHARDS
        text = await asyncio.to_thread(run_cli, "status", *ask_c1)
        assert text.stdout.count("coordinator ") >= 2
        assert "(shard c1 of 2 coordinators" in text.stdout
        assert "(shard c2 of 2 coordinators" in text.stdout

        listed = await asyncio.to_thread(run_cli, "incidents", "--json", *ask_c1)
        assert listed.returncode == 0, listed.stderr
        incidents = json.loads(listed.stdout)
        assert sorted(i["job"] for i in incidents) == sorted(jobs.values())
        kept_at_c2 = next(i["id"] for i in incidents if i["job"] == jobs["c2"])
        acknowledged = await asyncio.to_thread(run_cli, "incidents", "--acknowledge", kept_at_c2, *ask_c1)
        assert acknowledged.returncode == 0, acknowledged.stderr
        (incident,) = servers["c2"].watchdog.book.live()
        assert incident.state.name.endswith("ACKNOWLEDGED")
        missing = await asyncio.to_thread(run_cli, "incidents", "--acknowledge", "no-such-incident", *ask_c1)
        assert missing.returncode == 1
        assert "NOT_FOUND" in missing.stderr

        # A member that does not answer leaves its share out, and the header says so.
        async with Etcd(etcd.endpoint) as client:
            lease = await client.grant(30)
            await client.put(f"{etcd_prefix}/members/c9", Member("c9", "127.0.0.1:1").encode(), lease=lease)
            await eventually(
                lambda: all(len(s.membership.members) == 3 for s in servers.values() if s.membership),
                30,
                "c9 listed",
            )
            partial = await asyncio.to_thread(run_cli, "status", *ask_c1, "--timeout-s", "1")
            await client.revoke(lease)
        assert partial.returncode == 0, partial.stderr
        assert "coordinator c9 (127.0.0.1:1): " in partial.stdout
        assert "its nodes and jobs are missing" in partial.stdout
    finally:
        for server in servers.values():
            await server.stop()
