"""Immutable copies of node state, taken on the event loop and read anywhere.

Reports are never mutated after ingest (a new report replaces the reference),
so a NodeView stays consistent while /metrics renders it in another thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from clusterwatch.coordinator.model.rates import infiniband_rates, network_rates
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.v1 import cluster_pb2, node_pb2
from clusterwatch.wire.topology import Wiring


@dataclasses.dataclass(frozen=True)
class NodeView:
    node_id: str
    hostname: str
    agent_version: str
    state: cluster_pb2.NodeState.ValueType
    last_seen_unix_s: float
    last_sequence: int
    reports_received_total: int
    reports_missed_total: int
    report: node_pb2.NodeReport | None
    previous: node_pb2.NodeReport | None
    wiring: Wiring | None = None


def node_views(state: ClusterState, only: Collection[str] | None = None) -> list[NodeView]:
    """A view of every node (or of those in ``only`` that exist), sorted by node id. Call on the event loop."""
    names = state.nodes if only is None else [n for n in only if n in state.nodes]
    return [_view(state.nodes[node_id]) for node_id in sorted(names)]


def _view(r: NodeRecord) -> NodeView:
    return NodeView(
        r.node_id,
        r.hostname,
        r.agent_version,
        r.state,
        r.last_seen_unix_s,
        r.last_sequence,
        r.reports_received_total,
        r.reports_missed_total,
        r.report,
        r.previous,
        r.wiring,
    )


def node_status(view: NodeView, summary_only: bool) -> cluster_pb2.NodeStatus:
    """The API's NodeStatus for one node, with counter rates from its last two reports."""
    status = cluster_pb2.NodeStatus(
        node_id=view.node_id,
        hostname=view.hostname,
        state=view.state,
        agent_version=view.agent_version,
        last_seen_unix_seconds=view.last_seen_unix_s,
        last_sequence=view.last_sequence,
        reports_received_total=view.reports_received_total,
        reports_missed_total=view.reports_missed_total,
    )
    net_rx, net_tx = network_rates(view.previous, view.report)
    ib_rx, ib_tx = infiniband_rates(view.previous, view.report)
    for field, value in (
        ("network_receive_bytes_per_second", net_rx),
        ("network_transmit_bytes_per_second", net_tx),
        ("infiniband_receive_bytes_per_second", ib_rx),
        ("infiniband_transmit_bytes_per_second", ib_tx),
    ):
        if value is not None:
            setattr(status, field, value)
    if view.report is not None:
        if summary_only:
            status.report.gpus.extend(_slim_gpu(g) for g in view.report.gpus)
            status.report.host.CopyFrom(view.report.host)
            status.report.gpu_inventory.CopyFrom(view.report.gpu_inventory)
            status.report.timestamp_unix_seconds = view.report.timestamp_unix_seconds
        else:
            status.report.CopyFrom(view.report)
    return status


# What a per-node summary keeps of each GPU: enough for a status row or a
# heat-map cell, not the per-link and per-process detail (18 NVLinks alone
# make a full 8-GPU report ~6 KB).
_SUMMARY_GPU_FIELDS = (
    "utilization_ratio",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_watts",
    "temperature_celsius",
    "sm_clock_hertz",
    "clocks_event_reasons",
)


def _slim_gpu(gpu: node_pb2.GpuSample) -> node_pb2.GpuSample:
    slim = node_pb2.GpuSample(index=gpu.index, uuid=gpu.uuid, name=gpu.name)
    for field in _SUMMARY_GPU_FIELDS:
        if gpu.HasField(field):  # type: ignore[arg-type]
            setattr(slim, field, getattr(gpu, field))
    return slim
