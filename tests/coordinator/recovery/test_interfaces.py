"""Where a job's collectives go instead of a bad interface (coordinator/recovery/interfaces.py), on
jobs and node reports built through the real stores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
from training_builders import T0, rank_report, step

from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.coordinator.recovery.interfaces import plan_worker_env
from clusterwatch.v1 import agent_pb2, node_pb2

pytestmark = pytest.mark.timeout(30)

# Two paths between the nodes (as in tests/e2e/test_avoid_interface.py): A on 10.81.1.0/24, B on 10.81.2.0/24.
TWO_PATHS = {
    "node-1": {"cwa1": ["10.81.1.1/24"], "cwb1": ["10.81.2.1/24", "fe80::1/64"]},
    "node-2": {"cwa2": ["10.81.1.2/24"], "cwb2": ["10.81.2.2/24"]},
}


def nodes_with(
    nics: Mapping[str, Mapping[str, Sequence[str]]], down: Sequence[str] = ()
) -> dict[str, NodeRecord]:
    state = ClusterState()
    for node_id, devices in nics.items():
        state.hello(
            agent_pb2.Hello(node_id=node_id, hostname=node_id, instance_id="i", interval_seconds=1.0), 0.0, T0
        )
        report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=T0, interval_seconds=1.0)
        report.nics.add(device="lo", up=True, addresses=["127.0.0.1/8"])
        for device, addresses in devices.items():
            report.nics.add(device=device, up=device not in down, addresses=addresses)
        state.ingest(node_id, report, 1.0, T0)
    return state.nodes


def job_on(nodes: Sequence[str], interfaces: Mapping[str, Sequence[str]]) -> JobRecord:
    store = JobStore()
    for index, node_id in enumerate(nodes):
        report = rank_report(index, world_size=len(nodes), steps=[step(1)])
        report.interfaces.extend(interfaces.get(node_id, ()))
        store.ingest(node_id, [report], now_mono=1.0, now_unix=T0)
    return store.jobs["train"]


def test_the_job_moves_to_the_one_network_every_node_shares() -> None:
    job = job_on(["node-1", "node-2"], {"node-1": ["cwa1"], "node-2": ["cwa2"]})
    plan = plan_worker_env(job, nodes_with(TWO_PATHS), [("node-1", "cwa1")])
    assert plan == {
        "node-1": {"GLOO_SOCKET_IFNAME": "cwb1", "NCCL_SOCKET_IFNAME": "cwb1"},
        "node-2": {"GLOO_SOCKET_IFNAME": "cwb2", "NCCL_SOCKET_IFNAME": "cwb2"},
    }


def test_no_move_without_another_interface_up_or_a_network_every_node_has() -> None:
    job = job_on(["node-1", "node-2"], {})
    down = plan_worker_env(job, nodes_with(TWO_PATHS, down=["cwb1"]), [("node-1", "cwa1")])
    assert down == "node-1 has no other interface up with an address besides cwa1 on node-1"
    elsewhere = {**TWO_PATHS, "node-2": {"cwa2": ["10.81.1.2/24"], "cwb2": ["10.99.2.2/24"]}}
    apart = plan_worker_env(job, nodes_with(elsewhere), [("node-1", "cwa1")])
    assert (
        apart == "no network other than cwa1 on node-1's reaches every node of job train (tried 10.81.2.0/24)"
    )
    unknown = plan_worker_env(
        job, nodes_with({"node-1": TWO_PATHS["node-1"], "node-2": {}}), [("node-1", "cwa1")]
    )
    assert isinstance(unknown, str)
    assert "no interface addresses known for node-2" in unknown


def test_an_infiniband_port_is_left_out_of_nccls_hcas_on_its_node_only() -> None:
    job = job_on(["node-1", "node-2"], {})
    assert plan_worker_env(job, nodes_with(TWO_PATHS), [("node-2", "mlx5_1/1")]) == {
        "node-2": {"NCCL_IB_HCA": "^=mlx5_1:1"}
    }
