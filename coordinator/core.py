"""The coordinator's domain object: state, history, sessions and liveness together.

Servicers call into it; it owns no network code. Every method runs on the
event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from clusterwatch.coordinator.event_log import EventLog
from clusterwatch.coordinator.sessions import ACK_INTERVAL_S, AgentSession
from clusterwatch.coordinator.state import ClusterState, Event, EventKind
from clusterwatch.v1 import agent_pb2, node_pb2

logger = logging.getLogger(__name__)


class Coordinator:
    """Cluster state plus its durable event log.

    Args:
        event_log: where events and the node registry persist.
        unreachable_after_intervals: missed intervals before a node is unreachable.
        clock / wall_clock: injectable monotonic and wall clocks.
    """

    def __init__(
        self,
        event_log: EventLog,
        unreachable_after_intervals: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = ClusterState(unreachable_after_intervals)
        self.event_log = event_log
        self.sessions: dict[str, AgentSession] = {}
        self._clock = clock
        self._wall = wall_clock
        self.started_unix_s = wall_clock()
        for node in event_log.nodes():
            self.state.restore(node.node_id, node.hostname, node.interval_s, clock())
        self._record(
            [Event(EventKind.COORDINATOR_STARTED, "", self.started_unix_s, f"{len(self.state.nodes)} known")]
        )

    def open_stream(self, hello: agent_pb2.Hello) -> AgentSession:
        """Register a new agent stream; a newer stream for the same node supersedes the old."""
        stream_id, events = self.state.hello(hello, self._clock(), self._wall())
        self.event_log.upsert_node(hello.node_id, hello.hostname, hello.interval_seconds, self._wall())
        self._record(events)
        previous = self.sessions.get(hello.node_id)
        if previous is not None:
            previous.fail_pending("superseded by a newer stream")
        session = self.sessions[hello.node_id] = AgentSession(hello.node_id, stream_id)
        session.applied_sequence = self.state.nodes[hello.node_id].last_sequence
        logger.info("node %s connected (agent %s, stream %d)", hello.node_id, hello.agent_version, stream_id)
        return session

    def is_current(self, session: AgentSession) -> bool:
        return self.state.is_current_stream(session.node_id, session.stream_id)

    def ingest(self, session: AgentSession, report: node_pb2.NodeReport) -> None:
        self._record(self.state.ingest(session.node_id, report, self._clock(), self._wall()))
        session.applied(self.state.nodes[session.node_id].last_sequence)

    def close_stream(self, session: AgentSession, graceful: bool) -> None:
        session.fail_pending("stream closed")
        if self.sessions.get(session.node_id) is session:
            del self.sessions[session.node_id]
        self._record(self.state.stream_closed(session.node_id, session.stream_id, graceful, self._wall()))

    async def send_command(
        self, node_id: str, command: agent_pb2.Command, timeout_s: float
    ) -> agent_pb2.CommandResult:
        """Send a command to a connected agent and wait for its result.

        Raises:
            KeyError: the node has no open stream.
            TimeoutError: no result within ``timeout_s``.
            ConnectionError: the stream closed first.
        """
        session = self.sessions[node_id]
        return await asyncio.wait_for(asyncio.shield(session.send(command)), timeout_s)

    async def watch_liveness(self, period_s: float = 0.2) -> None:
        """Mark silent nodes unreachable, forever (cancel to stop)."""
        while True:
            self._record(self.state.check_liveness(self._clock(), self._wall()))
            await asyncio.sleep(period_s)

    async def tick_acks(self, period_s: float = ACK_INTERVAL_S) -> None:
        """Wake every stream with an ack due, forever (cancel to stop).

        One timer for all streams instead of one per stream.
        """
        while True:
            await asyncio.sleep(period_s)
            for session in self.sessions.values():
                session.wake_if_ack_due()

    def _record(self, events: list[Event]) -> None:
        for event in events:
            logger.info("event %s node=%s %s", event.kind.value, event.node_id or "-", event.detail)
        try:
            self.event_log.append(events)
        except Exception:  # keep serving from memory; the log says what was lost
            logger.exception("could not persist %d events", len(events))
