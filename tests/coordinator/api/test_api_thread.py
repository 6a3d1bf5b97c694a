"""ClusterService on coordinator.api_listen answers from its own thread while the core's loop is stuck
(issue 20, item 3), and every other call made there still reaches the core.

A real coordinator on loopback ports, a real in-process agent, the real CLI.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from helpers import ADMIN_METADATA, ADMIN_TOKEN_FILE, run_cli, sim_agent_settings, wait_for

from clusterwatch.agent.runtime import Agent
from clusterwatch.config import CoordinatorSettings
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def coordinator_with_agent(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    settings = CoordinatorSettings(
        listen="127.0.0.1:0",
        api_listen="127.0.0.1:0",
        metrics_listen="",
        state_dir=tmp_path,
        admin_token_file=str(ADMIN_TOKEN_FILE),
    )
    server = CoordinatorServer(settings)
    await server.start()
    agent = Agent(sim_agent_settings(server.grpc_port, "node-a"))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield server
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop()


def stub(port: int | None) -> tuple[grpc.aio.Channel, cluster_pb2_grpc.ClusterServiceStub]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel, cluster_pb2_grpc.ClusterServiceStub(channel)


async def test_status_answers_from_the_api_thread_while_the_core_loop_is_stuck(
    coordinator_with_agent: CoordinatorServer,
) -> None:
    server = coordinator_with_agent
    channel, api = stub(server.api_port)
    async with channel:

        async def seen() -> bool:
            snapshot = await api.GetSnapshot(cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=30)
            return any(n.node_id == "node-a" and n.reports_received_total for n in snapshot.nodes)

        deadline = asyncio.get_running_loop().time() + 60
        while not await seen():  # also what makes the core publish views for the API thread
            assert asyncio.get_running_loop().time() < deadline, "node-a never showed through api_listen"
            await asyncio.sleep(0.05)

    release = threading.Event()
    answers: dict[str, subprocess.CompletedProcess[str]] = {}
    main_port: list[grpc.StatusCode] = []
    incidents: list[cluster_pb2.ListIncidentsResponse] = []
    ages: list[bool] = []

    def probe() -> None:
        api_address = f"127.0.0.1:{server.api_port}"
        try:
            answers["status"] = run_cli("status", "--coordinator", api_address, "--node", "node-a")
            with grpc.insecure_channel(api_address) as api_channel:
                api_stub = cluster_pb2_grpc.ClusterServiceStub(api_channel)
                incidents.append(api_stub.ListIncidents(cluster_pb2.ListIncidentsRequest(), timeout=60))
                # What it shows gets older while the core is stuck, and it says so.
                ages.append(
                    wait_for(
                        lambda: (
                            api_stub.GetSnapshot(
                                cluster_pb2.GetSnapshotRequest(nodes=["node-a"]), timeout=60
                            ).coordinator.views_age_seconds
                            >= 1.0
                        ),
                        30,
                        "the snapshot's age to reach 1 s",
                    )
                )
            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as main:
                try:
                    cluster_pb2_grpc.ClusterServiceStub(main).GetSnapshot(
                        cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=2
                    )
                except grpc.RpcError as exc:
                    main_port.append(exc.code())
        finally:
            release.set()

    prober = threading.Thread(target=probe)
    prober.start()
    # The core's loop (this test's) is stuck until the prober is done: nothing on it runs meanwhile.
    done = release.wait(90)
    prober.join()
    assert done, "the prober never finished"
    assert answers["status"].returncode == 0, answers["status"].stderr
    assert "node-a" in answers["status"].stdout
    assert len(incidents) == 1  # answered (what is live does not matter here)
    assert ages == [True]
    # The same call on the core's own server waits for the stuck loop.
    assert main_port == [grpc.StatusCode.DEADLINE_EXCEEDED]


async def test_calls_through_the_api_thread_reach_the_core_and_bring_back_its_errors(
    coordinator_with_agent: CoordinatorServer,
) -> None:
    server = coordinator_with_agent
    api_address = f"127.0.0.1:{server.api_port}"
    channel, api = stub(server.api_port)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.UpdateIncident(
                cluster_pb2.UpdateIncidentRequest(
                    id="no-such-incident", state=cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED
                ),
                metadata=ADMIN_METADATA,
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()
        events = await api.ListEvents(cluster_pb2.ListEventsRequest(), timeout=30)
        assert any("incident no-such-incident" in e.detail for e in events.events), events
        settings = await api.GetDetectionSettings(cluster_pb2.GetDetectionSettingsRequest(), timeout=30)
        assert settings.values, "the detection settings came back empty"
        with pytest.raises(grpc.aio.AioRpcError) as no_credential:
            await api.EndJob(cluster_pb2.EndJobRequest(job="j"), timeout=30)
        assert no_credential.value.code() == grpc.StatusCode.PERMISSION_DENIED
    listed = await asyncio.to_thread(run_cli, "incidents", "--all", "--coordinator", api_address)
    assert listed.returncode == 0, listed.stderr
