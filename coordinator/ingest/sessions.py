"""Per-stream bookkeeping: what to acknowledge, which commands and checkpoint state to send down."""

from __future__ import annotations

import asyncio
import collections

from clusterwatch.coordinator.ingest.report_checks import check_command_result
from clusterwatch.errors import ResourceExhaustedError
from clusterwatch.v1 import agent_pb2

ACK_INTERVAL_S = 2.0


class AgentSession:
    """One open Connect stream of one agent.

    The stream's reader records applied sequences; the writer sends one
    cumulative ack at once when the stream opens and then whenever the
    coordinator's ack ticker (every ACK_INTERVAL_S, one timer for all
    streams) finds one due. Acks only bound the agent's replay buffer, so they need
    not be per report: writing one costs the coordinator as much CPU as
    reading a report (measured with bench/ingest.py). Commands and checkpoint
    state wake the writer immediately.

    Checkpoint state (``JobCheckpoints``) is a full picture, not a delta, so
    only the newest one waits to be sent: an agent that is slow to read gets
    one up-to-date message, not a backlog.
    """

    def __init__(self, node_id: str, stream_id: int, replay_through: int = 0) -> None:
        self.node_id = node_id
        self.stream_id = stream_id
        # Reports up to this sequence were buffered before the stream opened (Hello.newest_sequence).
        self.replay_through = replay_through
        self.applied_sequence = 0
        # Set when the coordinator sheds this stream (coordinator/ingest/capacity.py): the reader raises it
        # before applying the next report.
        self.shed: ResourceExhaustedError | None = None
        # True when the agent has not been told the current applied_sequence;
        # starts True so a new stream is acknowledged at once.
        self.ack_due = True
        self.outbox: collections.deque[agent_pb2.Command] = collections.deque()
        self._checkpoints: agent_pb2.JobCheckpoints | None = None
        self._report_settings: agent_pb2.ReportSettings | None = None
        self._group: agent_pb2.CoordinatorGroup | None = None
        # The group generation the agent was last told of (coordinator/group/homing.py); -1: none yet.
        self.group_generation = -1
        self.wake = asyncio.Event()
        self.wake.set()
        # Set when the stream ends: the writer returns once the write under way is done
        # (ending the call while a write is in flight fails in gRPC: TOO_MANY_OPERATIONS).
        self.stopping = False
        self._waiting: dict[str, asyncio.Future[agent_pb2.CommandResult]] = {}

    def applied(self, sequence: int) -> None:
        """Everything up to ``sequence`` is in the cluster state (replays included)."""
        if sequence > self.applied_sequence:
            self.applied_sequence = sequence
            self.ack_due = True

    def stop(self) -> None:
        """The stream is ending: wake the writer so that it returns (see ``stopping``)."""
        self.stopping = True
        self.wake.set()

    def wake_if_ack_due(self) -> None:
        if self.ack_due:
            self.wake.set()

    def take_ack(self) -> int | None:
        """The sequence to acknowledge now, or None if the agent already knows it."""
        if not self.ack_due:
            return None
        self.ack_due = False
        return self.applied_sequence

    def send(self, command: agent_pb2.Command) -> asyncio.Future[agent_pb2.CommandResult]:
        """Queue a command; the future resolves with the agent's result."""
        future = self._waiting.get(command.command_id)
        if future is None:
            future = self._waiting[command.command_id] = asyncio.get_running_loop().create_future()
            self.outbox.append(command)
            self.wake.set()
        return future

    def send_checkpoints(self, checkpoints: agent_pb2.JobCheckpoints) -> None:
        """Queue the current checkpoint state, replacing any not yet sent."""
        self._checkpoints = checkpoints
        self.wake.set()

    def take_checkpoints(self) -> agent_pb2.JobCheckpoints | None:
        """The checkpoint state to send now, or None if nothing new."""
        checkpoints, self._checkpoints = self._checkpoints, None
        return checkpoints

    def send_report_settings(self, settings: agent_pb2.ReportSettings) -> None:
        """Queue what this coordinator wants in reports; the writer sends it before anything else."""
        self._report_settings = settings
        self.wake.set()

    def take_report_settings(self) -> agent_pb2.ReportSettings | None:
        settings, self._report_settings = self._report_settings, None
        return settings

    def send_group(self, group: agent_pb2.CoordinatorGroup, generation: int) -> None:
        """Queue the coordinators of the group as of ``generation``, replacing any not yet sent."""
        self._group = group
        self.group_generation = generation
        self.wake.set()

    def take_group(self) -> agent_pb2.CoordinatorGroup | None:
        group, self._group = self._group, None
        return group

    def resolve(self, result: agent_pb2.CommandResult) -> None:
        """Hand a command's result to whoever waits for it (nobody: it is dropped).

        Raises:
            ReportCheckError: a result no honest agent sends (an unknown status, a 10 MB message...).
        """
        check_command_result(result)
        future = self._waiting.pop(result.command_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def fail_pending(self, reason: str) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ConnectionError(reason))
        self._waiting.clear()
