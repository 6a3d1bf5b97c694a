"""ClusterState: the node state machine, sequences and gaps, with injected clocks."""

from __future__ import annotations

import pytest

from clusterwatch.coordinator.model.state import RESTORED_GRACE_S, ClusterState, EventKind
from clusterwatch.errors import InvalidReportError
from clusterwatch.v1 import agent_pb2, cluster_pb2, node_pb2

pytestmark = pytest.mark.timeout(10)

S = cluster_pb2.NodeState


def hello(
    node: str = "n1", instance: str = "i1", last_acked: int = 0, interval_s: float = 1.0
) -> agent_pb2.Hello:
    return agent_pb2.Hello(
        node_id=node,
        instance_id=instance,
        interval_seconds=interval_s,
        last_acked_sequence=last_acked,
        hostname="h",
    )


def report(seq: int) -> node_pb2.NodeReport:
    return node_pb2.NodeReport(sequence=seq, timestamp_unix_seconds=1000.0 + seq)


def kinds(events: list) -> list[EventKind]:  # type: ignore[type-arg]
    return [e.kind for e in events]


def test_join_report_and_replays_are_idempotent() -> None:
    state = ClusterState()
    _, events = state.hello(hello(), 0.0, 100.0)
    assert kinds(events) == [EventKind.NODE_JOINED]
    for seq in (1, 2, 3, 2, 3):  # 2 and 3 replayed after a lost ack
        state.ingest("n1", report(seq), 0.1, 100.1)
    node = state.nodes["n1"]
    assert (node.last_sequence, node.reports_received_total, node.reports_missed_total) == (3, 3, 0)
    assert node.report is not None
    assert node.report.sequence == 3
    assert node.previous is not None
    assert node.previous.sequence == 2


def test_gap_after_restart_counts_from_the_agents_last_acked_sequence() -> None:
    state = ClusterState()
    state.hello(hello(last_acked=10), 0.0, 100.0)  # a coordinator that never saw 1..10
    state.ingest("n1", report(12), 0.1, 100.1)  # 11 never arrived
    assert state.nodes["n1"].reports_missed_total == 1


def test_new_agent_instance_restarts_the_sequence() -> None:
    state = ClusterState()
    state.hello(hello(instance="old"), 0.0, 100.0)
    state.ingest("n1", report(50), 0.1, 100.1)
    state.hello(hello(instance="new"), 1.0, 101.0)
    state.ingest("n1", report(1), 1.1, 101.1)
    node = state.nodes["n1"]
    assert node.last_sequence == 1
    assert node.report is not None
    assert node.report.sequence == 1


def test_silence_makes_unreachable_and_a_report_brings_it_back() -> None:
    state = ClusterState(unreachable_after_intervals=3)
    state.hello(hello(interval_s=1.0), 0.0, 100.0)
    state.ingest("n1", report(1), 0.0, 100.0)
    assert state.check_liveness(2.9, 102.9) == []
    events = state.check_liveness(3.1, 103.1)
    assert kinds(events) == [EventKind.NODE_UNREACHABLE]
    assert state.nodes["n1"].state == S.NODE_STATE_UNREACHABLE
    assert state.check_liveness(10.0, 110.0) == []  # reported once, not every check
    assert kinds(state.ingest("n1", report(2), 11.0, 111.0)) == [EventKind.NODE_BACK]
    assert state.nodes["n1"].state == S.NODE_STATE_UP


def test_graceful_close_means_left_and_only_for_the_current_stream() -> None:
    state = ClusterState()
    old_stream, _ = state.hello(hello(), 0.0, 100.0)
    new_stream, _ = state.hello(hello(), 1.0, 101.0)  # reconnect before the old stream ended
    assert state.stream_closed("n1", old_stream, graceful=True, now_unix=102.0) == []
    assert state.nodes["n1"].state == S.NODE_STATE_UP
    assert kinds(state.stream_closed("n1", new_stream, graceful=True, now_unix=103.0)) == [
        EventKind.NODE_LEFT
    ]
    assert state.nodes["n1"].state == S.NODE_STATE_LEFT
    assert state.check_liveness(100.0, 200.0) == []  # a node that left is not unreachable


def test_restored_node_is_unknown_then_up_without_an_event_or_unreachable_if_silent() -> None:
    state = ClusterState(unreachable_after_intervals=3)
    state.restore("quiet", "h", 1.0, now_mono=0.0)
    state.restore("back", "h", 1.0, now_mono=0.0)
    assert state.nodes["quiet"].state == S.NODE_STATE_UNKNOWN
    _, events = state.hello(hello(node="back"), 1.0, 101.0)
    assert events == []
    # A restored node gets RESTORED_GRACE_S (its agent's reconnect backoff), not just 3 intervals.
    assert kinds(state.check_liveness(3.5, 103.5)) == []
    assert state.nodes["quiet"].state == S.NODE_STATE_UNKNOWN
    later_s = RESTORED_GRACE_S + 0.5
    events = state.check_liveness(later_s, 100 + later_s)  # "back" fell silent too, after 3 intervals
    assert sorted((e.kind, e.node_id) for e in events) == [
        (EventKind.NODE_UNREACHABLE, "back"),
        (EventKind.NODE_UNREACHABLE, "quiet"),
    ]
    assert state.nodes["quiet"].state == S.NODE_STATE_UNREACHABLE


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (agent_pb2.Hello(instance_id="i", interval_seconds=1), "node_id"),
        (agent_pb2.Hello(node_id="n", interval_seconds=1), "instance_id"),
        (agent_pb2.Hello(node_id="n", instance_id="i", interval_seconds=-1), "interval_seconds"),
    ],
)
def test_bad_hello_is_rejected_naming_the_field(bad: agent_pb2.Hello, message: str) -> None:
    with pytest.raises(InvalidReportError, match=message):
        ClusterState().hello(bad, 0.0, 0.0)


def test_sequence_zero_is_rejected() -> None:
    state = ClusterState()
    state.hello(hello(), 0.0, 0.0)
    with pytest.raises(InvalidReportError, match="sequence"):
        state.ingest("n1", report(0), 0.0, 0.0)
