"""Topology: what discovery costs an agent, what GetTopology costs the coordinator for a large
job, and what a topology weighs on the wire.

Usage:
    python -m bench.topology [--ranks 512 4096] [--repeat 5]

Discovery (one JSON line first): ``discover_topology`` on this machine's /sys
without GPUs, and on the HGX fixture tree (tests/fixtures/topology/hgx8: 8
GPUs, 4 InfiniBand NICs, 2 sockets) with 8 simulated GPUs, whose NVLinks come
from the simulator and whose NICs, sockets and NUMA nodes from the fixture's
sysfs; milliseconds, median of --repeat.

For each --ranks R: R / 8 HGX nodes (bench/synthetic.py hgx_topology: NV18,
4 NICs at 400 Gb/s, one node in 16 with a 200 Gb/s NIC) in a ClusterState, and
one job through the real JobStore whose ranks report a (pp=4, dp, tp=8)
DeviceMesh's groups, with one tensor-parallel group in 16 placed across two
nodes. Times ``cluster_topology`` (every placement and finding, as GetTopology
answers them, and the findings alone) and prints JSON: milliseconds (median of
--repeat), findings, and the bytes of one node's topology (what a Hello
carries) and of the whole answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.synthetic import GPUS_PER_NODE, hgx_topology, rank_reports
from clusterwatch.coordinator.detection.topology_advice import job_findings
from clusterwatch.coordinator.model.jobs import JobStore
from clusterwatch.coordinator.model.state import ClusterState, NodeRecord
from clusterwatch.coordinator.views.topology import cluster_topology
from clusterwatch.v1 import cluster_pb2, training_pb2

PIPELINE_STAGES = 4
SLOW_NIC_EVERY = 16  # nodes
SPLIT_TP_EVERY = 16  # tensor-parallel groups


def build(ranks: int) -> tuple[ClusterState, JobStore]:
    """A (pp=4, dp, tp=8) job of ``ranks`` ranks on ``ranks / 8`` HGX nodes."""
    nodes = ranks // GPUS_PER_NODE
    dp = ranks // (PIPELINE_STAGES * GPUS_PER_NODE)
    state = ClusterState()
    for n in range(nodes):
        uuids = [f"GPU-{n * GPUS_PER_NODE + g:08d}" for g in range(GPUS_PER_NODE)]
        slow = "mlx5_3" if n % SLOW_NIC_EVERY == 1 else ""
        record = state.nodes[f"node-{n}"] = NodeRecord(node_id=f"node-{n}")
        record.set_topology(hgx_topology(uuids, slow_nic=slow), time.time())
    store = JobStore()
    for n in range(nodes):
        reports = rank_reports(n, GPUS_PER_NODE, 1, world_size=ranks)
        for report in reports:
            report.heartbeat.process_groups.extend(_groups(report.identity.rank, dp, ranks))
        store.ingest(f"node-{n}", reports, now_mono=1.0, now_unix=time.time())
    return state, store


def _groups(rank: int, dp: int, ranks: int) -> list[training_pb2.ProcessGroupMembership]:
    """The rank's tp, dp and pp groups (rank = (stage * dp + d) * 8 + t); every 16th tp group
    is shifted by 4 ranks, so it spans two nodes."""
    tp_first = rank - rank % GPUS_PER_NODE
    if (
        tp_first // GPUS_PER_NODE
    ) % SPLIT_TP_EVERY == SPLIT_TP_EVERY - 1 and tp_first + GPUS_PER_NODE < ranks:
        tp_first += GPUS_PER_NODE // 2 if rank % GPUS_PER_NODE >= GPUS_PER_NODE // 2 else 0
    t = rank % GPUS_PER_NODE
    stage_size = dp * GPUS_PER_NODE
    d = (rank % stage_size) // GPUS_PER_NODE
    membership = training_pb2.ProcessGroupMembership
    return [
        membership(
            group_name=f"tp{tp_first}",
            description="mesh_tp",
            first_rank=tp_first,
            stride=1,
            size=GPUS_PER_NODE,
        ),
        membership(
            group_name=f"dp{rank // stage_size}.{t}",
            description="mesh_dp",
            first_rank=(rank // stage_size) * stage_size + t,
            stride=GPUS_PER_NODE,
            size=dp,
        ),
        membership(
            group_name=f"pp{d}.{t}",
            description="mesh_pp",
            first_rank=d * GPUS_PER_NODE + t,
            stride=stage_size,
            size=PIPELINE_STAGES,
        ),
    ]


def measure(ranks: int, repeat: int) -> dict[str, object]:
    state, store = build(ranks)
    job = store.jobs["bench"]
    answer = cluster_pb2.ClusterTopology()
    whole_ms: list[float] = []
    findings_ms: list[float] = []
    for _ in range(repeat):
        start = time.perf_counter()
        answer = cluster_topology(state, store)
        whole_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        job_findings(job, state.nodes)
        findings_ms.append((time.perf_counter() - start) * 1e3)
    kinds: dict[str, int] = {}
    for finding in answer.findings:
        kinds[finding.kind] = kinds.get(finding.kind, 0) + 1
    one_node = next(iter(state.nodes.values())).topology
    assert one_node is not None
    return {
        "ranks": ranks,
        "nodes": len(state.nodes),
        "get_topology_ms": round(statistics.median(whole_ms), 2),
        "findings_ms": round(statistics.median(findings_ms), 2),
        "placements": len(answer.placements),
        "findings": kinds,
        "node_topology_bytes": one_node.ByteSize(),
        "answer_bytes": answer.ByteSize(),
    }


def measure_discovery(repeat: int) -> dict[str, object]:
    from clusterwatch.agent.gpu.sim_backend import SimulatedBackend
    from clusterwatch.agent.topology.discover import discover_topology

    fixture = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "topology" / "hgx8" / "sys"
    backend = SimulatedBackend(GPUS_PER_NODE)
    result: dict[str, object] = {}
    try:
        for name, gpus, sys_root in (
            ("this_machine", None, Path("/sys")),
            ("hgx8_fixture_sim_gpus", backend, fixture),
        ):
            times_ms = []
            for _ in range(repeat):
                start = time.perf_counter()
                found = discover_topology(gpus, sys_root)
                times_ms.append((time.perf_counter() - start) * 1e3)
            result[f"{name}_ms"] = round(statistics.median(times_ms), 2)
            result[f"{name}_found"] = (
                f"{len(found.gpus)} GPUs, {len(found.nics)} NICs, {found.cpu_sockets} sockets"
            )
    finally:
        backend.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure_discovery(args.repeat)))
    for ranks in args.ranks:
        print(json.dumps(measure(ranks, args.repeat)))


if __name__ == "__main__":
    main()
