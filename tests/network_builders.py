"""Builders for the coordinator's network tests (no tests here): nodes whose reports list their
interfaces' addresses, and a job whose ranks' sockets use given interfaces, through the real stores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from training_builders import T0, rank_report, step

from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.v1 import agent_pb2, node_pb2


def nodes_with(
    nics: Mapping[str, Mapping[str, Sequence[str]]], down: Sequence[str] = (), *, probe_port: int = 0
) -> dict[str, NodeRecord]:
    """Nodes that said hello (with ``probe_port``) and reported ``{node: {device: [address/prefix]}}``."""
    state = ClusterState()
    for node_id, devices in nics.items():
        hello = agent_pb2.Hello(
            node_id=node_id, hostname=node_id, instance_id="i", interval_seconds=1.0, probe_port=probe_port
        )
        state.hello(hello, 0.0, T0)
        report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=T0, interval_seconds=1.0)
        report.nics.add(device="lo", up=True, addresses=["127.0.0.1/8"])
        for device, addresses in devices.items():
            report.nics.add(device=device, up=device not in down, addresses=addresses)
        state.ingest(node_id, report, 1.0, T0)
    return state.nodes


def job_on(nodes: Sequence[str], interfaces: Mapping[str, Sequence[str]]) -> JobRecord:
    """Job ``train``, one running rank per node, whose sockets use ``{node: [interface]}``."""
    store = JobStore()
    for index, node_id in enumerate(nodes):
        report = rank_report(index, world_size=len(nodes), steps=[step(1)])
        report.interfaces.extend(interfaces.get(node_id, ()))
        store.ingest(node_id, [report], now_mono=1.0, now_unix=T0)
    return store.jobs["train"]
