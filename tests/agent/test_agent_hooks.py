"""The agent's hook socket end to end, in-process: a real Agent serving HookService on a
Unix socket under tmp_path, real gRPC hook clients (and real child processes) on it, and
a real coordinator peer on the other side of the agent's uplink.

Most tests put a scripted AgentService on the uplink: it records every hello and node
report the agent sends and pushes what the test asks (commands, checkpoint tables), the
latter not sent by the coordinator yet. The checkpoint-relay test uses the real
coordinator server instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import HOOK_WORKERS, eventually, run_cli, samples_named, scrape
from hook_client import HookClient

from clusterwatch.agent.hook_limits import (
    ITEM_BURST,
    ITEMS_PER_S,
    MAX_COLLECTIVE_KINDS,
    MAX_RANKS_PER_PROCESS,
)
from clusterwatch.agent.hook_socket import HookSocketError, SocketClaim
from clusterwatch.agent.proc_exit import ProcessExitWatcher
from clusterwatch.agent.runtime import Agent
from clusterwatch.config import AgentSettings, CoordinatorSettings
from clusterwatch.coordinator.ingest.report_checks import check_report
from clusterwatch.coordinator.server import CoordinatorServer
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, hook_pb2, training_pb2

pytestmark = pytest.mark.timeout(60)

EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
OK = agent_pb2.CommandResult.Status.STATUS_OK
FAILED = agent_pb2.CommandResult.Status.STATUS_FAILED
RUNNING = training_pb2.RANK_STATE_RUNNING
DISCONNECTED = training_pb2.RANK_STATE_DISCONNECTED
EXITED = training_pb2.RANK_STATE_EXITED


class ScriptedCoordinator(agent_pb2_grpc.AgentServiceServicer):
    """A real AgentService peer: records what the agent sends, sends what the test queues."""

    def __init__(self) -> None:
        self.hellos: list[agent_pb2.Hello] = []
        self.reports: list[Any] = []
        self.results: list[agent_pb2.CommandResult] = []
        self.outbox: asyncio.Queue[agent_pb2.CoordinatorMessage] = asyncio.Queue()

    async def Connect(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]  # noqa: N802
        first = await context.read()
        self.hellos.append(first.hello)
        await context.write(agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=0)))
        writer = asyncio.create_task(self._write(context))
        try:
            while (message := await context.read()) is not EOF:
                if message.HasField("report"):
                    self.reports.append(message.report)
                    self.outbox.put_nowait(
                        agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=message.report.sequence))
                    )
                elif message.HasField("command_result"):
                    self.results.append(message.command_result)
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    async def _write(self, context: Any) -> None:
        while True:
            await context.write(await self.outbox.get())

    def rank_reports(self, instance_id: str) -> list[training_pb2.RankReport]:
        """Every RankReport of one process, in the order the agent sent them."""
        return [r for report in self.reports for r in report.ranks if r.identity.instance_id == instance_id]

    def result(self, command_id: str) -> agent_pb2.CommandResult | None:
        return next((r for r in self.results if r.command_id == command_id), None)


@dataclass
class Harness:
    agent: Agent
    coordinator: ScriptedCoordinator
    socket_path: Path
    stop: asyncio.Event
    task: asyncio.Task[None]
    clients: list[HookClient] = field(default_factory=list)

    async def client(self) -> HookClient:
        client = HookClient(self.socket_path)
        self.clients.append(client)
        return client

    def metrics(self) -> Any:
        return scrape(f"http://127.0.0.1:{self.agent.metrics_port}/metrics")


def rank(
    rank_number: int = 0, *, job: str = "j", instance: str = "", pid: int = 0
) -> training_pb2.RankIdentity:
    return training_pb2.RankIdentity(
        job=job,
        rank=rank_number,
        local_rank=rank_number,
        world_size=4,
        pid=pid or os.getpid(),
        instance_id=instance or f"{job}-{rank_number}",
        hook_version="test",
    )


def steps(*numbers: int, compute_s: float = 0.25) -> hook_pb2.StepBatch:
    return hook_pb2.StepBatch(
        steps=[
            training_pb2.StepSummary(
                step=n,
                start_unix_seconds=1e9 + n,
                step_seconds=0.5,
                communication_seconds=0.25,
                compute_seconds=compute_s,
            )
            for n in numbers
        ]
    )


async def serve_scripted(coordinator: ScriptedCoordinator) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(coordinator, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def agent_settings(coordinator_port: int, socket_path: Path, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "coordinator": f"127.0.0.1:{coordinator_port}",
        "node_id": "n1",
        "interval_s": 0.05,
        "collectors": [],
        "reconnect_max_s": 0.5,
        "socket": str(socket_path),
        "metrics_listen": "127.0.0.1:0",
    }
    values.update(overrides)
    return AgentSettings(**values)


@contextlib.asynccontextmanager
async def running_agent(
    tmp_path: Path, exit_watcher: ProcessExitWatcher | None = None, **overrides: Any
) -> AsyncIterator[Harness]:
    coordinator = ScriptedCoordinator()
    server, port = await serve_scripted(coordinator)
    socket_path = tmp_path / "a.sock"
    agent = Agent(agent_settings(port, socket_path, **overrides), exit_watcher=exit_watcher)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    harness = Harness(agent, coordinator, socket_path, stop, task)
    try:
        await eventually(lambda: task.done() or coordinator.hellos, 20, "the agent to start and connect")
        if task.done():
            task.result()  # start-up failed: show why
        yield harness
    finally:
        for client in harness.clients:
            await client.close()
        stop.set()
        await asyncio.wait_for(task, 20)
        await server.stop(None)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    async with running_agent(tmp_path) as h:
        yield h


async def test_hello_steps_and_heartbeat_reach_the_next_node_report(harness: Harness) -> None:
    hook = await harness.client()
    await hook.send(hello=rank(0))
    await hook.send(steps=steps(1, 2, 3))
    heartbeat = training_pb2.Heartbeat(
        timestamp_unix_seconds=1e9, step=3, in_step=True, steps_completed_total=3
    )
    await hook.send(heartbeat=heartbeat)
    coordinator = harness.coordinator

    def sent() -> list[training_pb2.RankReport]:
        reports = coordinator.rank_reports("j-0")
        seen_steps = [s.step for r in reports for s in r.steps]
        return reports if seen_steps == [1, 2, 3] and reports[-1].HasField("heartbeat") else []

    reports = await eventually(sent, 20, "the steps and heartbeat in node reports")
    assert reports[-1].identity == rank(0)
    assert reports[-1].state == RUNNING
    assert reports[-1].heartbeat == heartbeat
    later = await eventually(lambda: coordinator.rank_reports("j-0")[len(reports) :], 20, "one more report")
    assert later[0].heartbeat == heartbeat  # the latest heartbeat goes out every time
    assert list(later[0].steps) == []  # steps go out once
    # An identity update (backend known after init_process_group) is in the next report.
    updated = rank(0)
    updated.backend = "gloo"
    await hook.send(identity=updated)
    await eventually(
        lambda: coordinator.rank_reports("j-0")[-1].identity.backend == "gloo", 20, "the updated identity"
    )
    assert "hook.v1" in coordinator.hellos[0].capabilities
    assert "command.checkpoint" in coordinator.hellos[0].capabilities
    samples = await asyncio.to_thread(harness.metrics)
    assert samples_named(samples, "clusterwatch_agent_hook_streams")[0].value == 1
    assert samples_named(samples, "clusterwatch_agent_hook_messages_total", kind="steps")[0].value == 1
    assert samples_named(samples, "clusterwatch_agent_ranks", state="running")[0].value == 1


async def test_first_message_must_be_a_hello(harness: Harness) -> None:
    hook = await harness.client()
    await hook.send(heartbeat=training_pb2.Heartbeat(step=1))
    error = await hook.error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message on a hook stream must be a hello" in (error.details() or "")
    assert len(harness.agent.ranks) == 0


@pytest.mark.parametrize(
    ("message", "field_name"),
    [
        ({"steps": steps(3, compute_s=-0.1)}, "steps[0].compute_seconds"),
        (
            {"heartbeat": training_pb2.Heartbeat(step_elapsed_seconds=float("nan"))},
            "heartbeat.step_elapsed_seconds",
        ),
        (
            {
                "identity": training_pb2.RankIdentity(
                    job="j", rank=0, world_size=0, pid=os.getpid(), instance_id="j-0"
                )
            },
            "identity.world_size",
        ),
        ({"hello": rank(0)}, "hello"),
    ],
)
async def test_invalid_field_ends_the_stream_naming_it_and_earlier_data_is_kept(
    harness: Harness, message: dict[str, Any], field_name: str
) -> None:
    hook = await harness.client()
    await hook.send(hello=rank(0))
    await hook.send(steps=steps(1, 2))
    await hook.send(**message)
    error = await hook.error()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.details() or "").startswith(f"{field_name}: ")

    def disconnected() -> list[training_pb2.RankReport]:
        reports = harness.coordinator.rank_reports("j-0")
        return reports if reports and reports[-1].state == DISCONNECTED else []

    reports = await eventually(disconnected, 20, "the rank to be reported disconnected")
    assert [s.step for r in reports for s in r.steps] == [1, 2]
    samples = await asyncio.to_thread(harness.metrics)
    assert samples_named(samples, "clusterwatch_agent_hook_invalid_messages_total")[0].value == 1
    # The same process may come back and carry on.
    again = await harness.client()
    await again.send(hello=rank(0))
    await again.send(steps=steps(4))
    await eventually(
        lambda: [s.step for r in harness.coordinator.rank_reports("j-0") for s in r.steps] == [1, 2, 4],
        20,
        "the reconnected rank's step",
    )


async def test_a_newer_stream_of_the_same_process_supersedes_the_older(harness: Harness) -> None:
    old = await harness.client()
    await old.send(hello=rank(0))
    await eventually(lambda: len(harness.agent.hook_links) == 1, 20, "the first stream")
    new = await harness.client()
    await new.send(hello=rank(0))
    error = await old.error()
    assert error.code() == grpc.StatusCode.ABORTED
    await new.send(steps=steps(7))
    await eventually(
        lambda: [s.step for r in harness.coordinator.rank_reports("j-0") for s in r.steps] == [7],
        20,
        "the newer stream's step",
    )
    assert harness.coordinator.rank_reports("j-0")[-1].state == RUNNING
    assert len(harness.agent.hook_links) == 1


CHILD_HOOK = r"""
import os, queue, sys
import grpc
from clusterwatch.hook.transport import fetch_credential_nonce
from clusterwatch.v1 import hook_pb2, hook_pb2_grpc, training_pb2
path, job, rank, mode = sys.argv[1:5]
outgoing = queue.Queue()
outgoing.put(hook_pb2.HookMessage(hello=training_pb2.RankIdentity(
    job=job, rank=int(rank), world_size=4, pid=os.getpid(), instance_id=f"child-{rank}"),
    credential_nonce=fetch_credential_nonce(path, 10)))
channel = grpc.insecure_channel("unix:" + path)
call = hook_pb2_grpc.HookServiceStub(channel).Connect(iter(outgoing.get, None))
sys.stdin.readline()
if mode == "goodbye":
    outgoing.put(hook_pb2.HookMessage(goodbye=hook_pb2.Goodbye(reason="finished")))
    outgoing.put(None)
    for _ in call:  # until the agent has read everything and closed the stream
        pass
    os._exit(0)
os._exit(int(mode))
"""


async def spawn_hook(socket_path: Path, rank_number: int, mode: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD_HOOK,
        str(socket_path),
        "j",
        str(rank_number),
        mode,
        stdin=asyncio.subprocess.PIPE,
    )


async def release(process: asyncio.subprocess.Process) -> None:
    assert process.stdin is not None
    process.stdin.write(b"go\n")
    await process.stdin.drain()


async def wait_registered(harness: Harness, *instance_ids: str) -> None:
    def registered() -> bool:
        entries = [harness.agent.ranks.get(i) for i in instance_ids]
        return all(e is not None and e.state.name == "RUNNING" for e in entries)

    await eventually(registered, 30, f"{instance_ids} to register")


async def final_report(harness: Harness, instance_id: str) -> training_pb2.RankReport:
    def exited() -> training_pb2.RankReport | None:
        reports = harness.coordinator.rank_reports(instance_id)
        return reports[-1] if reports and reports[-1].state == EXITED else None

    return await eventually(exited, 30, f"{instance_id} to be reported exited")


async def test_real_processes_exit_codes_and_signals_via_netlink(harness: Harness) -> None:
    if harness.agent.exit_watcher.method != "netlink":
        pytest.skip("the netlink process connector needs Linux and CAP_NET_ADMIN")
    exits_3 = await spawn_hook(harness.socket_path, 0, "3")
    killed = await spawn_hook(harness.socket_path, 1, "0")
    clean = await spawn_hook(harness.socket_path, 2, "goodbye")
    try:
        await wait_registered(harness, "child-0", "child-1", "child-2")
        await release(exits_3)
        killed.send_signal(signal.SIGKILL)
        await release(clean)
        first = await final_report(harness, "child-0")
        assert (first.exit.exit_code, first.exit.HasField("signal")) == (3, False)
        assert first.exit.description == "exit code 3"
        assert not first.exit.clean
        second = await final_report(harness, "child-1")
        assert (second.exit.signal, second.exit.HasField("exit_code")) == (signal.SIGKILL, False)
        assert second.exit.description == "killed by signal 9 (SIGKILL)"
        third = await final_report(harness, "child-2")
        assert third.exit.clean
        assert third.exit.exit_code == 0
    finally:
        for process in (exits_3, killed, clean):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    # Reported once, then forgotten.
    count = len(harness.coordinator.reports)
    await eventually(lambda: len(harness.coordinator.reports) > count, 20, "one more report")
    assert harness.coordinator.reports[-1].ranks == []


async def test_exit_seen_by_polling_when_the_connector_is_unavailable(tmp_path: Path) -> None:
    def unavailable() -> socket.socket:
        raise PermissionError(1, "Operation not permitted")

    async with running_agent(
        tmp_path, exit_watcher=ProcessExitWatcher(open_connector=unavailable)
    ) as harness:
        process = await spawn_hook(harness.socket_path, 0, "0")
        try:
            await wait_registered(harness, "child-0")
            process.send_signal(signal.SIGKILL)
            report = await final_report(harness, "child-0")
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        assert report.exit.description == "exited (status unknown)"
        assert not report.exit.HasField("exit_code")
        assert not report.exit.HasField("signal")
        samples = await asyncio.to_thread(harness.metrics)
        assert samples_named(samples, "clusterwatch_agent_exit_watcher_info", method="psutil")[0].value == 1


async def test_checkpoint_command_from_the_real_coordinator_is_relayed_to_the_job_ranks(
    tmp_path: Path,
) -> None:
    server = CoordinatorServer(
        CoordinatorSettings(listen="127.0.0.1:0", metrics_listen="", state_dir=tmp_path / "state")
    )
    await server.start()
    socket_path = tmp_path / "a.sock"
    agent = Agent(agent_settings(server.grpc_port, socket_path, metrics_listen=""))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    hooks = [HookClient(socket_path) for _ in range(3)]
    try:
        await eventually(lambda: "n1" in server.core.sessions and agent.uplink.connected, 20, "the agent")
        await hooks[0].send(hello=rank(0))
        await hooks[1].send(hello=rank(1))
        await hooks[2].send(hello=rank(0, job="other"))
        await eventually(lambda: len(agent.hook_links) == 3, 20, "three hook streams")
        command = agent_pb2.Command(
            command_id="ck-1", checkpoint=agent_pb2.CheckpointCommand(job="j", step=100)
        )
        result = await server.core.send_command("n1", command, timeout_s=10)
        assert (result.status, result.message) == (OK, "relayed to ranks 0,1")
        for hook in hooks[:2]:
            message = await hook.read()
            if message.HasField("checkpoint_state"):  # the real coordinator says "none complete" first
                assert not message.checkpoint_state.has_complete_checkpoint
                message = await hook.read()
            request = message.checkpoint
            assert (request.command_id, request.step) == ("ck-1", 100)
        assert await server.core.send_command("n1", command, timeout_s=10) == result  # once per id
        missing = agent_pb2.Command(
            command_id="ck-2", checkpoint=agent_pb2.CheckpointCommand(job="nope", step=1)
        )
        failed = await server.core.send_command("n1", missing, timeout_s=10)
        assert (failed.status, failed.message) == (FAILED, "no running rank of job nope on this node")
        # The rank's outcome travels up inside the node reports.
        outcome = training_pb2.CheckpointResult(command_id="ck-1", step=100, ok=True, path="/ckpt/100")
        await hooks[0].send(checkpoint_result=outcome)

        def reported() -> bool:
            return any(
                list(r.checkpoint_results) == [outcome] for r in (agent.latest.ranks if agent.latest else [])
            )

        await eventually(reported, 20, "the checkpoint result in a node report")
    finally:
        for hook in hooks:
            await hook.close()
        stop.set()
        await asyncio.wait_for(task, 20)
        await server.stop()


async def test_checkpoint_state_is_pushed_on_hello_and_when_the_job_changes(harness: Harness) -> None:
    early = await harness.client()
    await early.send(hello=rank(0))
    await eventually(lambda: len(harness.agent.hook_links) == 1, 20, "the first hook stream")

    def table(**steps_by_job: int) -> agent_pb2.CoordinatorMessage:
        entries = [agent_pb2.JobCheckpoints.Entry(job=j, step=s) for j, s in steps_by_job.items()]
        return agent_pb2.CoordinatorMessage(checkpoints=agent_pb2.JobCheckpoints(jobs=entries))

    await harness.coordinator.outbox.put(table(j=100))
    state = (await early.read()).checkpoint_state
    assert (state.has_complete_checkpoint, state.latest_complete_step) == (True, 100)
    # A hook connecting once a table is known hears its job's state at once, even "none".
    late = await harness.client()
    await late.send(hello=rank(0, job="fresh"))
    assert (await late.read()).checkpoint_state == hook_pb2.CheckpointState(has_complete_checkpoint=False)
    # Only a change of the hook's own job's value is sent.
    await harness.coordinator.outbox.put(table(j=100, other=5))
    await harness.coordinator.outbox.put(table(j=200))
    assert (await early.read()).checkpoint_state.latest_complete_step == 200
    await harness.coordinator.outbox.put(table(fresh=7))
    assert (await early.read()).checkpoint_state.has_complete_checkpoint is False
    assert (await late.read()).checkpoint_state.latest_complete_step == 7


async def test_socket_mode_log_line_and_removal_on_shutdown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="clusterwatch.agent.hook_server")
    async with running_agent(tmp_path) as harness:
        info = os.stat(harness.socket_path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o660
        assert f"serving training hooks on unix socket {harness.socket_path}" in caplog.text
    assert not harness.socket_path.exists()


async def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "a.sock"))
    stale.close()  # the file stays: what a killed agent leaves behind
    async with running_agent(tmp_path) as harness:
        hook = await harness.client()
        await hook.send(hello=rank(0))
        await eventually(lambda: len(harness.agent.ranks) == 1, 20, "a hook on the new socket")


async def test_a_second_agent_on_the_same_socket_refuses_to_start(tmp_path: Path) -> None:
    async with running_agent(tmp_path) as harness:
        second = Agent(agent_settings(1, harness.socket_path, metrics_listen=""))
        with pytest.raises(HookSocketError, match="in use by another clusterwatch agent"):
            await second.run(asyncio.Event())
        assert harness.socket_path.exists()  # the first agent's socket is untouched


async def test_a_foreign_listener_is_not_removed(tmp_path: Path) -> None:
    path = tmp_path / "a.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    try:
        agent = Agent(agent_settings(1, path, metrics_listen=""))
        with pytest.raises(HookSocketError, match="another process is listening"):
            await agent.run(asyncio.Event())
        assert path.exists()
    finally:
        listener.close()


def test_cli_agent_with_its_socket_taken_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "a.sock"
    claim = SocketClaim(path)
    claim.claim()  # what a running agent holds
    try:
        result = run_cli(
            "agent", "--coordinator", "127.0.0.1:1", "--socket", str(path), "--collectors", "host"
        )
    finally:
        claim.release()
    assert result.returncode == 2
    assert "agent.socket" in result.stderr
    assert "in use by another clusterwatch agent" in result.stderr
    assert "Traceback" not in result.stderr


def test_unusable_socket_paths_are_refused_without_touching_anything(tmp_path: Path) -> None:
    regular = tmp_path / "a.sock"
    regular.write_text("not a socket")
    with pytest.raises(HookSocketError, match="exists and is not a socket"):
        SocketClaim(regular).claim()
    assert regular.read_text() == "not a socket"
    too_long = tmp_path / ("d" * 120) / "a.sock"
    with pytest.raises(HookSocketError, match="longer than 107 bytes"):
        SocketClaim(too_long).claim()
    assert not too_long.parent.exists()
    nested = tmp_path / "run" / "clusterwatch" / "a.sock"
    claim = SocketClaim(nested)
    claim.claim()  # creates the missing directories
    claim.release()
    assert nested.parent.is_dir()


FLOOD = HOOK_WORKERS / "hook_flood.py"


async def test_a_flooding_hook_is_refused_and_the_node_reports_on_time_and_valid(tmp_path: Path) -> None:
    """A user process says hello as rank after rank, then sends 2,048 new collective kinds a batch as
    fast as it can (tests/hook_workers/hook_flood.py): refused past agent/hook_limits.py's limits, and
    the node's reports keep their pace and stay reports the coordinator takes (before the limits, they
    stalled for 11-29 s, or grew past what the coordinator accepts)."""
    async with running_agent(tmp_path, interval_s=0.1) as harness:
        coordinator = harness.coordinator
        loop = asyncio.get_running_loop()
        quiet_start, quiet_s = len(coordinator.reports), loop.time()
        await eventually(lambda: len(coordinator.reports) >= quiet_start + 10, 20, "ten quiet reports")
        quiet_per_s = (len(coordinator.reports) - quiet_start) / (loop.time() - quiet_s)

        start, started_s = len(coordinator.reports), loop.time()
        flooder = await asyncio.create_subprocess_exec(
            sys.executable,
            str(FLOOD),
            str(harness.socket_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(flooder.communicate(), 60)
        flood_s = loop.time() - started_s
        assert flooder.returncode == 0, err
        sent = json.loads(out)["batches_sent"]
        # MAX_RANKS_PER_PROCESS hellos were taken; each was cut off by the user's budget.
        assert len(harness.agent.ranks) == MAX_RANKS_PER_PROCESS
        through = [n for n in sent if n]  # a refused hello's stream gets nothing through
        assert len(through) == MAX_RANKS_PER_PROCESS, sent
        assert all(n < 399 for n in through), sent
        assert sum(sent) * 2048 < 2 * ITEM_BURST + ITEMS_PER_S * flood_s
        await eventually(
            lambda: all(e.state.name == "DISCONNECTED" for e in harness.agent.ranks.entries()),
            20,
            "every flooding stream to be ended",
        )
        samples = await asyncio.to_thread(harness.metrics)
        refused = samples_named(samples, "clusterwatch_agent_hook_denied_total", code="resource_exhausted")
        assert refused[0].value == 10  # 6 hellos, then the 4 streams

        flood_reports = coordinator.reports[start:]
        for report in flood_reports:  # each one a report the coordinator takes
            check_report(report, time.time())
            assert all(len(r.collectives) <= MAX_COLLECTIVE_KINDS for r in report.ranks)
        assert any(
            len(r.collectives) == MAX_COLLECTIVE_KINDS for report in flood_reports for r in report.ranks
        )
        # The reports kept coming: at least a quarter of the quiet pace while flooded (the flooder takes
        # CPU from the agent on a small machine; before the limits, none came for 11-29 s).
        assert len(flood_reports) >= 0.25 * quiet_per_s * flood_s, (len(flood_reports), quiet_per_s, flood_s)
