"""Topology end to end: real agents, a real coordinator, real torchrun jobs on gloo spread over two
"nodes" (two agents on this machine, one torchrun per node with a static rendezvous), and the
answer `clusterwatch topology --json` gives."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    FIXTURES,
    HOOK_WORKERS,
    Cluster,
    Coordinator,
    Process,
    ranks_of,
    run_cli,
    samples_named,
    scrape,
    unused_port,
    wait_for,
)

from clusterwatch.wire.topology import members as topology_members

pytestmark = pytest.mark.timeout(240)

WORKER = HOOK_WORKERS / "process_groups_worker.py"
NODES = ("node-a", "node-b")
RANKS_PER_NODE = 2
# Simulated GPUs (NV18 through NVSwitches) on the HGX fixture's sysfs: NICs, sockets, NUMA nodes.
HGX = "node-hgx"
HGX_SYS = FIXTURES / "topology" / "hgx8" / "sys"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Coordinator]]:
    tmp_path = tmp_path_factory.mktemp("topology")
    cluster = Cluster(tmp_path)
    try:
        coordinator = cluster.coordinator()
        for node_id in NODES:
            cluster.agent(coordinator, node_id)
        cluster.agent(
            coordinator,
            HGX,
            "--gpu-backend",
            "sim",
            "--sim-gpus",
            "8",
            "--sys-root",
            str(HGX_SYS),
            "--collectors",
            "gpu,infiniband",
        )
        for node_id in NODES:
            wait_for(cluster.socket_path(node_id).exists, 30, f"{node_id}'s hook socket")
        yield cluster, coordinator
    finally:
        cluster.close()


def two_node_job(cluster: Cluster, job: str, mesh: str, stop_file: Path) -> list[Process]:
    """A 4-rank job, ranks 0-1 on node-a and 2-3 on node-b, whose 2 x 2 DeviceMesh has dimensions ``mesh``."""
    port = unused_port()
    return [
        cluster.torchrun(
            WORKER,
            str(stop_file),
            "--job",
            job,
            "--mesh",
            mesh,
            nproc=RANKS_PER_NODE,
            socket=cluster.socket_path(node_id),
            nodes=(len(NODES), node_rank, f"127.0.0.1:{port}"),
        )
        for node_rank, node_id in enumerate(NODES)
    ]


def topology(coordinator: Coordinator, *args: str) -> dict[str, Any]:
    done = run_cli("topology", "--coordinator", coordinator.address, "--json", *args)
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def placed(coordinator: Coordinator, job: str) -> dict[str, Any] | None:
    """The job's answer once all four ranks are placed and report their groups."""
    answer = topology(coordinator, "--job", job)
    return answer if len(answer.get("placements", [])) == len(NODES) * RANKS_PER_NODE else None


def test_a_tensor_parallel_group_across_nodes_gets_a_finding_and_one_inside_a_node_none(
    cluster: tuple[Cluster, Coordinator], tmp_path: Path
) -> None:
    test_cluster, coordinator = cluster
    stop_file = tmp_path / "stop"
    # ("dp", "tp"): tp groups {0, 1} and {2, 3}, each on one node. ("tp", "dp"): {0, 2} and {1, 3}.
    jobs = {"tp-inside": "dp,tp", "tp-across": "tp,dp"}
    launched = [p for job, mesh in jobs.items() for p in two_node_job(test_cluster, job, mesh, stop_file)]
    try:
        inside = wait_for(lambda: placed(coordinator, "tp-inside"), 120, "tp-inside placed")
        across = wait_for(lambda: placed(coordinator, "tp-across"), 120, "tp-across placed")

        where = {p["rank"]: p["node_id"] for p in across["placements"]}
        assert where == {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}

        # Findings need every member's groups: wait until the job's findings settle on both groups.
        def across_findings() -> list[dict[str, Any]] | None:
            findings = topology(coordinator, "--job", "tp-across").get("findings", [])
            return findings if len(findings) == 2 else None

        findings = wait_for(across_findings, 60, "both tensor-parallel groups of tp-across judged")
        assert {(f["kind"], f["severity"], f["group_description"]) for f in findings} == {
            ("tensor_parallel_spans_nodes", "warning", "mesh_tp")
        }
        assert sorted(tuple(f["ranks"]) for f in findings) == [(0, 2), (1, 3)]
        assert all(f["nodes"] == ["node-a", "node-b"] and "spans 2 nodes" in f["message"] for f in findings)

        # Not vacuous: every rank of tp-inside has reported its tensor-parallel group, on its own node.
        def tp_groups_reported() -> dict[int, list[int]] | None:
            groups = {
                rank: members
                for rank, status in ranks_of(coordinator, "tp-inside").items()
                for group in status.heartbeat.process_groups
                if group.description == "mesh_tp" and (members := list(topology_members(group)))
            }
            return groups if len(groups) == len(NODES) * RANKS_PER_NODE else None

        tp_groups = wait_for(tp_groups_reported, 60, "tp-inside's tensor-parallel groups reported")
        assert tp_groups == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
        assert {p["rank"]: p["node_id"] for p in inside["placements"]} == where
        assert topology(coordinator, "--job", "tp-inside").get("findings", []) == []
        stop_file.touch()
        for process in launched:
            assert process.wait(timeout_s=60) == 0, test_cluster.logs()
    finally:
        stop_file.touch()
        for process in launched:
            process.stop()


def test_every_node_reports_its_topology_and_the_coordinator_exports_it(
    cluster: tuple[Cluster, Coordinator],
) -> None:
    _, coordinator = cluster

    def every() -> dict[str, dict[str, Any]] | None:
        nodes = {n["node_id"]: n for n in topology(coordinator)["nodes"]}
        return (
            nodes if len(nodes) == len(NODES) + 1 and all("topology" in n for n in nodes.values()) else None
        )

    nodes = wait_for(every, 30, "every node's topology")
    # This machine has no GPU: its agents say so, and still describe the CPUs.
    for node_id in NODES:
        assert nodes[node_id]["topology"].get("gpus", []) == []
        assert nodes[node_id]["topology"]["cpu_sockets"] >= 1
    hgx = nodes[HGX]["topology"]
    assert len(hgx["gpus"]) == 8
    assert {(link["link"], link["nvlinks"]) for link in hgx["gpu_links"]} == {("LINK_TYPE_NVLINK", 18)}
    assert len(hgx["gpu_links"]) == 8 * 7 // 2
    assert [(nic["device"], nic["kind"]) for nic in hgx["nics"]][:4] == [
        (f"mlx5_{i}", "infiniband") for i in range(4)
    ]
    assert hgx["cpu_sockets"] == 2

    samples = scrape(coordinator.metrics_url)
    links = samples_named(samples, "clusterwatch_gpu_link_info", node=HGX)
    assert len(links) == 8 * 7  # both directions
    assert {s.labels["link"] for s in links} == {"NV18"}
    rates = samples_named(samples, "clusterwatch_infiniband_port_rate_bytes_per_second", node=HGX)
    assert {s.labels["device"] for s in rates} == {f"mlx5_{i}" for i in range(4)}

    done = run_cli("topology", "--coordinator", coordinator.address, "--node", HGX)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"])
    assert lines[header].split()[:8] == [f"GPU{i}" for i in range(8)]
    gpu0 = lines[header + 1].split()
    assert gpu0[:9] == ["GPU0", "X", *["NV18"] * 7], done.stdout


def test_an_unknown_node_or_job_is_one_line_and_not_found(cluster: tuple[Cluster, Coordinator]) -> None:
    _, coordinator = cluster
    for flag, name in (("--node", "nowhere"), ("--job", "nothing")):
        done = run_cli("topology", "--coordinator", coordinator.address, flag, name)
        assert done.returncode != 0
        assert name in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
