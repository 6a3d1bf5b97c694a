"""AgentService: the thin gRPC face of Coordinator for agent streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from clusterwatch.coordinator.api.access import AccessPolicy
from clusterwatch.coordinator.group.homing import Homing
from clusterwatch.coordinator.ingest.core import Coordinator
from clusterwatch.coordinator.ingest.sessions import AgentSession
from clusterwatch.errors import AbortedError, InvalidReportError, MovedError
from clusterwatch.v1 import agent_pb2, agent_pb2_grpc, node_pb2

logger = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[agent_pb2.AgentMessage, agent_pb2.CoordinatorMessage]

# grpc.aio's end-of-stream marker (missing from grpc-stubs).
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]

# How long a stream that ends waits for its writer to finish the write under way.
WRITER_STOP_S = 1.0


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Args:
    report_settings: sent first on every stream (None: nothing, agents send full reports).
    homing: which streams and jobs are this coordinator's, in a group of several (None: all).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        access: AccessPolicy | None = None,
        report_settings: agent_pb2.ReportSettings | None = None,
        homing: Homing | None = None,
    ) -> None:
        self._core = coordinator
        self._access = access or AccessPolicy({}, ())
        self._report_settings = report_settings
        self._homing = homing

    # Driven with context.read()/write() so acks and commands can be written
    # while reports are read; the generated base class only types the
    # generator style.
    async def Connect(  # type: ignore[override]  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: Context
    ) -> None:
        first = await context.read()
        if first is EOF:
            return
        assert isinstance(first, agent_pb2.AgentMessage)  # noqa: S101 - narrowing for mypy
        if first.WhichOneof("kind") != "hello":
            raise InvalidReportError("the first message on a stream must be a hello")
        self._access.check_node(context, first.hello.node_id)
        if self._homing is not None:
            self._homing.check_hello(first.hello)
        session = self._core.open_stream(first.hello)
        if self._report_settings is not None:
            session.send_report_settings(self._report_settings)
        writer = asyncio.create_task(self._write(session, context), name=f"acks-{session.node_id}")
        graceful = False
        try:
            graceful = await self._read(session, context)
        finally:
            # Let the writer finish the write under way: gRPC cannot end a call (with the
            # status the interceptor sends) while one is in flight.
            session.stop()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, TimeoutError):
                await asyncio.wait_for(writer, WRITER_STOP_S)
            self._core.close_stream(session, graceful)

    async def _read(self, session: AgentSession, context: Context) -> bool:
        """Apply messages until the agent half-closes (True) or is superseded."""
        while True:
            message: Any = await context.read()
            if message is EOF:
                return True
            if not self._core.is_current(session):
                raise AbortedError("superseded by a newer stream from the same node")
            if session.shed is not None:  # before applying: the agent replays this report later
                raise session.shed
            kind = message.WhichOneof("kind")
            if kind == "report":
                if self._homing is not None:
                    self._place(session, message.report)
                self._core.ingest(session, message.report)
            elif kind == "command_result":
                session.resolve(message.command_result)
            else:
                raise InvalidReportError(f"unexpected {kind or 'empty'} message after the hello")

    def _place(self, session: AgentSession, report: node_pb2.NodeReport) -> None:
        """Keep the report here (coordinator/group/homing.py) and tell the agent of group changes.

        Raises:
            MovedError: the node reports to another coordinator now; it is forgotten here.
        """
        assert self._homing is not None  # noqa: S101 - narrowing for mypy
        generation = self._homing.generation
        if session.group_generation != generation:
            session.send_group(self._homing.group_message(), generation)
        try:
            self._homing.check(session.node_id, report)
        except MovedError as exc:
            self._core.release_node(session, exc.home_address)
            raise

    async def _write(self, session: AgentSession, context: Context) -> None:
        """The stream's only writer: periodic cumulative acks, checkpoint state and queued commands."""
        while True:
            await session.wake.wait()
            session.wake.clear()
            if session.stopping:
                # What was applied is acknowledged even as the stream ends (the node moved to another
                # coordinator): else the agent would replay it there, and a report from before a change
                # of its jobs could send it back here.
                sequence = session.take_ack()
                if sequence is not None:
                    await context.write(agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=sequence)))
                return
            report_settings = session.take_report_settings()
            if report_settings is not None:
                await context.write(agent_pb2.CoordinatorMessage(report_settings=report_settings))
            group = session.take_group()
            if group is not None:
                await context.write(agent_pb2.CoordinatorMessage(group=group))
            sequence = session.take_ack()
            if sequence is not None:
                await context.write(agent_pb2.CoordinatorMessage(ack=agent_pb2.Ack(sequence=sequence)))
            checkpoints = session.take_checkpoints()
            if checkpoints is not None:
                await context.write(agent_pb2.CoordinatorMessage(checkpoints=checkpoints))
            while session.outbox:
                await context.write(agent_pb2.CoordinatorMessage(command=session.outbox.popleft()))
