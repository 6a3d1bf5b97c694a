"""A node cut off from the coordinator is judged by what its ranks' peers on other nodes report
(coordinator/detection/round.py judge_unreachable, coordinator/detection/hangs.py): pure functions of the job store
(fed through the real JobStore) and the cluster state, with the clock as an argument."""

from __future__ import annotations

import pytest
from training_builders import rank_report, step

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.hangs import CulpritReason, HangSettings, detect_hang
from clusterwatch.coordinator.detection.round import Detection
from clusterwatch.coordinator.model.incidents import Finding, Kind, Severity
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.model.state import NodeRecord, NodeState
from clusterwatch.v1 import training_pb2

pytestmark = pytest.mark.timeout(30)

HANG = HangSettings(floor_s=5.0, p99_factor=3.0, heartbeat_stale_s=5.0)
SILENT_AT = 100.0  # node-0's last report, coordinator monotonic seconds
# Peer news after this proves node-0's ranks alive: its last report + both intervals (1 s) + 0.5 s.
PROOF_AFTER = SILENT_AT + 2.5


def beat(at_unix_s: float) -> training_pb2.Heartbeat:
    return training_pb2.Heartbeat(timestamp_unix_seconds=at_unix_s)


def report_steps(store: JobStore, node: str, rank: int, steps: range, at_mono_s: float) -> None:
    """``rank`` (on ``node``) reports ``steps`` and a heartbeat, arriving at ``at_mono_s``."""
    store.ingest(
        node,
        [rank_report(rank, steps=[step(n) for n in steps], heartbeat=beat(at_mono_s))],
        now_mono=at_mono_s,
        now_unix=at_mono_s,
    )


def nodes() -> dict[str, NodeRecord]:
    return {
        "node-0": NodeRecord(
            "node-0", state=NodeState.NODE_STATE_UNREACHABLE, last_seen_monotonic_s=SILENT_AT
        ),
        "node-1": NodeRecord("node-1", state=NodeState.NODE_STATE_UP, last_seen_monotonic_s=SILENT_AT + 5),
    }


def job_split_over_two_nodes(peer_steps_until_mono_s: float) -> JobStore:
    """Rank 0 on node-0 (silent since SILENT_AT), rank 1 on node-1 stepping until ``peer_steps_until_mono_s``."""
    store = JobStore()
    report_steps(store, "node-0", 0, range(10), SILENT_AT)
    report_steps(store, "node-1", 1, range(10), SILENT_AT)
    at, n = SILENT_AT + 0.5, 10
    while at <= peer_steps_until_mono_s:
        report_steps(store, "node-1", 1, range(n, n + 1), at)
        at, n = at + 0.5, n + 1
    return store


def unreachable_finding(store: JobStore, now_mono_s: float) -> Finding:
    findings = Detection(DetectionSettings()).run(store.jobs, nodes(), now_mono_s)
    (finding,) = [f for f in findings if f.kind == Kind.NODE_UNREACHABLE]
    return finding


def test_a_node_whose_ranks_peers_keep_stepping_is_only_cut_off_a_warning() -> None:
    store = job_split_over_two_nodes(peer_steps_until_mono_s=110.0)
    finding = unreachable_finding(store, now_mono_s=110.0)
    assert finding.severity == Severity.WARNING  # the recovery policy leaves it alone
    assert finding.summary.endswith("so its ranks are alive: only its link to the coordinator is down")
    assert finding.evidence["peers_progressing"] == 1.0
    assert finding.job == "train"


def test_a_node_whose_ranks_peers_stopped_with_it_is_critical() -> None:
    store = job_split_over_two_nodes(peer_steps_until_mono_s=PROOF_AFTER - 0.5)  # news of steps from before
    # No news yet either way: a warning, so the policy does not act on a guess...
    waiting = unreachable_finding(store, now_mono_s=PROOF_AFTER + 1.0)
    assert waiting.severity == Severity.WARNING
    assert waiting.evidence["peers_progressing"] == 0.0
    # ...then, still without proof of life, critical as the failure detector made it.
    dead = unreachable_finding(store, now_mono_s=PROOF_AFTER + 2.0)
    assert dead.severity == Severity.CRITICAL
    assert "peers_progressing" not in dead.evidence


def test_a_node_hosting_every_rank_of_its_job_has_nobody_to_tell_and_is_critical() -> None:
    store = JobStore()
    for rank in (0, 1):
        report_steps(store, "node-0", rank, range(10), SILENT_AT)
    assert unreachable_finding(store, now_mono_s=SILENT_AT + 3.0).severity == Severity.CRITICAL


def test_a_job_progressing_on_reachable_nodes_is_not_hung() -> None:
    store = job_split_over_two_nodes(peer_steps_until_mono_s=200.0)
    job = store.jobs["train"]
    assert detect_hang(job, 200.0, HANG, unreachable_nodes={"node-0"}) is None


def test_a_job_entirely_on_an_unreachable_node_is_not_judged() -> None:
    store = JobStore()
    for rank in (0, 1):
        report_steps(store, "node-0", rank, range(10), SILENT_AT)
    job = store.jobs["train"]
    assert detect_hang(job, SILENT_AT + 60, HANG, unreachable_nodes={"node-0"}) is None
    assert detect_hang(job, SILENT_AT + 60, HANG) is not None  # reachable but silent: hung


def test_in_a_hang_ranks_of_an_unreachable_node_are_unknown_not_frozen() -> None:
    store = job_split_over_two_nodes(peer_steps_until_mono_s=SILENT_AT)
    # Rank 1 (node-1) stopped stepping but heartbeats on, waiting in the collective; rank 0's news stopped.
    store.ingest(
        "node-1", [rank_report(1, heartbeat=beat(SILENT_AT + 19))], now_mono=SILENT_AT + 19, now_unix=0.0
    )
    finding = detect_hang(store.jobs["train"], SILENT_AT + 20, HANG, unreachable_nodes={"node-0"})
    assert finding is not None
    assert [(c.rank, c.reason) for c in finding.culprits] == [(0, CulpritReason.NODE_UNREACHABLE)]
    assert "rank 0 on node-0: its node stopped reporting: state unknown" in finding.summary
