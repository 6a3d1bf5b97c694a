"""Failure findings: dead ranks (minus the launcher's teardown), lost nodes, XIDs, lost GPUs, InfiniBand."""

from __future__ import annotations

import signal

import pytest
from training_builders import EXITED, rank_report, step

from clusterwatch.coordinator.detection.failures import NodeFailureDetector, rank_failure
from clusterwatch.coordinator.model.incidents import Kind, Severity
from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import NodeRecord, NodeState
from clusterwatch.v1 import node_pb2, training_pb2

pytestmark = pytest.mark.timeout(30)


def killed(sig: int, at_unix_s: float) -> training_pb2.RankExit:
    return training_pb2.RankExit(
        timestamp_unix_seconds=at_unix_s,
        signal=sig,
        description=f"killed by signal {sig} ({signal.Signals(sig).name})",
    )


def job_with(exits: dict[int, training_pb2.RankExit | None], world_size: int = 4) -> JobRecord:
    """Ranks 0..world_size-1 on node-<rank>; those in ``exits`` exited with that status."""
    store = JobStore()
    for rank in range(world_size):
        store.ingest(
            f"node-{rank}", [rank_report(rank, world_size=world_size, steps=[step(1)])], 10.0, 1000.0
        )
    for rank, exit_ in exits.items():
        report = rank_report(rank, world_size=world_size, state=EXITED, exit=exit_)
        store.ingest(f"node-{rank}", [report], 11.0, 1001.0)
    return store.jobs["train"]


def test_a_killed_rank_is_a_critical_failure_naming_rank_node_and_signal() -> None:
    finding = rank_failure(job_with({2: killed(signal.SIGKILL, 1000.5)}))
    assert finding is not None
    assert (finding.kind, finding.severity, finding.cause) == (
        Kind.RANK_FAILURE,
        Severity.CRITICAL,
        "process_exited",
    )
    assert (finding.ranks, finding.nodes) == ((2,), ("node-2",))
    assert finding.evidence["signal"] == signal.SIGKILL
    assert "rank 2 on node-2 killed by signal 9 (SIGKILL)" in finding.summary
    assert "3 of 4 ranks still running" in finding.summary


def test_ranks_the_launcher_tore_down_afterwards_are_not_blamed() -> None:
    exits = {
        1: training_pb2.RankExit(timestamp_unix_seconds=1000.2, exit_code=1, description="exit code 1"),
        0: killed(signal.SIGTERM, 1000.9),
        3: killed(signal.SIGTERM, 1001.0),
    }
    finding = rank_failure(job_with(exits))
    assert finding is not None
    assert finding.ranks == (1,)
    assert finding.evidence["exit_code"] == 1


def test_clean_exits_are_not_failures() -> None:
    clean = training_pb2.RankExit(
        timestamp_unix_seconds=1000.0, exit_code=0, clean=True, description="exit code 0"
    )
    assert rank_failure(job_with(dict.fromkeys(range(4), clean))) is None
    assert rank_failure(job_with({})) is None


def test_a_crashed_rank_not_yet_replaced_after_the_restart_is_no_new_failure() -> None:
    job = job_with(
        {1: training_pb2.RankExit(timestamp_unix_seconds=1000.2, exit_code=3, description="exit code 3")}
    )
    first = rank_failure(job)
    assert first is not None
    store = JobStore()
    store.jobs["train"] = job
    # The restarted group's rank 0 reports first; rank 1's record is still the crashed one.
    store.ingest("node-0", [rank_report(0, world_size=4, restart_count=1, steps=[step(1)])], 12.0, 1002.0)
    assert job.restart_count == 1
    assert rank_failure(job) is None


def node(
    node_id: str,
    report: node_pb2.NodeReport | None,
    previous: node_pb2.NodeReport | None = None,
    state: int = NodeState.NODE_STATE_UP,
) -> NodeRecord:
    return NodeRecord(node_id=node_id, state=state, report=report, previous=previous, last_sequence=7)


def gpus(*uuids: str, xids: dict[str, dict[int, int]] | None = None) -> node_pb2.NodeReport:
    report = node_pb2.NodeReport(sequence=1)
    for index, uuid in enumerate(uuids):
        gpu = report.gpus.add(index=index, uuid=uuid, name="H100")
        for code, count in (xids or {}).get(uuid, {}).items():
            gpu.xid_errors.add(xid=code, count=count)
    return report


def test_an_unreachable_node_hosting_ranks_is_critical_and_names_them() -> None:
    job = job_with({})
    findings = NodeFailureDetector().update(
        {
            "node-1": node("node-1", None, state=NodeState.NODE_STATE_UNREACHABLE),
            "idle": node("idle", None, state=NodeState.NODE_STATE_UNREACHABLE),
        },
        {"train": job},
    )
    by_node = {f.nodes[0]: f for f in findings}
    assert by_node["node-1"].severity == Severity.CRITICAL
    assert (by_node["node-1"].job, by_node["node-1"].ranks) == ("train", (1,))
    assert by_node["idle"].severity == Severity.WARNING
    assert all(f.kind == Kind.NODE_UNREACHABLE for f in findings)


def test_xids_are_latched_with_their_count_and_critical_ones_say_so() -> None:
    report = gpus("GPU-0001", "GPU-0002", xids={"GPU-0001": {79: 1}, "GPU-0002": {13: 4}})
    findings = NodeFailureDetector().update({"node-1": node("node-1", report)}, {"train": job_with({})})
    by_xid = {int(f.evidence["xid"]): f for f in findings}
    assert by_xid[79].severity == Severity.CRITICAL
    assert by_xid[79].latch_value == 1.0
    assert by_xid[79].ranks == (1,)  # rank 1's identity names GPU-0001
    assert by_xid[13].severity == Severity.WARNING
    assert by_xid[13].latch_value == 4.0


def test_a_gpu_that_disappears_is_lost_until_it_comes_back() -> None:
    detector = NodeFailureDetector()
    assert detector.update({"n": node("n", gpus("GPU-A", "GPU-B"))}, {}) == []
    (lost,) = detector.update({"n": node("n", gpus("GPU-A"))}, {})
    assert (lost.kind, lost.gpus, lost.cause) == (Kind.GPU_LOST, ("GPU-B",), "gpu_lost")
    assert detector.update({"n": node("n", gpus("GPU-A", "GPU-B"))}, {}) == []


def ib(state: str = "ACTIVE", downed: int = 0, symbol_errors: int = 0) -> node_pb2.NodeReport:
    report = node_pb2.NodeReport(sequence=1)
    report.ib_ports.add(
        device="mlx5_0",
        port=1,
        state=state,
        physical_state="LinkUp",
        link_downed_total=downed,
        symbol_errors_total=symbol_errors,
        receive_errors_total=0,
    )
    return report


def test_infiniband_down_flap_and_error_jump() -> None:
    detector = NodeFailureDetector(ib_errors_per_report=100)
    assert detector.update({"n": node("n", ib())}, {}) == []
    (down,) = detector.update({"n": node("n", ib(state="DOWN"), previous=ib())}, {})
    assert (down.kind, down.cause, down.latch_value) == (Kind.INFINIBAND, "link_down", None)
    (flap,) = detector.update({"n": node("n", ib(downed=1), previous=ib(state="DOWN"))}, {})
    assert (flap.cause, flap.latch_value) == ("link_flap", 1.0)
    assert detector.update({"n": node("n", ib(downed=1, symbol_errors=50), previous=ib(downed=1))}, {}) == []
    (errors,) = detector.update(
        {"n": node("n", ib(downed=1, symbol_errors=550), previous=ib(downed=1, symbol_errors=50))}, {}
    )
    assert (errors.cause, errors.evidence["errors_since_previous_report"]) == ("network", 500.0)


def test_a_port_never_seen_active_is_not_down() -> None:
    assert NodeFailureDetector().update({"n": node("n", ib(state="DOWN"))}, {}) == []


def collective(op: str, sequence: int, size: int) -> training_pb2.CollectiveInFlight:
    return training_pb2.CollectiveInFlight(
        op=op, group_name="0", sequence=sequence, blocking=True, size_bytes=size, dtype="float32"
    )


def test_a_failure_after_a_size_mismatch_names_the_rank_whose_size_differs() -> None:
    # What gloo does when rank 3 all-reduces 2 MiB where the others do 1 MiB: rank 2, which receives
    # rank 3's part, aborts; ranks 1 and 3 raise (and say so at once); rank 0 was torn down while its
    # heartbeat showed it in the collective.
    mib = 1 << 20
    store = JobStore()
    for rank in range(4):
        store.ingest(f"node-{rank}", [rank_report(rank, world_size=4, steps=[step(1)])], 10.0, 1000.0)
    beats = {
        0: training_pb2.Heartbeat(timestamp_unix_seconds=1000.1, collective=collective("all_reduce", 9, mib)),
        1: training_pb2.Heartbeat(
            timestamp_unix_seconds=1000.3, failed_collective=collective("all_reduce", 9, mib)
        ),
        2: training_pb2.Heartbeat(timestamp_unix_seconds=1000.0),  # its last beat came before the collective
        3: training_pb2.Heartbeat(
            timestamp_unix_seconds=1000.3, failed_collective=collective("all_reduce", 9, 2 * mib)
        ),
    }
    exits = {
        2: killed(signal.SIGABRT, 1000.2),
        1: training_pb2.RankExit(
            timestamp_unix_seconds=1000.3, exit_code=1, clean=True, description="exit code 1"
        ),
        3: training_pb2.RankExit(
            timestamp_unix_seconds=1000.3, exit_code=1, clean=True, description="exit code 1"
        ),
        0: killed(signal.SIGTERM, 1000.4),
    }
    for rank, exit_ in exits.items():
        report = rank_report(rank, world_size=4, state=EXITED, heartbeat=beats[rank], exit=exit_)
        store.ingest(f"node-{rank}", [report], 11.0, 1001.0)
    finding = rank_failure(store.jobs["train"])
    assert finding is not None
    assert finding.cause == "collective_mismatch"
    assert (finding.ranks, finding.nodes) == ((2, 3), ("node-2", "node-3"))
    assert finding.summary.startswith("job train: rank 2 on node-2 killed by signal 6 (SIGABRT)")
    assert finding.summary.endswith(
        "their last heartbeats show a collective mismatch: rank 3 on node-3: in all_reduce #9 (2.0MiB float32) "
        "of group 0 while ranks 0, 1 are in all_reduce #9 (1.0MiB float32)"
    )
    assert finding.evidence["collective_sequence"] == 9


def test_heartbeats_at_different_collective_numbers_are_no_mismatch() -> None:
    # A rank killed while its last heartbeat showed an earlier collective: not comparable, nothing said.
    store = JobStore()
    for rank in range(2):
        store.ingest(f"node-{rank}", [rank_report(rank, world_size=2, steps=[step(1)])], 10.0, 1000.0)
    beat0 = training_pb2.Heartbeat(timestamp_unix_seconds=1000.0, collective=collective("broadcast", 8, 4))
    beat1 = training_pb2.Heartbeat(
        timestamp_unix_seconds=1000.0, failed_collective=collective("all_reduce", 9, 64)
    )
    store.ingest(
        "node-0",
        [rank_report(0, world_size=2, state=EXITED, heartbeat=beat0, exit=killed(signal.SIGKILL, 1000.5))],
        11.0,
        1001.0,
    )
    store.ingest("node-1", [rank_report(1, world_size=2, heartbeat=beat1)], 11.0, 1001.0)
    finding = rank_failure(store.jobs["train"])
    assert finding is not None
    assert (finding.cause, finding.ranks) == ("process_exited", (0,))
    assert "mismatch" not in finding.summary
