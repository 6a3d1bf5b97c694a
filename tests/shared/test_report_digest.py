"""The digest of a node report (lean mode): every hardware field decided on, and nothing lost that
``status``, ``top`` and the coordinator's views read."""

from __future__ import annotations

import dataclasses

import pytest

from bench.synthetic import node_report
from clusterwatch.cli.status import node_summary
from clusterwatch.coordinator.views.nodes import NodeView, node_status
from clusterwatch.tui.feed import Update
from clusterwatch.tui.state import TopState
from clusterwatch.tui.views import gpus, network, nodes
from clusterwatch.tui.views.details import node_detail
from clusterwatch.v1 import cluster_pb2, node_pb2
from clusterwatch.wire.report_digest import DROPPED, KEPT, digest

pytestmark = pytest.mark.timeout(30)

UP = cluster_pb2.NodeState.NODE_STATE_UP


@pytest.mark.parametrize("message", sorted(KEPT))
def test_every_field_is_either_kept_or_dropped(message: str) -> None:
    """A field added to the proto fails here until someone decides whether the coordinator reads it."""
    fields = {f.name for f in node_pb2.DESCRIPTOR.message_types_by_name[message].fields}
    kept, dropped = set(KEPT[message]), set(DROPPED[message])
    assert not kept & dropped
    assert kept | dropped == fields, f"undecided: {sorted(fields - kept - dropped)}"
    assert len(kept) == len(KEPT[message])
    assert len(dropped) == len(DROPPED[message])


def full_report(sequence: int) -> node_pb2.NodeReport:
    """A representative 8-GPU report, with the XIDs, ECC errors and a down port detection looks at."""
    report = node_report("node-a", sequence)
    report.timestamp_unix_seconds = 1_700_000_000.0 + sequence
    report.gpus[2].xid_errors.add(xid=79, count=1)
    report.gpus[2].ecc_uncorrected_errors_total = 2
    report.gpus[0].pod, report.gpus[0].namespace, report.gpus[0].container = "llama-0", "ml", "pytorch"
    report.gpus[0].processes.add(pid=123, used_memory_bytes=1 << 30)
    report.gpu_inventory.query_errors.add(function="nvmlDeviceGetFanSpeed", error="NotSupported", count=3)
    report.ib_ports[1].state, report.ib_ports[1].physical_state = "DOWN", "Disabled"
    report.ib_ports[0].hw_counters["np_cnp_sent"] = 7
    report.host.load5, report.host.swap_total_bytes, report.host.boot_time_seconds = 40.0, 1 << 30, 1.7e9
    return report


def test_the_digest_drops_what_only_metrics_exports_and_leaves_the_report_as_it_was() -> None:
    report = full_report(1)
    before = report.SerializeToString()
    lean = digest(report)
    assert report.SerializeToString() == before
    assert lean.ByteSize() < report.ByteSize() / 3  # 18 NVLinks x 8 GPUs were most of it
    for gpu, full in zip(lean.gpus, report.gpus, strict=True):
        assert not gpu.nvlinks
        assert not gpu.processes
        assert not gpu.pod
        assert not gpu.HasField("pcie_transmit_bytes_total")
        assert not gpu.HasField("energy_joules_total")
        for field in KEPT["GpuSample"]:
            assert getattr(gpu, field) == getattr(full, field), field
    assert not lean.gpu_inventory.query_errors
    assert not lean.ib_ports[0].hw_counters
    assert not lean.host.HasField("load5")
    assert lean.host.load1 == report.host.load1
    # Whole: sequence, time, collectors, ranks, topology.
    assert (lean.sequence, lean.timestamp_unix_seconds) == (report.sequence, report.timestamp_unix_seconds)
    assert lean.collectors == report.collectors


def test_an_empty_report_stays_empty() -> None:
    """No presence is made up: a report without host or GPUs has none in its digest either."""
    lean = digest(node_pb2.NodeReport(sequence=3))
    assert not lean.HasField("host")
    assert not lean.HasField("gpu_inventory")
    assert lean == node_pb2.NodeReport(sequence=3)


def view(previous: node_pb2.NodeReport, report: node_pb2.NodeReport) -> NodeView:
    return NodeView(
        "node-a",
        "host-a",
        "0.1.0",
        UP,
        report.timestamp_unix_seconds,
        report.sequence,
        2,
        0,
        report,
        previous,
    )


def top_state(full: NodeView, summary_only: bool) -> TopState:
    """``top``'s state after two snapshots (rates need two), as the coordinator would send them."""
    state = TopState()
    for v in (dataclasses.replace(full, report=full.previous, previous=None), full):
        snapshot = cluster_pb2.ClusterSnapshot(timestamp_unix_seconds=v.last_seen_unix_s)
        snapshot.nodes.append(node_status(v, summary_only))
        state.apply(Update(snapshot, []))
    return state


def shown(state: TopState) -> list[object]:
    """Everything ``top``'s node, GPU and network views and a node's detail show."""
    node_cells = [[c.text for c in row.cells] for row in nodes.node_rows(state, now_unix_s=1_700_000_010.0)]
    network_cells = [[c.text for c in row.cells] for row in network.network_rows(state)]
    return [node_cells, network_cells, gpus.gpu_grid(state), str(node_detail(state.snapshot.nodes[0]))]


@pytest.mark.parametrize("summary_only", [True, False], ids=["summary", "full"])
def test_status_and_top_show_the_same_from_the_digest(summary_only: bool) -> None:
    previous, report = full_report(1), full_report(2)
    full, lean = view(previous, report), view(digest(previous), digest(report))
    if summary_only:  # what `clusterwatch status` asks for and shows
        assert node_summary(node_status(lean, True)) == node_summary(node_status(full, True))
    assert shown(top_state(lean, summary_only)) == shown(top_state(full, summary_only))
