"""The gRPC surface in-process: a real server on an OS-chosen port, real clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import ADMIN_TOKEN_FILE, FIXTURES, admin_channel, run_cli, sim_agent_settings

from clusterwatch.agent.runtime import Agent, build_collectors
from clusterwatch.config import AgentSettings, CoordinatorSettings
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, cluster_pb2_grpc, node_pb2

pytestmark = pytest.mark.timeout(60)

OK = agent_pb2.CommandResult.Status.STATUS_OK


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    settings = CoordinatorSettings(
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        state_dir=tmp_path,
        admin_token_file=str(ADMIN_TOKEN_FILE),
    )
    srv = CoordinatorServer(settings)
    await srv.start()
    yield srv
    await srv.stop()


def agent_settings(srv: CoordinatorServer, node_id: str) -> AgentSettings:
    return sim_agent_settings(srv.grpc_port, node_id)


async def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    async def poll() -> None:
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110 - polls state other tasks own
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_command_round_trip_and_idempotency(server: CoordinatorServer) -> None:
    stop = asyncio.Event()
    agent = Agent(agent_settings(server, "n1"))
    task = asyncio.create_task(agent.run(stop))
    try:
        await wait_for(
            lambda: "n1" in server.core.sessions and agent.uplink.connected, 20, "the agent to connect"
        )
        command = agent_pb2.Command(command_id="c-1", ping=agent_pb2.PingCommand())
        first = await server.core.send_command("n1", command, timeout_s=10)
        assert first.status == OK
        assert first.command_id == "c-1"
        again = await server.core.send_command("n1", command, timeout_s=10)  # same id: not run twice
        assert again == first
        unsupported = await server.core.send_command("n1", agent_pb2.Command(command_id="c-2"), timeout_s=10)
        assert unsupported.status == agent_pb2.CommandResult.Status.STATUS_UNSUPPORTED
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    state = server.core.state.nodes["n1"].state
    assert state == cluster_pb2.NodeState.NODE_STATE_LEFT


async def test_report_before_hello_is_invalid_argument(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = agent_pb2_grpc.AgentServiceStub(channel).Connect()  # type: ignore[call-arg]
        await call.write(agent_pb2.AgentMessage(report=node_pb2.NodeReport(sequence=1)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello" in (info.value.details() or "")


async def test_bad_hello_is_invalid_argument_and_others_keep_reporting(server: CoordinatorServer) -> None:
    stop = asyncio.Event()
    good = asyncio.create_task(Agent(agent_settings(server, "good")).run(stop))
    try:
        await wait_for(lambda: "good" in server.core.sessions, 20, "the honest agent")
        async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = agent_pb2_grpc.AgentServiceStub(channel).Connect()  # type: ignore[call-arg]
            await call.write(agent_pb2.AgentMessage(hello=agent_pb2.Hello(node_id="bad", interval_seconds=1)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "instance_id" in (info.value.details() or "")
        before = server.core.state.nodes["good"].last_sequence
        await wait_for(lambda: server.core.state.nodes["good"].last_sequence > before + 2, 20, "more reports")
        assert "bad" not in server.core.state.nodes
    finally:
        stop.set()
        await asyncio.wait_for(good, 20)


async def test_newer_stream_supersedes_the_older(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        hello = agent_pb2.Hello(node_id="n", instance_id="i", interval_seconds=1)
        old = stub.Connect()  # type: ignore[call-arg]
        await old.write(agent_pb2.AgentMessage(hello=hello))
        assert (await old.read()).ack.sequence == 0
        assert (await old.read()).HasField("checkpoints")  # none complete: sent on every open
        new = stub.Connect()  # type: ignore[call-arg]
        await new.write(agent_pb2.AgentMessage(hello=hello))
        assert (await new.read()).ack.sequence == 0
        assert (await new.read()).HasField("checkpoints")
        await old.write(agent_pb2.AgentMessage(report=node_pb2.NodeReport(sequence=1)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await old.read()
        assert info.value.code() == grpc.StatusCode.ABORTED
        await new.write(agent_pb2.AgentMessage(report=node_pb2.NodeReport(sequence=1)))
        assert (await new.read()).ack.sequence == 1
        await new.done_writing()


async def test_health_and_reflection(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "clusterwatch.v1.AgentService", "clusterwatch.v1.ClusterService"):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name async for r in responses for s in r.list_services_response.service}
    assert {
        "clusterwatch.v1.AgentService",
        "clusterwatch.v1.ClusterService",
        "grpc.health.v1.Health",
    } <= names


async def test_list_incidents_of_a_quiet_cluster_is_empty(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        response = await stub.ListIncidents(
            cluster_pb2.ListIncidentsRequest(include_resolved=True), timeout=5
        )
        assert list(response.incidents) == []


async def test_watch_streams_snapshots(server: CoordinatorServer) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(Agent(agent_settings(server, "w")).run(stop))
    try:
        async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = cluster_pb2_grpc.ClusterServiceStub(channel)
            stream = stub.Watch(cluster_pb2.WatchRequest(interval_seconds=0.1, summary_only=True), timeout=30)
            sequences = []
            async for snapshot in stream:
                sequences += [n.last_sequence for n in snapshot.nodes if n.node_id == "w"]
                if len(sequences) >= 3 and sequences[-1] > sequences[0]:
                    break
            stream.cancel()
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert sequences == sorted(sequences)


def test_build_collectors_follows_settings() -> None:
    settings = AgentSettings(collectors=["infiniband", "host"], sys_root=FIXTURES / "node_a" / "sys")
    assert [c.name for c in build_collectors(settings)] == ["infiniband", "host"]


async def test_watch_clients_share_one_snapshot_per_interval(server: CoordinatorServer) -> None:
    async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        request = cluster_pb2.WatchRequest(interval_seconds=0.1, summary_only=True)

        async def stamps() -> list[float]:
            stream = stub.Watch(request, timeout=30)
            seen = [snapshot.timestamp_unix_seconds async for snapshot in _first(stream, 10)]
            stream.cancel()
            return seen

        first, second = await asyncio.gather(stamps(), stamps())
    assert set(first) & set(second), "two Watch clients never got the same snapshot"
    assert len(set(first)) < len(first)  # one client's snapshots were built once per interval too


async def _first(
    stream: AsyncIterator[cluster_pb2.ClusterSnapshot], n: int
) -> AsyncIterator[cluster_pb2.ClusterSnapshot]:
    count = 0
    async for snapshot in stream:
        yield snapshot
        count += 1
        if count == n:
            return


async def test_get_snapshot_asks_for_some_nodes_or_jobs(server: CoordinatorServer) -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(Agent(agent_settings(server, n)).run(stop)) for n in ("a", "b")]
    try:
        await wait_for(lambda: {"a", "b"} <= set(server.core.sessions), 20, "both agents to connect")
        async with admin_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = cluster_pb2_grpc.ClusterServiceStub(channel)
            for job in ("j1", "j2"):
                await stub.BeginJob(cluster_pb2.BeginJobRequest(job=job), timeout=10)
            everything = await stub.GetSnapshot(cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=10)
            node_a = await stub.GetSnapshot(
                cluster_pb2.GetSnapshotRequest(nodes=["a", "nowhere"]), timeout=10
            )
            job_2 = await stub.GetSnapshot(cluster_pb2.GetSnapshotRequest(jobs=["j2"]), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as too_many:
                await stub.GetSnapshot(cluster_pb2.GetSnapshotRequest(nodes=["n"] * 10_001), timeout=10)
            address = f"127.0.0.1:{server.grpc_port}"
            only_j2 = await asyncio.to_thread(run_cli, "status", "--coordinator", address, "--job", "j2")
            only_b = await asyncio.to_thread(run_cli, "status", "--coordinator", address, "--node", "b")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert [n.node_id for n in everything.nodes] == ["a", "b"]
    assert [j.job for j in everything.jobs] == ["j1", "j2"]
    assert [n.node_id for n in node_a.nodes] == ["a"]
    assert node_a.nodes[0].HasField("report")  # not a summary: the full report
    assert list(node_a.jobs) == []
    assert [j.job for j in job_2.jobs] == ["j2"]
    assert list(job_2.nodes) == []
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nodes: at most 10000 names" in (too_many.value.details() or "")
    assert only_j2.returncode == 0, only_j2.stderr
    assert "j2" in only_j2.stdout
    assert "j1" not in only_j2.stdout
    assert only_j2.stdout.startswith("coordinator ")  # the header: how the coordinator keeps up
    assert [line.split()[0] for line in only_b.stdout.splitlines()[2:]] == ["b"]  # header, columns, node b
