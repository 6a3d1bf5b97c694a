"""The coordinator's in-memory picture of the cluster.

Pure state: methods take the current time and return the events they caused;
callers persist the events and do all I/O. Runs on the event loop's thread.

Node states (``cluster_pb2.NodeState``), transitions:

    (new) --hello--> UP
    UP --no report for `unreachable_after_intervals` intervals--> UNREACHABLE
    UP --agent closed its stream--> LEFT
    UNREACHABLE / LEFT --report--> UP            (event node_back)
    UNKNOWN (known from the database after a coordinator restart)
        --report--> UP (no event: the node never went away)
        --no report within the unreachable window--> UNREACHABLE
"""

from __future__ import annotations

import dataclasses
import enum

from clusterwatch.errors import InvalidReportError
from clusterwatch.v1 import agent_pb2, cluster_pb2, node_pb2
from clusterwatch.wire.limits import MAX_SEQUENCE_JUMP
from clusterwatch.wire.topology import Wiring

NodeState = cluster_pb2.NodeState

# Interval assumed for nodes known only from the database.
DEFAULT_INTERVAL_S = 1.0


# A node restored from the database after a coordinator restart is not called
# unreachable before this: at least twice the agents' reconnect backoff cap (4 s).
RESTORED_GRACE_S = 10.0


class EventKind(enum.StrEnum):
    NODE_JOINED = "node_joined"
    NODE_LEFT = "node_left"
    NODE_UNREACHABLE = "node_unreachable"
    NODE_BACK = "node_back"
    # The node's agent reports to another coordinator of the group now (coordinator/group/homing.py).
    NODE_MOVED = "node_moved"
    COORDINATOR_STARTED = "coordinator_started"
    # BeginJob / EndJob (a SLURM Prolog / Epilog); node_id is empty.
    JOB_REGISTERED = "job_registered"
    JOB_ENDED = "job_ended"
    # An admin credential was used (ClusterService actions); detail: who and what.
    ADMIN_REQUEST = "admin_request"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: EventKind
    node_id: str
    timestamp_unix_s: float
    detail: str = ""


@dataclasses.dataclass
class NodeRecord:
    """Everything the coordinator knows about one node."""

    node_id: str
    hostname: str = ""
    agent_version: str = ""
    instance_id: str = ""
    interval_s: float = DEFAULT_INTERVAL_S
    state: cluster_pb2.NodeState.ValueType = NodeState.NODE_STATE_UNKNOWN
    last_seen_monotonic_s: float = 0.0
    last_seen_unix_s: float = 0.0
    last_sequence: int = 0
    reports_received_total: int = 0
    reports_missed_total: int = 0
    report: node_pb2.NodeReport | None = None
    previous: node_pb2.NodeReport | None = None
    # Identifies the stream currently feeding this node; a newer one supersedes it.
    stream_id: int = 0
    # How the node is wired (Hello.topology, NodeReport.topology); None until an agent sends one.
    wiring: Wiring | None = None
    topology_received_unix_s: float = 0.0
    # Its agent was refused admission and is due back by then (monotonic): not silent until then.
    excused_until_monotonic_s: float = 0.0
    # ... and until a whole unreachable window later its ranks' data may be stale for that reason:
    # detection treats it as not heard from (it reported again by then, or is unreachable).
    unheard_until_monotonic_s: float = 0.0
    # Its agent's probe server port (Hello.probe_port; 0: none, or an agent that has none).
    probe_port: int = 0

    @property
    def topology(self) -> node_pb2.NodeTopology | None:
        return self.wiring.topology if self.wiring is not None else None

    def set_topology(self, topology: node_pb2.NodeTopology, now_unix: float) -> None:
        self.wiring, self.topology_received_unix_s = Wiring.of(topology), now_unix


class ClusterState:
    """Nodes, their latest reports and liveness.

    Args:
        unreachable_after_intervals: missed intervals before a node is unreachable.
    """

    def __init__(self, unreachable_after_intervals: float = 3.0) -> None:
        self.unreachable_after_intervals = unreachable_after_intervals
        self.nodes: dict[str, NodeRecord] = {}
        self._next_stream_id = 0

    def restore(self, node_id: str, hostname: str, interval_s: float, now_mono: float) -> None:
        """Add a node known from the database as UNKNOWN, timed from ``now_mono``."""
        self.nodes[node_id] = NodeRecord(
            node_id=node_id,
            hostname=hostname,
            interval_s=interval_s or DEFAULT_INTERVAL_S,
            last_seen_monotonic_s=now_mono,
        )

    def hello(self, hello: agent_pb2.Hello, now_mono: float, now_unix: float) -> tuple[int, list[Event]]:
        """Register a new stream for ``hello.node_id``; return its stream id and events.

        Raises:
            InvalidReportError: if the hello lacks what the protocol requires.
        """
        if not hello.node_id:
            raise InvalidReportError("hello.node_id is empty")
        if not hello.instance_id:
            raise InvalidReportError("hello.instance_id is empty")
        if not hello.interval_seconds > 0:
            raise InvalidReportError(f"hello.interval_seconds must be > 0, got {hello.interval_seconds}")
        events: list[Event] = []
        record = self.nodes.get(hello.node_id)
        if record is None:
            record = self.nodes[hello.node_id] = NodeRecord(node_id=hello.node_id)
            events.append(Event(EventKind.NODE_JOINED, hello.node_id, now_unix, f"hostname={hello.hostname}"))
        elif record.state in (NodeState.NODE_STATE_UNREACHABLE, NodeState.NODE_STATE_LEFT):
            events.append(Event(EventKind.NODE_BACK, hello.node_id, now_unix, _was(record)))
        if record.instance_id != hello.instance_id:
            # A new agent process numbers from 1; after a coordinator restart the
            # agent says where its acknowledged sequence stands.
            record.instance_id = hello.instance_id
            record.last_sequence = hello.last_acked_sequence
        record.hostname = hello.hostname
        record.agent_version = hello.agent_version
        record.interval_s = hello.interval_seconds
        record.probe_port = hello.probe_port
        record.state = NodeState.NODE_STATE_UP
        record.last_seen_monotonic_s = now_mono
        record.last_seen_unix_s = now_unix
        if hello.HasField("topology"):
            record.set_topology(hello.topology, now_unix)
        self._next_stream_id += 1
        record.stream_id = self._next_stream_id
        return record.stream_id, events

    def ingest(
        self, node_id: str, report: node_pb2.NodeReport, now_mono: float, now_unix: float
    ) -> list[Event]:
        """Apply one report; a sequence at or below the last applied one is a replay and ignored.

        Raises:
            InvalidReportError: if the report breaks the protocol.
        """
        if report.sequence == 0:
            raise InvalidReportError("report.sequence must start at 1")
        record = self.nodes[node_id]
        events: list[Event] = []
        if record.state != NodeState.NODE_STATE_UP:
            if record.state != NodeState.NODE_STATE_UNKNOWN:
                events.append(Event(EventKind.NODE_BACK, node_id, now_unix, _was(record)))
            record.state = NodeState.NODE_STATE_UP
        record.last_seen_monotonic_s = now_mono
        record.last_seen_unix_s = now_unix
        if report.sequence <= record.last_sequence:
            return events
        if record.last_sequence and report.sequence > record.last_sequence + 1:
            record.reports_missed_total += report.sequence - record.last_sequence - 1
        record.last_sequence = report.sequence
        record.reports_received_total += 1
        record.previous, record.report = record.report, report
        if report.HasField("topology"):
            record.set_topology(report.topology, now_unix)
        return events

    def refuse(self, node_id: str, sequence: int) -> None:
        """A report of this sequence was refused: count it as received, so that its replay is skipped.

        A sequence that is no plausible successor (0, or MAX_SEQUENCE_JUMP ahead) changes nothing.
        """
        record = self.nodes[node_id]
        if not record.last_sequence < sequence <= record.last_sequence + MAX_SEQUENCE_JUMP:
            return
        if record.last_sequence and sequence > record.last_sequence + 1:
            record.reports_missed_total += sequence - record.last_sequence - 1
        record.last_sequence = sequence

    def stream_closed(self, node_id: str, stream_id: int, graceful: bool, now_unix: float) -> list[Event]:
        """A stream ended; a graceful close by the agent means the node left."""
        record = self.nodes.get(node_id)
        if record is None or record.stream_id != stream_id or not graceful:
            return []
        if record.state != NodeState.NODE_STATE_UP:
            return []
        record.state = NodeState.NODE_STATE_LEFT
        return [Event(EventKind.NODE_LEFT, node_id, now_unix, "agent closed its stream")]

    def is_current_stream(self, node_id: str, stream_id: int) -> bool:
        record = self.nodes.get(node_id)
        return record is not None and record.stream_id == stream_id

    def excuse(self, node_id: str, until_mono: float) -> None:
        """The node's agent was refused admission (coordinator/ingest/capacity.py) and is due back by
        ``until_mono``: it is alive, so its silence counts only from then."""
        record = self.nodes.get(node_id)
        if record is not None:
            record.excused_until_monotonic_s = max(record.excused_until_monotonic_s, until_mono)
            record.unheard_until_monotonic_s = record.excused_until_monotonic_s + (
                self.unreachable_after_intervals * record.interval_s
            )

    def extend_excuses(self, since_mono: float, until_mono: float) -> None:
        """Excuse until ``until_mono`` every node excused at or after ``since_mono`` (the coordinator is
        still refusing agents: coordinator/ingest/capacity.py)."""
        for record in self.nodes.values():
            if record.excused_until_monotonic_s >= since_mono:
                self.excuse(record.node_id, until_mono)

    def check_liveness(self, now_mono: float, now_unix: float, counts_from_mono: float = 0.0) -> list[Event]:
        """Mark nodes that missed too many intervals unreachable.

        Args:
            counts_from_mono: silence before this moment does not count (the coordinator
                was behind until then: coordinator/model/lag.py).
        """
        events: list[Event] = []
        for record in self.nodes.values():
            if record.state not in (NodeState.NODE_STATE_UP, NodeState.NODE_STATE_UNKNOWN):
                continue
            silent_s = now_mono - max(
                record.last_seen_monotonic_s, record.excused_until_monotonic_s, counts_from_mono
            )
            limit_s = self.unreachable_after_intervals * record.interval_s
            if record.state == NodeState.NODE_STATE_UNKNOWN:
                # Known from before a restart: give its agent time to find us again.
                limit_s = max(limit_s, RESTORED_GRACE_S)
            if silent_s > limit_s:
                record.state = NodeState.NODE_STATE_UNREACHABLE
                events.append(
                    Event(
                        EventKind.NODE_UNREACHABLE, record.node_id, now_unix, f"silent for {silent_s:.1f} s"
                    )
                )
        return events


def _was(record: NodeRecord) -> str:
    return f"was {NodeState.Name(record.state).removeprefix('NODE_STATE_').lower()}"
