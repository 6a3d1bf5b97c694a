"""One simulated agent's Connect stream to the coordinator, speaking the real protocol.

Like the agent's uplink (agent/uplink.py): a Hello with the node id, a random
instance id and the report interval; reports numbered 1, 2, 3... per
instance; every report stays buffered until an Ack covers it, and after a
broken stream the next Hello carries the last acknowledged sequence and the
unacknowledged reports are replayed in order (reconnects back off with
jitter). Commands are answered through a callback, each command id once.

A lost node is modelled with ``silence()``: the stream stays open (a dead
host's TCP connection lingers) but nothing more is sent, so the coordinator
finds the node silent and marks it unreachable, as for a real node loss.

Lighter than the agent's uplink on purpose: one process drives hundreds of
these, so there is one wake-up event per stream and no task per report.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from clusterwatch import __version__
from clusterwatch.runtime.backoff import Backoff
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, node_pb2

logger = logging.getLogger(__name__)

# Command ids (with their results) kept so a replayed command is answered, not run, again.
REMEMBERED_COMMANDS = 1024
CAPABILITIES = ("report.v1", "command.ping", "hook.v1", "command.diagnose", "simulated")
# grpc.aio's end-of-stream marker (missing from grpc-stubs).
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

CommandAnswer = Callable[[agent_pb2.Command], agent_pb2.CommandResult]


class SimAgentStream:
    """The stream of one simulated node.

    Args:
        channel: the gRPC channel to the coordinator (may be shared by several streams).
        node_id: the node's name (also its hostname).
        interval_s: the report interval the Hello announces.
        answer: builds the result of a command sent to this node.
        buffer_reports: unacknowledged reports kept; beyond it the oldest go (counted).
        reconnect_max_s: cap of the reconnect backoff.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        node_id: str,
        interval_s: float,
        answer: CommandAnswer,
        *,
        buffer_reports: int = 600,
        reconnect_max_s: float = 5.0,
    ) -> None:
        self.node_id = node_id
        self.instance_id = uuid.uuid4().hex
        self.interval_s = interval_s
        self.silent = False
        self.acked_sequence = 0
        self.sequence = 0
        self.dropped_total = 0
        self.connections_total = 0
        self.sent_total = 0
        self._stub = agent_pb2_grpc.AgentServiceStub(channel)
        self._answer = answer
        self._capacity = buffer_reports
        self._reports: collections.deque[node_pb2.NodeReport] = collections.deque()
        self._outbox: collections.deque[agent_pb2.CommandResult] = collections.deque()
        self._answered: dict[str, agent_pb2.CommandResult] = {}
        self._backoff = Backoff(base_s=0.2, cap_s=reconnect_max_s)
        self._wake = asyncio.Event()
        self._acked = asyncio.Event()
        self._closing = False

    def submit(self, report: node_pb2.NodeReport) -> None:
        """Number ``report`` and queue it (ignored once silenced)."""
        if self.silent:
            return
        self.sequence += 1
        report.sequence = self.sequence
        if len(self._reports) >= self._capacity:
            self._reports.popleft()
            self.dropped_total += 1
        report.reports_dropped_total = self.dropped_total
        self._reports.append(report)
        self._wake.set()

    def silence(self) -> None:
        """The node is lost: send nothing more, answer nothing."""
        self.silent = True

    @property
    def unacked(self) -> int:
        return self.sequence - self.acked_sequence

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted report is acknowledged; False at the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.acked_sequence < self.sequence and not self.silent:
            self._acked.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acked.wait(), remaining)
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the stream up until ``close()``; reconnect with backoff on errors."""
        failing = False
        while not self._closing:
            try:
                await self._session()
            except grpc.aio.AioRpcError as exc:
                if not failing:
                    logger.warning(
                        "node %s: stream to the coordinator failed: %s %s; reconnecting",
                        self.node_id,
                        exc.code().name,
                        exc.details(),
                    )
                failing = True
            else:
                failing = False
            if self._closing:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._backoff.next_delay_s())

    def close(self) -> None:
        """Half-close the stream after what is queued (the agent shutting down)."""
        self._closing = True
        self._wake.set()

    async def _session(self) -> None:
        # Driven with write()/done_writing(), which grpc.aio supports and the stub's types do not model.
        call = self._stub.Connect()  # type: ignore[call-arg]
        hello = agent_pb2.Hello(
            node_id=self.node_id,
            hostname=self.node_id,
            agent_version=f"{__version__}+sim",
            instance_id=self.instance_id,
            capabilities=CAPABILITIES,
            interval_seconds=self.interval_s,
            last_acked_sequence=self.acked_sequence,
        )
        await call.write(agent_pb2.AgentMessage(hello=hello))
        self.connections_total += 1
        reader = asyncio.create_task(self._read(call), name=f"sim-read-{self.node_id}")
        sent = self.acked_sequence
        try:
            while True:
                self._wake.clear()
                while self._outbox and not self.silent:
                    await call.write(agent_pb2.AgentMessage(command_result=self._outbox.popleft()))
                if not self.silent:
                    for report in list(self._reports):
                        if report.sequence > sent:
                            await call.write(agent_pb2.AgentMessage(report=report))
                            sent = report.sequence
                            self.sent_total += 1
                if reader.done():
                    reader.result()  # raises the stream's error, if any
                    return  # the coordinator ended the call
                if self._closing and not self.silent:
                    await call.done_writing()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(reader), 5.0)
                    return
                if self._closing:
                    call.cancel()
                    return
                await self._wake.wait()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reader

    async def _read(self, call: Any) -> None:
        try:
            while True:
                message = await call.read()
                if message is EOF:
                    return
                kind = message.WhichOneof("kind")
                if kind == "ack":
                    self._on_ack(message.ack.sequence)
                elif kind == "command" and not self.silent:
                    self._on_command(message.command)
        finally:
            self._wake.set()

    def _on_ack(self, sequence: int) -> None:
        self.acked_sequence = max(self.acked_sequence, sequence)
        while self._reports and self._reports[0].sequence <= sequence:
            self._reports.popleft()
        self._backoff.reset()
        self._acked.set()

    def _on_command(self, command: agent_pb2.Command) -> None:
        result = self._answered.get(command.command_id)
        if result is None:
            result = self._answered[command.command_id] = self._answer(command)
            if len(self._answered) > REMEMBERED_COMMANDS:
                del self._answered[next(iter(self._answered))]  # the oldest (dicts keep insertion order)
        self._outbox.append(result)
        self._wake.set()
