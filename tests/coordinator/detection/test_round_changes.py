"""A detection round works on what changed (issue 20, item 4) and still reports what holds.

Node reports are read once each and per-job verdicts are kept per job revision
(coordinator/detection/round.py, failures.py): these tests hold the rounds to
the findings a fresh walk would make, through the real JobStore.
"""

from __future__ import annotations

import pytest
from training_builders import EXITED, rank_report, step

from clusterwatch.config import DetectionSettings
from clusterwatch.coordinator.detection.failures import NodeFailureDetector
from clusterwatch.coordinator.detection.round import Detection
from clusterwatch.coordinator.model.incidents import Kind
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord, NodeState
from clusterwatch.v1 import node_pb2, training_pb2

pytestmark = pytest.mark.timeout(30)

UP = NodeState.NODE_STATE_UP


def report_with_gpus(*uuids: str) -> node_pb2.NodeReport:
    report = node_pb2.NodeReport(sequence=1)
    for index, uuid in enumerate(uuids):
        report.gpus.add(index=index, uuid=uuid, name="H100")
    return report


def two_rank_job(at_mono_s: float, steps: range = range(1, 11)) -> JobStore:
    store = JobStore()
    for rank in (0, 1):
        store.ingest(
            f"node-{rank}",
            [rank_report(rank, steps=[step(n) for n in steps])],
            now_mono=at_mono_s,
            now_unix=at_mono_s,
        )
    return store


def up_nodes() -> dict[str, NodeRecord]:
    return {f"node-{n}": NodeRecord(f"node-{n}", state=UP, last_seen_monotonic_s=100.0) for n in (0, 1)}


def kinds(
    detection: Detection, store: JobStore, nodes: dict[str, NodeRecord], now_mono_s: float
) -> list[Kind]:
    return [f.kind for f in detection.run(store.jobs, nodes, now_mono_s)]


def test_a_condition_of_an_unchanged_report_holds_every_round_naming_the_ranks_hosted_then() -> None:
    """The report is read once; its lost GPU is found again each round while it is the node's
    latest, and names the rank that runs on that GPU once one does."""
    detector = NodeFailureDetector()
    assert (
        detector.update(
            {"node-1": NodeRecord("node-1", state=UP, report=report_with_gpus("GPU-0001", "GPU-0002"))}, {}
        )
        == []
    )
    record = NodeRecord("node-1", state=UP, report=report_with_gpus("GPU-0002"))
    (first,) = detector.update({"node-1": record}, {})
    assert (first.kind, first.job, first.ranks) == (Kind.GPU_LOST, "", ())
    store = two_rank_job(at_mono_s=100.0)  # rank 1 runs on node-1, on GPU-0001
    (again,) = detector.update({"node-1": record}, store.jobs)
    assert (again.key, again.job, again.ranks) == (first.key, "train", (1,))
    assert "rank 1 of job train runs on it" in again.summary


def test_an_unchanged_job_is_found_hung_once_its_timeout_passes() -> None:
    """No new rank data, so the verdicts are the kept ones; the hang moves with the clock alone."""
    store = two_rank_job(at_mono_s=100.0)
    detection = Detection(DetectionSettings())
    nodes = up_nodes()
    assert Kind.HANG not in kinds(detection, store, nodes, 101.0)
    revision = store.jobs["train"].revision
    assert Kind.HANG not in kinds(detection, store, nodes, 104.0)
    assert Kind.HANG in kinds(detection, store, nodes, 100.0 + 6.0)  # floor 5 s (3 x 0.5 s steps is less)
    assert store.jobs["train"].revision == revision


def test_new_rank_data_renews_the_kept_verdicts() -> None:
    store = two_rank_job(at_mono_s=100.0)
    detection = Detection(DetectionSettings())
    nodes = up_nodes()
    assert Kind.RANK_FAILURE not in kinds(detection, store, nodes, 101.0)
    crashed = training_pb2.RankExit(timestamp_unix_seconds=1001.0, exit_code=1, description="exit code 1")
    store.ingest("node-1", [rank_report(1, state=EXITED, exit=crashed)], now_mono=101.5, now_unix=101.5)
    assert Kind.RANK_FAILURE in kinds(detection, store, nodes, 102.0)


def test_a_node_going_unreachable_renews_the_hang_clock() -> None:
    """Progress is judged from the ranks whose news arrives: the same job data, judged again
    when the set of unreachable nodes changes."""
    store = JobStore()
    store.ingest("node-0", [rank_report(0, steps=[step(n) for n in range(1, 11)])], 100.0, 100.0)
    store.ingest("node-1", [rank_report(1, steps=[step(n) for n in range(1, 11)])], 100.0, 100.0)
    store.ingest("node-1", [rank_report(1, steps=[step(11)])], 103.0, 103.0)
    detection = Detection(DetectionSettings())
    nodes = up_nodes()
    assert Kind.HANG not in kinds(detection, store, nodes, 106.0)  # node-1's rank stepped at 103
    nodes["node-1"].state = NodeState.NODE_STATE_UNREACHABLE
    # Only node-0's rank is heard now, and it last progressed at 100.
    assert Kind.HANG in kinds(detection, store, nodes, 106.0)


def test_a_job_kept_out_by_admission_is_not_hung_until_a_window_after_its_excuse() -> None:
    """Every node of the job was refused admission (coordinator/ingest/capacity.py) after its last
    step: its ranks' data is stale because the coordinator kept them out, which is no hang. Once the
    excuse and a whole unreachable window have passed without a report, the node is unreachable and
    the job is judged through its peers as usual."""
    store = two_rank_job(at_mono_s=100.0)
    state = ClusterState(unreachable_after_intervals=3.0)
    for n in (0, 1):
        state.nodes[f"node-{n}"] = NodeRecord(f"node-{n}", state=UP, last_seen_monotonic_s=100.0)
        state.excuse(f"node-{n}", until_mono=130.0)
    detection = Detection(DetectionSettings())
    assert Kind.HANG not in kinds(detection, store, state.nodes, 120.0)  # refused: not heard from
    assert Kind.HANG not in kinds(detection, store, state.nodes, 132.9)  # excuse over, window not
    assert state.check_liveness(132.9, 132.9) == []
    assert [e.node_id for e in state.check_liveness(133.1, 133.1)] == ["node-0", "node-1"]
