"""Builders for the coordinator's training tests (no tests here): rank reports, and an
agent stream that speaks the real protocol to a real coordinator over gRPC."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc

from bench.synthetic import hgx_topology
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, node_pb2, training_pb2
from clusterwatch.wire.collective_stats import COLLECTIVE_DURATION_BUCKETS_S, duration_bucket_index

RUNNING = training_pb2.RankState.RANK_STATE_RUNNING
DISCONNECTED = training_pb2.RankState.RANK_STATE_DISCONNECTED
EXITED = training_pb2.RankState.RANK_STATE_EXITED
OK = agent_pb2.CommandResult.Status.STATUS_OK
T0 = 1_800_000_000.0


def collective(
    op: str = "all_reduce",
    *,
    group_size: int = 2,
    calls: int = 1,
    bytes_total: int = 1 << 20,
    duration_s: float = 0.01,
    last_sequence: int = 0,
) -> training_pb2.CollectiveSummary:
    """``calls`` collectives of equal duration, bucketed like the hook does and merged like the agent does."""
    buckets = [0] * (len(COLLECTIVE_DURATION_BUCKETS_S) + 1)
    buckets[duration_bucket_index(duration_s / calls)] = calls
    return training_pb2.CollectiveSummary(
        op=op,
        group_name="0",
        group_size=group_size,
        dtype="float32",
        count=calls,
        bytes_total=bytes_total,
        duration_seconds_total=duration_s,
        duration_seconds_max=duration_s / calls,
        last_sequence=last_sequence,
        duration_bucket_counts=buckets,
    )


def step(
    n: int,
    *,
    start: float | None = None,
    step_s: float = 0.5,
    compute_s: float = 0.4,
) -> training_pb2.StepSummary:
    """Step ``n``; by default steps start every 0.5 s from T0."""
    return training_pb2.StepSummary(
        step=n,
        start_unix_seconds=T0 + n * step_s if start is None else start,
        step_seconds=step_s,
        compute_seconds=compute_s,
        communication_seconds=step_s - compute_s,
    )


def rank_report(
    rank: int,
    *,
    job: str = "train",
    world_size: int = 2,
    steps: Sequence[training_pb2.StepSummary] = (),
    collectives: Sequence[training_pb2.CollectiveSummary] = (),
    state: training_pb2.RankState.ValueType = RUNNING,
    instance_id: str | None = None,
    restart_count: int = 0,
    heartbeat: training_pb2.Heartbeat | None = None,
    checkpoint_results: Sequence[training_pb2.CheckpointResult] = (),
    exit: training_pb2.RankExit | None = None,
) -> training_pb2.RankReport:
    report = training_pb2.RankReport(
        identity=training_pb2.RankIdentity(
            job=job,
            rank=rank,
            local_rank=rank % 8,
            world_size=world_size,
            pid=1000 + rank,
            hostname=f"host-{rank // 8}",
            restart_count=restart_count,
            gpu_uuid=f"GPU-{rank:04d}",
            instance_id=instance_id or f"{job}-{rank}-r{restart_count}",
            backend="gloo",
        ),
        state=state,
        steps=steps,
        collectives=collectives,
        checkpoint_results=checkpoint_results,
    )
    if heartbeat is not None:
        report.heartbeat.CopyFrom(heartbeat)
    elif steps:
        report.heartbeat.CopyFrom(
            training_pb2.Heartbeat(timestamp_unix_seconds=time.time(), step=steps[-1].step, in_step=False)
        )
    if exit is not None:
        report.exit.CopyFrom(exit)
    return report


def gpu_uuid(index: int) -> str:
    """As rank_report names rank ``index``'s GPU, so placements resolve."""
    return f"GPU-{index:04d}"


def hgx() -> node_pb2.NodeTopology:
    """8 H100s on NVSwitches (18 NVLinks each pair), 4 NDR HCAs, each on the PCIe switch of two GPUs.

    The node of tests/cli/test_topology_render.py and tests/tui/test_tui_topology.py."""
    return hgx_topology([gpu_uuid(g) for g in range(8)])


def checkpoint_ok(step_n: int, rank: int, duration_s: float = 1.0) -> training_pb2.CheckpointResult:
    return training_pb2.CheckpointResult(
        command_id="c",
        step=step_n,
        ok=True,
        path=f"/ckpt/step-{step_n}/rank-{rank}.pt",
        duration_seconds=duration_s,
    )


class AgentStream:
    """One agent's Connect stream, driven by a test: hello, reports, and every
    CoordinatorMessage kept in ``messages``. Commands are answered OK (or not,
    with ``answer_commands=False``), as an agent that relayed them would."""

    def __init__(
        self,
        address: str,
        node_id: str,
        *,
        answer_commands: bool = True,
        ranks_by_job: dict[str, int] | None = None,
    ) -> None:
        """``ranks_by_job``: what the hello says its reports will carry (a group of coordinators homes
        the node by it, as an agent's hello says; none: homed by its name)."""
        self.address = address
        self.ranks_by_job = ranks_by_job or {}
        self.node_id = node_id
        self.answer_commands = answer_commands
        self.sequence = 0
        self.messages: list[agent_pb2.CoordinatorMessage] = []
        self._channel = grpc.aio.insecure_channel(address)
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()

    async def __aenter__(self) -> AgentStream:
        self._call = agent_pb2_grpc.AgentServiceStub(self._channel).Connect()  # type: ignore[call-arg]
        hello = agent_pb2.Hello(
            node_id=self.node_id,
            hostname=self.node_id,
            agent_version="test",
            instance_id=uuid.uuid4().hex,
            interval_seconds=0.2,
            ranks_by_job=self.ranks_by_job,
        )
        await self._write(agent_pb2.AgentMessage(hello=hello))
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._call.cancel()
        await self._channel.close(grace=None)

    async def report(
        self, *ranks: training_pb2.RankReport, hardware: node_pb2.NodeReport | None = None
    ) -> int:
        """Send one node report carrying ``ranks`` (and ``hardware``'s GPUs, ports...); returns its sequence."""
        self.sequence += 1
        report = node_pb2.NodeReport()
        if hardware is not None:
            report.CopyFrom(hardware)
        report.MergeFrom(
            node_pb2.NodeReport(
                sequence=self.sequence, timestamp_unix_seconds=time.time(), interval_seconds=0.2, ranks=ranks
            )
        )
        await self._write(agent_pb2.AgentMessage(report=report))
        return self.sequence

    async def wait_for(
        self, predicate: Callable[[agent_pb2.CoordinatorMessage], bool], timeout_s: float, what: str
    ) -> agent_pb2.CoordinatorMessage:
        """The first message so far (or to come) that matches ``predicate``."""

        async def poll() -> agent_pb2.CoordinatorMessage:
            while True:
                for message in self.messages:
                    if predicate(message):
                        return message
                if self._reader is not None and self._reader.done():
                    raise AssertionError(f"stream of {self.node_id} ended: {self._reader!r}")
                await asyncio.sleep(0.02)

        try:
            return await asyncio.wait_for(poll(), timeout_s)
        except TimeoutError:
            raise AssertionError(
                f"{self.node_id}: timed out waiting for {what}; got {self.messages}"
            ) from None

    def ended_with(self) -> grpc.aio.AioRpcError | None:
        """The error the coordinator ended the stream with, once it did (None before, or if it ended cleanly)."""
        if self._reader is None or not self._reader.done() or self._reader.cancelled():
            return None
        error = self._reader.exception()
        return error if isinstance(error, grpc.aio.AioRpcError) else None

    def of_kind(self, kind: str) -> list[agent_pb2.CoordinatorMessage]:
        return [m for m in self.messages if m.WhichOneof("kind") == kind]

    async def _write(self, message: agent_pb2.AgentMessage) -> None:
        async with self._write_lock:  # one writer at a time on a gRPC stream
            await self._call.write(message)

    async def _read(self) -> None:
        async for message in self._call:
            self.messages.append(message)
            if message.WhichOneof("kind") == "command" and self.answer_commands:
                result = agent_pb2.CommandResult(
                    command_id=message.command.command_id, status=OK, message="relayed"
                )
                await self._write(agent_pb2.AgentMessage(command_result=result))


async def poll_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Await a truthy ``predicate()`` (run in a thread: it may block on I/O) before the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last_error: Exception | None = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            value = await asyncio.to_thread(predicate)
        except Exception as exc:  # not checkable yet (coordinator starting, job not there)
            last_error = exc
        else:
            if value:
                return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last error: {last_error!r}")
