"""Placements and advice (coordinator/detection/topology_advice.py) and the nearest-NIC network cause
(coordinator/detection/causes/): jobs through the real JobStore, node topologies written out here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
from training_builders import T0, rank_report

from bench.synthetic import hgx_topology
from clusterwatch.coordinator.detection.causes import CauseName, straggler_cause
from clusterwatch.coordinator.detection.topology_advice import (
    GroupRole,
    group_role,
    job_findings,
    job_placements,
)
from clusterwatch.coordinator.model.jobs import JobRecord, JobStore
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.v1 import node_pb2, training_pb2

pytestmark = pytest.mark.timeout(60)

GPUS = 8
NVLINK, PIX, NODE, SYS = (
    node_pb2.LINK_TYPE_NVLINK,
    node_pb2.LINK_TYPE_PIX,
    node_pb2.LINK_TYPE_NODE,
    node_pb2.LINK_TYPE_SYS,
)


def uuid(node: int, gpu: int) -> str:
    """The GPU rank ``node * 8 + gpu`` runs on (training_builders names GPUs after ranks)."""
    return f"GPU-{node * GPUS + gpu:04d}"


def hgx(node: int, **options: Any) -> node_pb2.NodeTopology:
    """bench/synthetic.py's HGX node (NV18; mlx5_i PIX to GPUs 2i, 2i+1) hosting ranks node*8..+7."""
    return hgx_topology([uuid(node, gpu) for gpu in range(GPUS)], **options)


def pcie(node: int) -> node_pb2.NodeTopology:
    """4 GPUs, no NVLink: 0-1 and 2-3 share a PCIe switch, the pairs meet across sockets."""
    topo = node_pb2.NodeTopology(cpu_sockets=2)
    for gpu in range(4):
        topo.gpus.add(index=gpu, uuid=uuid(node, gpu), numa_node=gpu // 2)
        for peer in range(gpu + 1, 4):
            topo.gpu_links.add(gpu=gpu, peer_gpu=peer, link=PIX if gpu // 2 == peer // 2 else SYS)
    return topo


def group(name: str, description: str, ranks: Sequence[int]) -> training_pb2.ProcessGroupMembership:
    return training_pb2.ProcessGroupMembership(
        group_name=name, description=description, size=len(ranks), ranks=ranks
    )


def build_job(
    placement: Mapping[int, Sequence[int]], groups: Iterable[training_pb2.ProcessGroupMembership]
) -> JobRecord:
    """A running job: node -> its ranks (rank r on GPU r % 8); every rank reports every group it is in."""
    store = JobStore()
    groups = list(groups)
    world = sum(len(ranks) for ranks in placement.values())
    for node, ranks in placement.items():
        reports = []
        for rank in ranks:
            mine = [g for g in groups if rank in g.ranks]
            heartbeat = training_pb2.Heartbeat(timestamp_unix_seconds=T0, process_groups=mine)
            reports.append(rank_report(rank, world_size=world, heartbeat=heartbeat))
        assert store.ingest(f"node-{node}", reports, now_mono=1.0, now_unix=T0).applied == len(ranks)
    return store.jobs["train"]


def nodes_with(topologies: Mapping[int, node_pb2.NodeTopology]) -> dict[str, NodeRecord]:
    nodes = {f"node-{n}": NodeRecord(node_id=f"node-{n}") for n in topologies}
    for n, topology in topologies.items():
        nodes[f"node-{n}"].set_topology(topology, T0)
    return nodes


@pytest.mark.parametrize(
    ("description", "role"),
    [
        ("mesh_tp", GroupRole.TENSOR),
        ("TENSOR_MODEL_PARALLEL_GROUP", GroupRole.TENSOR),
        ("tp", GroupRole.TENSOR),
        ("mesh_pp", GroupRole.PIPELINE),
        ("PIPELINE_MODEL_PARALLEL_GROUP", GroupRole.PIPELINE),
        ("mesh_dp", None),
        ("default_pg", None),
        ("stp_experts", None),
        ("", None),
    ],
)
def test_group_roles_come_from_the_description(description: str, role: GroupRole | None) -> None:
    assert group_role(description) is role


def test_a_tensor_parallel_group_inside_one_nvlink_node_gets_no_finding() -> None:
    job = build_job({0: range(8), 1: range(8, 16)}, [group("1", "mesh_tp", [0, 1, 2, 3])])
    nodes = nodes_with({0: hgx(0), 1: hgx(1)})

    placements = job_placements(job, nodes)
    assert (placements[3].node_id, placements[3].gpu) == ("node-0", 3)
    assert [nic.device for nic in placements[3].nics] == ["mlx5_1"]
    assert placements[3].nic_link == PIX
    assert job_findings(job, nodes) == []


def test_a_tensor_parallel_group_spanning_two_nodes_gets_a_finding_naming_them() -> None:
    job = build_job({0: range(8), 1: range(8, 16)}, [group("2", "mesh_tp", [6, 7, 8, 9])])

    (finding,) = job_findings(job, nodes_with({0: hgx(0), 1: hgx(1)}))

    assert finding.kind == "tensor_parallel_spans_nodes"
    assert finding.severity == "warning"
    assert (finding.job, finding.group_name, finding.group_description) == ("train", "2", "mesh_tp")
    assert list(finding.ranks) == [6, 7, 8, 9]
    assert list(finding.nodes) == ["node-0", "node-1"]
    assert "spans 2 nodes (node-0: ranks 6-7; node-1: ranks 8-9)" in finding.message
    assert "up to 8 fits in one" in finding.message


def test_a_tensor_parallel_group_split_across_nvlink_domains_gets_a_warning() -> None:
    job = build_job({0: range(8)}, [group("1", "mesh_tp", [0, 1, 2, 3]), group("2", "mesh_tp", [2, 3, 4, 5])])

    (finding,) = job_findings(job, nodes_with({0: hgx(0, nvlink_halves=True)}))

    assert (finding.kind, finding.severity, finding.group_name) == (
        "tensor_parallel_outside_nvlink",
        "warning",
        "2",
    )
    assert "GPUs 2 and 4 are joined by SYS" in finding.message
    assert "node-0 has NVLink domains of 4 GPUs" in finding.message


def test_on_a_pcie_node_only_a_tensor_parallel_group_across_sockets_is_worth_an_info() -> None:
    job = build_job({0: range(4)}, [group("1", "tp", [0, 1]), group("2", "tp", [1, 2])])

    (finding,) = job_findings(job, nodes_with({0: pcie(0)}))

    assert (finding.kind, finding.severity, finding.group_name) == (
        "tensor_parallel_outside_nvlink",
        "info",
        "2",
    )
    assert "GPUs 1 and 2 are joined by SYS" in finding.message


def test_a_group_is_judged_only_once_every_member_is_placed() -> None:
    # Rank 8 (node-1) has not reported yet: the group spans nodes, but that is not known yet.
    job = build_job({0: range(8)}, [group("2", "mesh_tp", [6, 7, 8, 9])])
    assert job_findings(job, nodes_with({0: hgx(0)})) == []


def test_pipeline_boundaries_on_a_slower_nic_get_a_warning_and_fast_ones_none() -> None:
    # Stages: rank 0 (node-0 GPU 0, mlx5_0) -> rank 14 (node-1 GPU 6, mlx5_3 at 200 Gb/s).
    job = build_job(
        {0: range(8), 1: range(8, 16)}, [group("3", "mesh_pp", [0, 14]), group("4", "pp", [1, 9])]
    )

    (finding,) = job_findings(job, nodes_with({0: hgx(0), 1: hgx(1, slow_nic="mlx5_3")}))

    assert (finding.kind, finding.severity, finding.group_name) == ("pipeline_slow_nic", "warning", "3")
    assert list(finding.ranks) == [14]
    assert list(finding.nodes) == ["node-1"]
    assert "rank 14 (GPU 6) is nearest mlx5_3 at 25.0GB/s" in finding.message
    assert "node-1's fastest NIC, mlx5_0, runs at 50.0GB/s" in finding.message


def test_a_pipeline_rank_whose_nearest_nic_is_across_sockets_gets_an_info() -> None:
    # With NICs on socket 0 only, GPUs 4-7 reach them only across the socket interconnect.
    job = build_job({0: range(8), 1: range(8, 16)}, [group("3", "mesh_pp", [7, 15])])

    findings = job_findings(job, nodes_with({0: hgx(0, nics_on_one_socket=True), 1: hgx(1)}))

    assert [(f.kind, f.severity, list(f.ranks)) for f in findings] == [
        ("pipeline_nic_across_sockets", "info", [7])
    ]
    assert "GPU 7 on node-0 reaches its nearest NIC, mlx5_0, only across CPU sockets (SYS)" in (
        findings[0].message
    )


def test_ranks_without_a_topology_are_placed_on_their_node_only() -> None:
    job = build_job({0: range(2)}, [])
    placements = job_placements(job, {"node-0": NodeRecord(node_id="node-0")})
    assert (placements[1].node_id, placements[1].gpu, placements[1].nics) == ("node-0", None, ())


# --- the network cause, judged on the NIC nearest the straggler's GPU ----------------------------


def ib_report(
    at_unix_s: float, *, errors_per_s: Mapping[str, float], down: Iterable[str] = ()
) -> node_pb2.NodeReport:
    """Four ACTIVE ports whose symbol errors grow at ``errors_per_s`` since time 0; ``down`` ports DOWN."""
    report = node_pb2.NodeReport(sequence=1, timestamp_unix_seconds=at_unix_s, interval_seconds=1.0)
    for i in range(4):
        device = f"mlx5_{i}"
        report.ib_ports.add(
            device=device,
            port=1,
            state="DOWN" if device in down else "ACTIVE",
            link_layer="InfiniBand",
            symbol_errors_total=int(errors_per_s.get(device, 0.0) * at_unix_s),
            receive_errors_total=0,
        )
    return report


def troubled_nodes(errors_per_s: Mapping[str, float], down: Iterable[str] = ()) -> dict[str, NodeRecord]:
    """node-0 with the given trouble, node-1 healthy; both HGX."""
    nodes = nodes_with({0: hgx(0), 1: hgx(1)})
    for name, trouble, gone in (("node-0", errors_per_s, down), ("node-1", {}, ())):
        nodes[name].previous = ib_report(T0, errors_per_s=trouble, down=())
        nodes[name].report = ib_report(T0 + 1, errors_per_s=trouble, down=gone)
    return nodes


def test_a_straggler_whose_nearest_nic_has_errors_is_a_network_suspect_naming_the_nic() -> None:
    job = build_job({0: range(8), 1: range(8, 16)}, [])
    nodes = troubled_nodes({"mlx5_1": 50.0})

    cause = straggler_cause(job, 3, nodes)

    assert cause.name == CauseName.NETWORK
    assert "on mlx5_1, the NIC nearest its GPU 3 (PIX)" in cause.detail
    assert "InfiniBand errors at 50.0/s" in cause.detail


def test_a_straggler_is_not_blamed_on_another_gpus_nic() -> None:
    job = build_job({0: range(8), 1: range(8, 16)}, [])
    nodes = troubled_nodes({"mlx5_1": 50.0}, down=["mlx5_3"])

    # GPU 0's NIC is mlx5_0, which is fine: errors and a port down elsewhere on the node are not its cause.
    assert straggler_cause(job, 0, nodes).name != CauseName.NETWORK
    # GPU 7's NIC went down: that is its cause.
    cause = straggler_cause(job, 7, nodes)
    assert cause.name == CauseName.NETWORK
    assert "mlx5_3/1 down" in cause.detail


def test_without_a_topology_the_whole_node_network_speaks_for_the_rank() -> None:
    job = build_job({0: range(8), 1: range(8, 16)}, [])
    nodes = troubled_nodes({"mlx5_1": 50.0})
    for record in nodes.values():
        record.wiring = None

    cause = straggler_cause(job, 0, nodes)

    assert cause.name == CauseName.NETWORK
    assert "NIC nearest" not in cause.detail


def test_the_benchmark_job_finds_what_its_layout_plants() -> None:
    """bench/topology.py: one node in 16 has a slow NIC (GPUs 6-7 are nearest it, each a pipeline
    boundary), one tensor-parallel group in 16 is shifted across two nodes."""
    from bench.topology import measure

    result = measure(512, 1)

    assert result["placements"] == 512
    assert result["findings"] == {"pipeline_slow_nic": 4 * 2, "tensor_parallel_spans_nodes": 3}
