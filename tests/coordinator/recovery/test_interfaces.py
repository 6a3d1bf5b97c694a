"""Where a job's collectives go instead of a bad interface (coordinator/recovery/interfaces.py), on
jobs and node reports built through the real stores."""

from __future__ import annotations

import pytest
from network_builders import job_on, nodes_with

from clusterwatch.coordinator.recovery.interfaces import plan_worker_env

pytestmark = pytest.mark.timeout(30)

# Two paths between the nodes (as in tests/e2e/test_avoid_interface.py): A on 10.81.1.0/24, B on 10.81.2.0/24.
TWO_PATHS = {
    "node-1": {"cwa1": ["10.81.1.1/24"], "cwb1": ["10.81.2.1/24", "fe80::1/64"]},
    "node-2": {"cwa2": ["10.81.1.2/24"], "cwb2": ["10.81.2.2/24"]},
}


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
