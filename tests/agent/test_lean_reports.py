"""coordinator.hardware_series = "agents", in-process: a real coordinator tells a real agent (simulated
GPUs) to send digests; the agent's /metrics then carries the node's hardware series, under the names
and labels the coordinator's own /metrics uses in the default mode, and the coordinator's carries none.
An agent whose coordinator never says (an older one) sends full reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import eventually, sim_agent_settings
from prometheus_client.parser import text_string_to_metric_families

from clusterwatch.agent.runtime import Agent
from clusterwatch.config import AgentSettings, CoordinatorSettings
from clusterwatch.coordinator.metrics.page import render
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.coordinator.views.nodes import node_views
from clusterwatch.exposition.node_metrics import NODE_FAMILIES
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, node_pb2

pytestmark = pytest.mark.timeout(60)

EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
NODE = "lean-node"
# The node's hardware families: what moves from the coordinator's /metrics to the agents'.
HARDWARE = {f.name.removesuffix("_total") for f in NODE_FAMILIES}


def hardware_samples(page: bytes) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(name, labels) of every sample of a node family on a /metrics page."""
    return {
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(page.decode())
        if family.name in HARDWARE
        for s in family.samples
    }


def agent_settings(port: int) -> AgentSettings:
    return sim_agent_settings(
        port, NODE, interval_s=0.05, sim_gpus=2, metrics_listen="", pod_resources_socket=""
    )


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def test_in_agents_mode_the_agent_sends_digests_and_its_metrics_carry_the_hardware(
    tmp_path: Path,
) -> None:
    settings = CoordinatorSettings(
        listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path / "state", hardware_series="agents"
    )
    server = CoordinatorServer(settings)
    await server.start()
    try:
        async with running(Agent(agent_settings(server.grpc_port))) as agent:
            await eventually(lambda: agent.uplink.digest_reports, 20, "the coordinator to ask for digests")
            record = server.core.state.nodes

            def digested() -> node_pb2.NodeReport | None:
                stored = record[NODE].report if NODE in record else None
                sent_after_asked = stored is not None and stored.sequence > 2
                return stored if sent_after_asked and stored.gpus and not stored.gpus[0].nvlinks else None

            stored = await eventually(digested, 20, "a digest report in the coordinator's state")
            full = agent.latest
            assert full is not None
            assert full.gpus[0].nvlinks
            assert stored.ByteSize() < full.ByteSize() / 2
            assert stored.gpus[0].HasField("sm_clock_hertz")
            assert not stored.gpus[0].HasField("energy_joules_total")

            lean_page = await asyncio.to_thread(server.render_metrics)
            assert not hardware_samples(lean_page)
            assert f'clusterwatch_node_up{{node="{NODE}"}} 1'.encode() in lean_page

            # What Prometheus now scrapes from the agent is what the coordinator's page held in the
            # default mode for the same report and topology: the same names and labels.
            agent_page = agent.render_metrics()
            (view,) = node_views(server.core.state)
            coordinator_page = render([dataclasses.replace(view, report=full)])
            assert hardware_samples(agent_page) == hardware_samples(coordinator_page)
            assert ("clusterwatch_gpu_utilization_ratio", (("gpu", "0"), ("node", NODE))) in hardware_samples(
                agent_page
            )
    finally:
        await server.stop()


class OldCoordinator(agent_pb2_grpc.AgentServiceServicer):
    """A coordinator from before ReportSettings: it acknowledges reports and says nothing else."""

    def __init__(self) -> None:
        self.reports: list[node_pb2.NodeReport] = []

    async def Connect(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]  # noqa: N802
        await context.read()  # the hello
        while (message := await context.read()) is not EOF:
            if message.HasField("report"):
                self.reports.append(message.report)
                ack = agent_pb2.Ack(sequence=message.report.sequence)
                await context.write(agent_pb2.CoordinatorMessage(ack=ack))


async def test_an_agent_that_is_never_asked_sends_full_reports() -> None:
    old = OldCoordinator()
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(old, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with running(Agent(agent_settings(port))) as agent:
            await eventually(lambda: len(old.reports) >= 5, 20, "five reports")
            assert not agent.uplink.digest_reports
            assert all(r.gpus[0].nvlinks and r.gpus[0].HasField("energy_joules_total") for r in old.reports)
    finally:
        await server.stop(grace=None)
