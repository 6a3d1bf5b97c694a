"""A coordinator that falls behind makes no verdict from its own lag, and one at capacity refuses agents
early with a delay they honour (issue 20, items 1 and 2).

Real servers on loopback ports, real agents and the simulator's real streams. The slow coordinator
runs on an event loop of its own, in a thread, so that its injected delay (a blocking sleep in the
report path, like a CPU-bound coordinator) does not slow the agents that feed it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import ROOT, run_cli, sim_agent_settings

from clusterwatch.agent.runtime import Agent
from clusterwatch.config import AgentSettings, CoordinatorSettings, DetectionSettings
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.errors import ResourceExhaustedError
from clusterwatch.sim.runner import Simulation, resolve_settings
from clusterwatch.sim.scenario import load_scenario
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, cluster_pb2, cluster_pb2_grpc, node_pb2
from clusterwatch.wire.grpc_status import retry_pushback_s

pytestmark = pytest.mark.timeout(180)

OVERLOADED = "coordinator_overloaded"


class ThreadedCoordinator:
    """A CoordinatorServer on its own event loop in a thread; ``delay_s`` is slept in each report's ingest."""

    def __init__(self, settings: CoordinatorSettings, detection: DetectionSettings) -> None:
        self.delay_s = 0.0
        self._settings, self._detection = settings, detection
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.server: CoordinatorServer | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = self.server = CoordinatorServer(self._settings, self._detection)
        ingest = server.core.ingest

        def slow_ingest(*args: Any) -> None:
            if self.delay_s:
                time.sleep(self.delay_s)
            ingest(*args)

        server.core.ingest = slow_ingest  # type: ignore[method-assign]
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop()

    def __enter__(self) -> ThreadedCoordinator:
        self._thread.start()
        assert self._ready.wait(30), "the coordinator did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.grpc_port}"


@pytest.fixture
def slow_coordinator(tmp_path: Path) -> Iterator[ThreadedCoordinator]:
    settings = CoordinatorSettings(listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path)
    # A hang is called after 1 s without progress: lag of a second or two would look like one.
    with ThreadedCoordinator(settings, DetectionSettings(hang_floor_s=1.0)) as coordinator:
        yield coordinator


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_a_slow_coordinator_makes_no_verdict_from_its_own_lag(
    slow_coordinator: ThreadedCoordinator,
) -> None:
    scenario = load_scenario(ROOT / "bench" / "scenarios" / "healthy.toml")
    sim = Simulation(
        resolve_settings(
            scenario,
            coordinator=slow_coordinator.address,
            nodes=4,
            gpus_per_node=2,
            step_s=0.1,
            interval_s=0.5,
        )
    )
    stop = asyncio.Event()
    running = asyncio.create_task(sim.run(stop))
    async with grpc.aio.insecure_channel(slow_coordinator.address) as channel:
        api = cluster_pb2_grpc.ClusterServiceStub(channel)

        async def incidents() -> list[cluster_pb2.Incident]:
            answer = await api.ListIncidents(
                cluster_pb2.ListIncidentsRequest(include_resolved=True), timeout=60
            )
            return list(answer.incidents)

        async def stepping() -> bool:
            snapshot = await api.GetSnapshot(cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=60)
            return any(job.ranks and min(r.last_step.step for r in job.ranks) > 5 for job in snapshot.jobs)

        async def overloaded_for_3_s() -> cluster_pb2.Incident | None:
            for incident in await incidents():
                if incident.kind == OVERLOADED and time.time() - incident.opened_unix_seconds > 3.0:
                    return incident
            return None

        async def overload_resolved() -> bool:
            return any(
                i.kind == OVERLOADED and i.state == cluster_pb2.IncidentState.INCIDENT_STATE_RESOLVED
                for i in await incidents()
            )

        try:
            await until(stepping, 60, "every rank to step")
            # 8 reports a second, 0.25 s each: twice what this coordinator can apply.
            slow_coordinator.delay_s = 0.25
            incident = await until(overloaded_for_3_s, 90, "coordinator_overloaded, open for 3 s")
            assert "reports applied" in incident.summary
            assert "no recovery actions" in incident.summary
            assert incident.severity == "warning"
            slow_coordinator.delay_s = 0.0
            await until(overload_resolved, 90, "coordinator_overloaded to resolve once it caught up")
            server = slow_coordinator.server
            assert server is not None
            rounds = server.watchdog.counts().rounds
            await until(
                lambda: server.watchdog.counts().rounds > rounds + 10, 60, "10 detection rounds after it"
            )
            assert await stepping()
            seen = await incidents()
            actions = await api.ListActions(cluster_pb2.ListActionsRequest(), timeout=60)
            events = await api.ListEvents(cluster_pb2.ListEventsRequest(), timeout=60)
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)
    assert [i.kind for i in seen if i.kind != OVERLOADED] == [], [i.summary for i in seen]
    assert list(actions.actions) == []
    assert [e for e in events.events if e.kind == "node_unreachable"] == []


@pytest.fixture
async def one_stream_coordinator(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    settings = CoordinatorSettings(
        listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path, max_agent_streams=1
    )
    server = CoordinatorServer(settings)
    await server.start()
    yield server
    await server.stop()


def agent_settings(server: CoordinatorServer, node_id: str) -> AgentSettings:
    return sim_agent_settings(server.grpc_port, node_id)


async def test_a_refused_agent_waits_the_delay_it_was_given_and_loses_nothing(
    one_stream_coordinator: CoordinatorServer,
) -> None:
    server = one_stream_coordinator
    core = server.core
    hellos: list[tuple[float, str, float | None]] = []  # (when, node, retry delay if refused)
    applied: list[tuple[str, int]] = []
    open_stream, ingest = core.open_stream, core.ingest

    def recording_open_stream(hello: agent_pb2.Hello) -> Any:
        try:
            session = open_stream(hello)
        except ResourceExhaustedError as exc:
            hellos.append((time.monotonic(), hello.node_id, exc.retry_after_s))
            raise
        hellos.append((time.monotonic(), hello.node_id, None))
        return session

    def recording_ingest(session: Any, report: node_pb2.NodeReport) -> None:
        sequence = report.sequence
        ingest(session, report)
        applied.append((session.node_id, sequence))

    core.open_stream = recording_open_stream  # type: ignore[method-assign]
    core.ingest = recording_ingest  # type: ignore[method-assign]
    first, second = Agent(agent_settings(server, "n1")), Agent(agent_settings(server, "n2"))
    stop_first, stop_second = asyncio.Event(), asyncio.Event()
    first_task = asyncio.create_task(first.run(stop_first))
    second_task: asyncio.Task[None] | None = None
    try:
        await until(lambda: first.uplink.connected, 30, "the first agent to connect")
        second_task = asyncio.create_task(second.run(stop_second))
        await until(
            lambda: sum(1 for h in hellos if h[1] == "n2" and h[2] is not None) >= 2,
            30,
            "the second agent to be refused twice",
        )
        assert not second.uplink.connected
        stop_first.set()
        await asyncio.wait_for(first_task, 30)
        await until(lambda: second.uplink.connected, 30, "the second agent to get in once the first left")
        newest = second.buffer.newest_sequence
        await until(
            lambda: second.buffer.acked_sequence >= newest,
            30,
            "what it buffered while refused to be acknowledged",
        )
    finally:
        stop_first.set()
        stop_second.set()
        await asyncio.gather(first_task, *([second_task] if second_task else []), return_exceptions=True)
    attempts = [(when, retry) for when, node, retry in hellos if node == "n2"]
    assert attempts[-1][1] is None  # admitted at last
    for (refused_at, retry_s), (next_at, _) in itertools.pairwise(attempts):
        assert retry_s is not None
        assert next_at - refused_at >= retry_s, "the agent came back before the delay it was given"
    sequences = [sequence for node, sequence in applied if node == "n2"]
    assert sequences == list(range(1, len(sequences) + 1)), "reports lost or out of order"
    assert sequences[-1] >= newest
    assert second.buffer.dropped_total == 0


async def test_a_refusal_carries_its_retry_delay_in_the_trailing_metadata(
    one_stream_coordinator: CoordinatorServer,
) -> None:
    server = one_stream_coordinator
    agent = Agent(agent_settings(server, "n1"))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await until(lambda: agent.uplink.connected, 30, "the agent to connect")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = agent_pb2_grpc.AgentServiceStub(channel).Connect()  # type: ignore[call-arg]
            hello = agent_pb2.Hello(node_id="n2", instance_id="i", interval_seconds=1.0, hostname="n2")
            await call.write(agent_pb2.AgentMessage(hello=hello))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 1 agent streams" in (refused.value.details() or "")
    assert retry_pushback_s(refused.value.trailing_metadata()) == pytest.approx(1.0)


async def test_status_answers_while_a_flood_of_agents_is_refused(
    one_stream_coordinator: CoordinatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    """300 hostile agents that say hello again 20 times a second, ignoring the delay they are given."""
    # Refusals are logged at debug level, thousands a second here: not captured one by one.
    caplog.set_level(logging.INFO)
    server = one_stream_coordinator
    address = f"127.0.0.1:{server.grpc_port}"
    refusals = 0
    flooding = asyncio.Event()

    async def hostile(n: int, channel: grpc.aio.Channel) -> None:
        nonlocal refusals
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        hello = agent_pb2.Hello(node_id=f"flood-{n}", instance_id="i", interval_seconds=1.0, hostname="h")
        while not stopping.is_set():
            call = stub.Connect()  # type: ignore[call-arg]
            try:
                await call.write(agent_pb2.AgentMessage(hello=hello))
                async for _ in call:
                    await stopping.wait()  # admitted (the one stream): hold it
                    return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:  # CANCELLED when the test ends
                    return
                refusals += 1
                if refusals >= 300:
                    flooding.set()
            await asyncio.sleep(0.05)

    stopping = asyncio.Event()
    channels = [grpc.aio.insecure_channel(address) for _ in range(10)]
    flood = [asyncio.create_task(hostile(n, channels[n % 10])) for n in range(300)]
    try:
        await asyncio.wait_for(flooding.wait(), 60)
        result = await asyncio.to_thread(run_cli, "status", "--coordinator", address)
    finally:
        stopping.set()
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        for channel in channels:
            await channel.close()
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert "keeping up" in header
    assert "1 agent stream" in header
    assert "hellos refused in the last minute (at capacity)" in header
