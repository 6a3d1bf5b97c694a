"""The TUI's views as data: rows, marks and rates built from snapshots, without a terminal."""

from __future__ import annotations

import pytest
from training_builders import T0, rank_report, step

from clusterwatch.coordinator.detection.stragglers import StragglerDetector
from clusterwatch.coordinator.model.checkpoints import CheckpointTracker
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.views.jobs import job_status, training_view
from clusterwatch.sim.snapshot import SyntheticCluster, synthetic_snapshot
from clusterwatch.tui.feed import Disconnected, Update
from clusterwatch.tui.history import sparkline
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views import gpus, incidents, network, nodes, ranks, summary
from clusterwatch.tui.views.gpus import GpuCell, NodeGpus, gpu_summary
from clusterwatch.tui.views.rows import Tone
from clusterwatch.v1 import cluster_pb2, training_pb2

pytestmark = pytest.mark.timeout(30)


def state_after(ticks: int, cluster: SyntheticCluster | None = None) -> TopState:
    cluster = cluster or SyntheticCluster()
    state = TopState()
    for tick in range(ticks):
        snapshot = synthetic_snapshot(cluster, tick)
        state.apply(Update(snapshot, list(snapshot.incidents) if tick == 0 else None))
    return state


def test_sparkline_scales_and_keeps_the_newest() -> None:
    assert sparkline([0.0, 0.5, 1.0], 3) == "▁▅█"
    assert sparkline([0.0, 0.5, 1.0], 2) == "▅█"  # the newest
    assert sparkline([1.0], 3) == "  █"  # right-aligned: the present is on the right
    assert sparkline([2.0, 4.0], 2, low=None) == "▁█"  # the range of the values shown
    assert sparkline([], 2) == "  "


def test_the_hung_rank_is_named_with_the_collective_its_peers_wait_in() -> None:
    rows = {r.key: r for r in ranks.rank_rows(state_after(2))}
    hung = rows["llama-8b/24"]  # node 3's first GPU: the unreachable node
    assert hung.tone is Tone.ERROR
    assert hung.cells[8].text.startswith("HUNG: missing all_reduce #")
    assert "(31 peers waiting)" in hung.cells[8].text
    straggler = rows["llama-8b/11"]
    assert straggler.tone is Tone.WARNING
    assert straggler.cells[8].text.startswith("STRAGGLER (gpu_thermal)")
    slow = float(straggler.cells[6].text.removesuffix("x"))
    assert 1.08 < slow < 1.2  # compute time over the job's median
    others = [r for k, r in rows.items() if k not in {"llama-8b/11", "llama-8b/24"}]
    assert {r.tone for r in others} == {Tone.PLAIN}


def test_a_rank_in_another_collective_than_its_peers_is_marked_a_mismatch_with_what_it_is_in() -> None:
    snapshot = cluster_pb2.ClusterSnapshot()
    job = snapshot.jobs.add(job="desync")
    for rank in range(4):
        status = job.ranks.add(node_id=f"node-{rank // 2}", state=training_pb2.RANK_STATE_RUNNING)
        status.identity.job, status.identity.rank, status.identity.world_size = "desync", rank, 4
        c = status.heartbeat.collective
        c.op, c.group_name, c.sequence, c.elapsed_seconds = "all_reduce", "0", 61, 6.0
        c.size_bytes, c.dtype = 1 << 20, "float32"
        if rank == 3:
            c.op, c.size_bytes, c.dtype = "barrier", 0, ""
    hang = snapshot.incidents.add(id="h", kind="hang", cause="collective_mismatch", job="desync", ranks=[3])
    state = TopState()
    state.apply(Update(snapshot, [hang]))
    rows = {r.key: r for r in ranks.rank_rows(state)}
    assert rows["desync/3"].tone is Tone.ERROR
    assert rows["desync/3"].cells[8].text == "HUNG: collective mismatch · in barrier #61 6.00s"
    assert rows["desync/0"].tone is Tone.PLAIN
    assert rows["desync/0"].cells[8].text == "in all_reduce #61 (1.0MiB float32) 6.00s"


def test_ranks_left_by_their_launcher_are_marked_orphaned() -> None:
    snapshot = cluster_pb2.ClusterSnapshot()
    job = snapshot.jobs.add(job="left")
    for rank in range(2):
        status = job.ranks.add(node_id="node-0", state=training_pb2.RANK_STATE_RUNNING)
        status.identity.job, status.identity.rank, status.identity.world_size = "left", rank, 2
    orphans = snapshot.incidents.add(
        id="o", kind="orphaned_ranks", cause="launcher_exited", job="left", ranks=[0, 1]
    )
    state = TopState()
    state.apply(Update(snapshot, [orphans]))
    rows = {r.key: r for r in ranks.rank_rows(state)}
    assert [rows[f"left/{rank}"].tone for rank in (0, 1)] == [Tone.ERROR] * 2
    assert rows["left/0"].cells[8].text.startswith("ORPHANED: launcher gone · ")


def test_port_rates_come_from_each_nodes_last_two_reports() -> None:
    state = TopState()
    cluster = SyntheticCluster()
    state.apply(Update(synthetic_snapshot(cluster, 0)))
    assert {r.cells[4].text for r in network.network_rows(state)} == {"-"}  # one report: no rate yet
    state.apply(Update(synthetic_snapshot(cluster, 1)))
    state.apply(Update(synthetic_snapshot(cluster, 1)))  # the same reports again: rates stay
    rows = {r.key: r for r in network.network_rows(state)}
    assert rows["gpu-node-0000/eth0"].cells[4].text == "2.0MB/s"  # 2,000,000 bytes in 1 s
    assert rows["gpu-node-0000/mlx5_0:1"].cells[5].text == "5.0GB/s"
    assert rows["gpu-node-0002/mlx5_0:1"].cells[6].text == "90,000"  # the congested port's transmit wait
    assert rows["gpu-node-0002/mlx5_0:1"].cells[6].tone is Tone.WARNING
    assert rows["gpu-node-0003/eth0"].cells[4].text == "-"  # the unreachable node sent nothing new


def test_a_counter_that_went_backwards_gives_no_rate() -> None:
    state = TopState()
    cluster = SyntheticCluster()
    state.apply(Update(synthetic_snapshot(cluster, 5)))
    state.apply(Update(synthetic_snapshot(cluster, 2)))  # counters lower: the agent restarted
    rows = {r.key: r for r in network.network_rows(state)}
    assert rows["gpu-node-0000/eth0"].cells[4].text == "-"


def test_nodes_show_errors_throttling_and_history() -> None:
    state = state_after(5)
    rows = {r.key: r for r in nodes.node_rows(state)}
    assert rows["gpu-node-0001"].cells[8].text == "throttle@3"
    assert rows["gpu-node-0001"].cells[8].tone is Tone.WARNING
    assert rows["gpu-node-0003"].tone is Tone.ERROR  # unreachable
    assert rows["gpu-node-0003"].cells[1].text == "unreach"
    assert len(rows["gpu-node-0000"].cells[4].text.strip()) == 5  # five reports, five points
    assert len(rows["gpu-node-0003"].cells[4].text.strip()) == 1  # one report, repeated: one point


def test_header_counts_and_the_disconnection() -> None:
    state = state_after(1)
    s = summary.summarize(state.snapshot)
    assert (s.nodes_up, s.nodes_total, s.gpus) == (3, 4, 32)
    assert s.open_incidents == {"critical": 2, "warning": 1}
    state.apply(Disconnected(1000.0, "connection refused"))
    first = summary.header_cells(state, "c:1", now_unix_s=1012.0)[0]
    assert first.tone is Tone.ERROR
    assert "(12s): connection refused" in first.text
    assert "nodes 3/4 up" in [c.text for c in summary.header_cells(state, "c:1", 1012.0)]  # last known


def test_gpu_grid_marks_throttled_gpus_and_counts_them() -> None:
    grid = gpus.gpu_grid(state_after(1))
    assert [len(n.gpus) for n in grid] == [8, 8, 8, 8]
    assert [(n.node_id, g.index) for n in grid for g in n.gpus if g.slowdown] == [("gpu-node-0001", 3)]
    line = " ".join(c.text for c in gpus.gpu_summary(grid))
    assert "32 GPUs on 4 nodes" in line
    assert "1 throttled: gpu-node-0001/gpu3 sw_thermal_slowdown+hw_thermal_slowdown" in line


def test_incidents_keep_resolved_ones_and_show_evidence_and_stacks() -> None:
    state = state_after(1)
    resolved = cluster_pb2.Incident(
        id="old-1",
        kind="hang",
        severity="critical",
        summary="long ago",
        state=cluster_pb2.INCIDENT_STATE_RESOLVED,
        opened_unix_seconds=1.0,
    )
    state.apply(Update(synthetic_snapshot(SyntheticCluster(), 1), [resolved]))
    rows = incidents.incident_rows(state)
    assert rows[0].key == "old-1"  # oldest first
    assert rows[0].tone is Tone.MUTED
    hang = incidents.find(state, "hang-91c2-1")
    assert hang is not None
    action = cluster_pb2.ActionRecord(action="restart", outcome="done", detail="stopped 32 workers in 1.2 s")
    text = incidents.incident_detail(hang, [action]).plain
    assert "stalled_seconds" in text
    assert "restart: done  stopped 32 workers in 1.2 s" in text
    assert "wait (torch/distributed/distributed_c10d.py:3252)" in text
    assert "unavailable: deadline" in incidents.incident_detail(hang, "unavailable: deadline").plain


def test_tops_slowdown_is_the_straggler_detectors_own() -> None:
    """The SLOW column shows what the detector computed (and clusterwatch_rank_slowdown_ratio exports):
    a rank's compute over the median of the *other* ranks, over the detector's window."""
    store = JobStore()
    for n in range(1, 41):  # rank 2 computes 30 % longer; every rank a little noise
        reports = [
            rank_report(
                r,
                world_size=4,
                steps=[
                    step(
                        n,
                        step_s=1.0,
                        compute_s=0.4 * (1.3 if r == 2 else 1.0) * (1 + 0.01 * ((n * (r + 3)) % 5)),
                    )
                ],
            )
            for r in range(4)
        ]
        store.ingest("node-a", reports, now_mono=float(n), now_unix=T0 + n)
    detector = StragglerDetector()
    job = store.jobs["train"]
    detector.update(job)
    ratios = detector.slowdown_ratios(job)
    assert set(ratios) == {0, 1, 2, 3}
    assert ratios[2] > 1.25
    view = training_view(store, CheckpointTracker(), now_mono=41.0, slowdowns=detector.slowdown_ratios)
    snapshot = cluster_pb2.ClusterSnapshot(jobs=[job_status(j) for j in view.jobs])
    state = TopState()
    state.apply(Update(snapshot, []))
    rows = {r.key: r for r in ranks.rank_rows(state)}
    assert {rank: rows[f"train/{rank}"].cells[6].text for rank in ratios} == {
        rank: f"{ratio:.2f}x" for rank, ratio in ratios.items()
    }


def test_the_gpu_summary_says_how_much_was_real_work_where_gpm_reports_it() -> None:
    hopper = NodeGpus("h100-node", (GpuCell(0, 1.0, (), 0.9, 0.7), GpuCell(1, 1.0, (), 0.1, 0.0)))
    older = NodeGpus("a100-node", (GpuCell(0, 0.8, ()),))
    texts = [cell.text for cell in gpu_summary([hopper, older])]
    assert texts[:3] == ["3 GPUs on 2 nodes", "mean 93%", "SM active 50%, tensor 35%"]
    assert "SM active" not in " ".join(cell.text for cell in gpu_summary([older]))
