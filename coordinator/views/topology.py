"""The ClusterTopology answer of GetTopology: node wiring, rank placements and findings.

Each NIC's state and rate are taken from the node's latest report when it has
one (the topology is re-sent only when the wiring changes, reports come every
interval), so a port that went down shows as down at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from clusterwatch.coordinator.detection.topology_advice import job_findings, job_placements
from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.errors import NotFoundError
from clusterwatch.v1 import cluster_pb2, node_pb2

_IB_ACTIVE = "ACTIVE"


def cluster_topology(
    state: ClusterState, jobs: JobStore, node: str = "", job: str = ""
) -> cluster_pb2.ClusterTopology:
    """Nodes (all, or ``node``), the placements and findings of every job (or ``job``) on them.

    Raises:
        NotFoundError: ``node`` or ``job`` is not known.
    """
    if node and node not in state.nodes:
        raise NotFoundError(f"node {node!r} is not known to this coordinator")
    if job and job not in jobs.jobs:
        raise NotFoundError(f"job {job!r} is not known to this coordinator")
    answer = cluster_pb2.ClusterTopology()
    selected = [job_record for name, job_record in sorted(jobs.jobs.items()) if not job or name == job]
    node_ids = [node] if node else sorted(state.nodes)
    if job and not node:
        hosting = set(selected[0].nodes())
        node_ids = [node_id for node_id in node_ids if node_id in hosting]
    answer.nodes.extend(node_status(state.nodes[node_id]) for node_id in node_ids)
    for job_record in selected:
        _add_job(answer, job_record, state, node)
    return answer


def node_status(record: NodeRecord) -> cluster_pb2.NodeTopologyStatus:
    status = cluster_pb2.NodeTopologyStatus(
        node_id=record.node_id, state=record.state, received_unix_seconds=record.topology_received_unix_s
    )
    if record.topology is not None:
        status.topology.CopyFrom(record.topology)
        if record.report is not None:
            _overlay_live_nics(status.topology.nics, record.report)
    return status


def _add_job(answer: cluster_pb2.ClusterTopology, job: JobRecord, state: ClusterState, node: str) -> None:
    placements = job_placements(job, state.nodes)
    answer.placements.extend(
        p.to_proto(job.job) for rank, p in sorted(placements.items()) if not node or p.node_id == node
    )
    answer.findings.extend(
        f for f in job_findings(job, state.nodes, placements) if not node or node in f.nodes
    )


def _overlay_live_nics(nics: Iterable[node_pb2.TopologyNic], report: node_pb2.NodeReport) -> None:
    """State and rate of each NIC from the latest report's IB ports and interfaces."""
    ports: dict[str, list[node_pb2.IbPortSample]] = {}
    for port in report.ib_ports:
        ports.setdefault(port.device, []).append(port)
    interfaces = {nic.device: nic for nic in report.nics}
    for nic in nics:
        if nic.device in ports:
            device_ports = ports[nic.device]
            active = [p for p in device_ports if p.state == _IB_ACTIVE]
            nic.state = _IB_ACTIVE if active else device_ports[0].state
            rates = [
                p.rate_bytes_per_second for p in active or device_ports if p.HasField("rate_bytes_per_second")
            ]
            if rates:
                nic.rate_bytes_per_second = max(rates)
        elif (sample := interfaces.get(nic.device)) is not None:
            if sample.HasField("up"):
                nic.state = "up" if sample.up else "down"
            if sample.HasField("speed_bytes_per_second"):
                nic.rate_bytes_per_second = sample.speed_bytes_per_second
