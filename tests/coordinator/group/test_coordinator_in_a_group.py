"""A coordinator with --etcd joins its group, says where it stands, holds recovery while cut off from etcd
and rejoins with a new fencing token (issue 21, items 1 and 2 in part).

A real coordinator, a real etcd, reached through a TCP proxy the test partitions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from etcd_server import EtcdServer, start_etcd
from helpers import eventually, group_settings, run_cli, scrape, sim_agent_settings
from tcp_proxy import TcpProxy

from clusterwatch.agent.runtime import Agent
from clusterwatch.cli import certs
from clusterwatch.config import CoordinatorSettings
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.errors import FailedPreconditionError
from clusterwatch.runtime.cert_terms import Role
from clusterwatch.runtime.tls import TlsFiles
from clusterwatch.v1 import agent_pb2, cluster_pb2, cluster_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def settings(tmp_path: Path, etcd: str, prefix: str, shard_id: str) -> CoordinatorSettings:
    return group_settings(tmp_path, etcd, prefix, shard_id, metrics_listen="127.0.0.1:0")


async def health_of(server: CoordinatorServer) -> cluster_pb2.CoordinatorHealth:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        api = cluster_pb2_grpc.ClusterServiceStub(channel)
        snapshot = await api.GetSnapshot(cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=30)
        return snapshot.coordinator


async def group_metrics(server: CoordinatorServer) -> dict[str, float]:
    samples = await asyncio.to_thread(scrape, f"http://127.0.0.1:{server.metrics_port}/metrics")
    prefix = "clusterwatch_coordinator_"
    wanted = {f"{prefix}lease_held", f"{prefix}group_members"}
    return {s.name.removeprefix(prefix): s.value for s in samples if s.name in wanted}


async def until_health(
    server: CoordinatorServer, predicate: Callable[[cluster_pb2.CoordinatorHealth], bool], what: str
) -> cluster_pb2.CoordinatorHealth:
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        health = await health_of(server)
        if predicate(health):
            return health
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}: {health}"
        await asyncio.sleep(0.1)


async def test_a_coordinator_cut_off_from_etcd_holds_recovery_and_rejoins_with_a_new_token(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="clusterwatch.coordinator.recovery.executor")
    with TcpProxy(etcd.endpoint.removeprefix("http://")) as proxy:
        first = CoordinatorServer(settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
        second = CoordinatorServer(settings(tmp_path, f"http://{proxy.address}", etcd_prefix, "c2"))
        await first.start()
        await second.start()
        try:
            joined = await until_health(second, lambda h: h.group_members == 2, "both coordinators listed")
            assert (joined.shard_id, joined.holds_lease) == ("c2", True)
            assert joined.fencing_token > 0
            assert await group_metrics(second) == {"lease_held": 1.0, "group_members": 2.0}
            proxy.block()
            await until_health(second, lambda h: not h.holds_lease, "c2 to know it lost its lease")
            assert (await group_metrics(second))["lease_held"] == 0.0
            await eventually(
                lambda: (
                    "recovery holds its decisions: this coordinator does not surely hold its lease"
                    in caplog.text
                ),
                30,
                "recovery to hold its decisions",
            )
            await until_health(first, lambda h: h.group_members == 1, "c1 to see c2's lease expire")
            proxy.heal()
            back = await until_health(second, lambda h: h.holds_lease, "c2 to rejoin")
            assert back.fencing_token > joined.fencing_token
            await eventually(lambda: "recovery decides again" in caplog.text, 30, "recovery to decide again")
            await until_health(first, lambda h: h.group_members == 2, "c1 to see c2 back")
        finally:
            await second.stop()
            await first.stop()


async def test_a_shard_id_already_live_is_refused_at_start(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    first = CoordinatorServer(settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
    await first.start()
    try:
        twin = CoordinatorServer(settings(tmp_path / "twin", etcd.endpoint, etcd_prefix, "c1"))
        with pytest.raises(FailedPreconditionError, match="shard id 'c1' is held by a live coordinator"):
            await twin.start()
        await twin.stop()
    finally:
        await first.stop()


def test_the_command_says_why_it_could_not_join_its_group(tmp_path: Path) -> None:
    common = ("coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "", "--state-dir", str(tmp_path))
    unreachable = run_cli(*common, "--etcd", "http://127.0.0.1:1", timeout_s=60)
    assert unreachable.returncode == 1, unreachable.stderr
    assert "etcd at 127.0.0.1:1: UNAVAILABLE" in unreachable.stderr.splitlines()[-1]
    malformed = run_cli(*common, "--etcd", "ftp://etcd.example:2379")
    assert malformed.returncode == 2
    assert "coordinator.etcd: 'ftp://etcd.example:2379' is not http(s)://HOST:PORT" in malformed.stderr


async def test_commands_carry_the_coordinators_fencing_token_and_an_older_one_is_refused(
    etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    server = CoordinatorServer(settings(tmp_path, etcd.endpoint, etcd_prefix, "c1"))
    await server.start()
    agent = Agent(sim_agent_settings(server.grpc_port, "node-a"))
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        await eventually(lambda: "node-a" in server.core.sessions, 30, "node-a to connect")
        assert server.membership is not None
        token = server.membership.fencing_token
        assert token >= server.membership.me.token  # its view of the group is as of its join, or later

        def checkpoint(command_id: str) -> agent_pb2.Command:
            return agent_pb2.Command(
                command_id=command_id, checkpoint=agent_pb2.CheckpointCommand(job="j", step=1)
            )

        answer = await server.core.send_command("node-a", checkpoint("c-1"), 30)
        assert (
            answer.status == agent_pb2.CommandResult.Status.STATUS_UNSUPPORTED
        )  # no hook socket: not fenced
        assert agent.commands.fencing_token == token
        # What the job's deposed owner would send: its view of the group is older than the new owner's.
        server.core.fencing_token = lambda: token - 1
        refused = await server.core.send_command("node-a", checkpoint("c-2"), 30)
        assert refused.status == agent_pb2.CommandResult.Status.STATUS_FENCED
    finally:
        stop.set()
        await asyncio.gather(running, return_exceptions=True)
        await server.stop()


async def test_a_coordinator_joins_an_etcd_that_requires_client_certificates(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    certs.create_ca(pki)
    certs.issue(pki, "etcd", role=Role.COORDINATOR, extra_sans=["127.0.0.1"])
    certs.issue(pki, "c1", role=Role.COORDINATOR)
    etcd = await asyncio.to_thread(
        start_etcd, tmp_path / "etcd", (pki / "etcd.crt", pki / "etcd.key", pki / "ca.crt")
    )
    try:
        assert etcd.endpoint.startswith("https://")
        common = (
            "coordinator",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
            "--insecure",
            "--etcd",
            etcd.endpoint,
        )
        no_certificate = await asyncio.to_thread(
            run_cli, *common, "--state-dir", str(tmp_path / "a"), timeout_s=60
        )
        assert no_certificate.returncode == 1, no_certificate.stderr
        assert "etcd at 127.0.0.1:" in no_certificate.stderr.splitlines()[-1]
        half = await asyncio.to_thread(run_cli, *common, "--etcd-tls-cert", str(pki / "c1.crt"))
        assert half.returncode == 2
        assert "coordinator.etcd_tls_key: must be set too" in half.stderr
        files = TlsFiles(
            cert=(pki / "c1.crt").read_bytes(),
            key=(pki / "c1.key").read_bytes(),
            ca=(pki / "ca.crt").read_bytes(),
        )
        server = CoordinatorServer(settings(tmp_path, etcd.endpoint, "/tls", "c1"), etcd_tls=files)
        await server.start()
        try:
            assert server.membership is not None
            assert "c1" in server.membership.members
            assert server.membership.holds_lease()
        finally:
            await server.stop()
    finally:
        await asyncio.to_thread(etcd.stop)
