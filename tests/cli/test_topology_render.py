"""``clusterwatch topology``: the nvidia-smi-style matrix, the legends, the cluster summary and the findings.

Three nodes are built here as their agents would send them: an 8-GPU HGX board,
a 4-GPU PCIe server whose discovery was incomplete, and a CPU-only node. The
rendering is pure (clusterwatch/text/topology_render.py); the last test runs the
command against a real coordinator fed over the agents' own protocol.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from google.protobuf.json_format import ParseDict
from helpers import Cluster, run_cli
from training_builders import AgentStream, hgx, poll_until, rank_report

from clusterwatch.cli.topology_cmd import as_json, render
from clusterwatch.text.topology_render import (
    NOT_REPORTED,
    TIMES,
    cluster_lines,
    for_job,
    matrix_lines,
    nearest_nic_lines,
    nic_legend_lines,
    node_lines,
    nvlink_summary,
    summary_rows,
)
from clusterwatch.v1 import cluster_pb2, node_pb2

pytestmark = pytest.mark.timeout(60)

NVLINK, PIX, PXB, PHB, NODE, SYS = (
    node_pb2.LINK_TYPE_NVLINK,
    node_pb2.LINK_TYPE_PIX,
    node_pb2.LINK_TYPE_PXB,
    node_pb2.LINK_TYPE_PHB,
    node_pb2.LINK_TYPE_NODE,
    node_pb2.LINK_TYPE_SYS,
)
UP = cluster_pb2.NodeState.NODE_STATE_UP
NDR_BYTES_PER_S = 400e9 / 8  # a 400 Gb/s InfiniBand port
SOCKET_CPUS = ("0-55,112-167", "56-111,168-223")


def pcie() -> node_pb2.NodeTopology:
    """4 GPUs on PCIe only, pairs behind two switches; a RoCE NIC by the first pair, an ethernet port
    on the host bridge. NVML could not say how GPUs 2 and 3 connect, and sysfs gave no NUMA node."""
    topology = node_pb2.NodeTopology(
        cpu_sockets=1, problems=["nvml: NotSupported in nvmlDeviceGetTopologyCommonAncestor(2, 3)"]
    )
    topology.numa_nodes.add(id=0, cpus="0-31")
    for g in range(4):
        topology.gpus.add(
            index=g, uuid=f"GPU-pcie-{g}", name="NVIDIA L40S", pci_bus_id=f"0000:{0x41 + g:02x}:00.0"
        )
    for g, peer, link in ((0, 1, PIX), (0, 2, PHB), (0, 3, PHB), (1, 2, PHB), (1, 3, PHB)):
        topology.gpu_links.add(gpu=g, peer_gpu=peer, link=link)
    topology.nics.add(
        device="mlx5_0",
        kind="roce",
        pci_bus_id="0000:45:00.0",
        numa_node=0,
        interfaces=["ens1np0"],
        rate_bytes_per_second=100e9 / 8,
        state="ACTIVE",
    )
    topology.nics.add(
        device="eno1",
        kind="ethernet",
        pci_bus_id="0000:03:00.0",
        numa_node=0,
        interfaces=["eno1"],
        rate_bytes_per_second=25e9 / 8,
        state="up",
    )
    for g in range(4):
        topology.gpu_nics.add(gpu=g, nic="mlx5_0", link=PXB if g < 2 else PHB)
        topology.gpu_nics.add(gpu=g, nic="eno1", link=PHB)
    return topology


def cpu_only() -> node_pb2.NodeTopology:
    """No GPUs: a login or data-loading node with two ethernet ports, one down."""
    topology = node_pb2.NodeTopology(cpu_sockets=1)
    topology.numa_nodes.add(id=0, cpus="0-15")
    topology.nics.add(
        device="eth0",
        kind="ethernet",
        pci_bus_id="0000:01:00.0",
        numa_node=0,
        interfaces=["eth0"],
        rate_bytes_per_second=100e9 / 8,
        state="up",
    )
    topology.nics.add(
        device="eth1", kind="ethernet", pci_bus_id="0000:01:00.1", interfaces=["eth1"], state="down"
    )
    return topology


def node(node_id: str, topology: node_pb2.NodeTopology | None) -> cluster_pb2.NodeTopologyStatus:
    status = cluster_pb2.NodeTopologyStatus(node_id=node_id, state=UP, received_unix_seconds=1_800_000_000.0)
    if topology is not None:
        status.topology.CopyFrom(topology)
    return status


def hgx_placements(job: str = "train") -> list[cluster_pb2.RankPlacement]:
    return [
        cluster_pb2.RankPlacement(
            job=job, rank=g, node_id="gpu-a", gpu=g, nearest_nics=[f"mlx5_{g // 2}"], nic_link=PIX
        )
        for g in range(8)
    ]


FINDING = cluster_pb2.TopologyFinding(
    job="train",
    kind="tensor_parallel_spans_nodes",
    severity="warning",
    group_name="3",
    group_description="mesh_tp",
    ranks=[6, 7, 8, 9],
    nodes=["gpu-a", "gpu-b"],
    message="tensor-parallel group mesh_tp (ranks 6-9) spans gpu-a and gpu-b: its all-reduces leave NVLink",
)


def three_nodes() -> cluster_pb2.ClusterTopology:
    return cluster_pb2.ClusterTopology(
        nodes=[node("gpu-a", hgx()), node("gpu-b", pcie()), node("login", cpu_only())],
        placements=[
            *hgx_placements(),
            cluster_pb2.RankPlacement(
                job="train", rank=8, node_id="gpu-b", gpu=0, nearest_nics=["mlx5_0"], nic_link=PXB
            ),
            cluster_pb2.RankPlacement(
                job="train", rank=9, node_id="gpu-b", gpu=1, nearest_nics=["mlx5_0"], nic_link=PXB
            ),
            cluster_pb2.RankPlacement(job="etl", rank=0, node_id="login"),
        ],
        findings=[FINDING],
    )


def grid(lines: list[str]) -> dict[tuple[str, str], str]:
    """A printed matrix back into cells: (row label, column label) -> cell, affinities included."""
    header, *rows = lines
    columns = [c for c in header.split() if re.fullmatch(r"(GPU|NIC)\d+", c)]
    if "CPU Affinity" in header:
        columns += ["CPU Affinity", "NUMA Affinity"]
    cells = {}
    for row in rows:
        label, *values = row.split()
        assert len(values) <= len(columns), row
        cells.update({(label, column): value for column, value in zip(columns, values, strict=False)})
    return cells


def section(lines: list[str], title: str) -> list[str]:
    """The lines under ``title:`` (after its blank line), up to the next blank line."""
    start = lines.index(f"{title}:") + 2
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


HGX_MATRIX = """\
      GPU0  GPU1  GPU2  GPU3  GPU4  GPU5  GPU6  GPU7  NIC0  NIC1  NIC2  NIC3  CPU Affinity    NUMA Affinity
GPU0  X     NV18  NV18  NV18  NV18  NV18  NV18  NV18  PIX   NODE  SYS   SYS   0-55,112-167    0
GPU1  NV18  X     NV18  NV18  NV18  NV18  NV18  NV18  PIX   NODE  SYS   SYS   0-55,112-167    0
GPU2  NV18  NV18  X     NV18  NV18  NV18  NV18  NV18  NODE  PIX   SYS   SYS   0-55,112-167    0
GPU3  NV18  NV18  NV18  X     NV18  NV18  NV18  NV18  NODE  PIX   SYS   SYS   0-55,112-167    0
GPU4  NV18  NV18  NV18  NV18  X     NV18  NV18  NV18  SYS   SYS   PIX   NODE  56-111,168-223  1
GPU5  NV18  NV18  NV18  NV18  NV18  X     NV18  NV18  SYS   SYS   PIX   NODE  56-111,168-223  1
GPU6  NV18  NV18  NV18  NV18  NV18  NV18  X     NV18  SYS   SYS   NODE  PIX   56-111,168-223  1
GPU7  NV18  NV18  NV18  NV18  NV18  NV18  NV18  X     SYS   SYS   NODE  PIX   56-111,168-223  1
NIC0  PIX   PIX   NODE  NODE  SYS   SYS   SYS   SYS   X     -     -     -
NIC1  NODE  NODE  PIX   PIX   SYS   SYS   SYS   SYS   -     X     -     -
NIC2  SYS   SYS   SYS   SYS   PIX   PIX   NODE  NODE  -     -     X     -
NIC3  SYS   SYS   SYS   SYS   NODE  NODE  PIX   PIX   -     -     -     X
"""


def test_hgx_matrix_reads_like_nvidia_smi_topo_m() -> None:
    lines = matrix_lines(hgx())
    assert lines[0].split() == [
        *(f"GPU{g}" for g in range(8)),
        *(f"NIC{n}" for n in range(4)),
        "CPU",
        "Affinity",
        "NUMA",
        "Affinity",
    ]
    assert grid(lines) == grid(HGX_MATRIX.splitlines())
    # Spot checks that do not go through the expected text: the diagonal, NVLink, each NIC's own pair.
    cells = grid(lines)
    assert {cells[f"GPU{g}", f"GPU{g}"] for g in range(8)} == {"X"}
    assert cells["GPU3", "GPU6"] == cells["GPU6", "GPU3"] == "NV18"
    assert [cells[f"GPU{g}", "NIC2"] for g in range(8)] == ["SYS"] * 4 + ["PIX", "PIX", "NODE", "NODE"]
    assert cells["NIC1", "GPU2"] == cells["GPU2", "NIC1"] == "PIX"  # NIC rows mirror the GPU columns
    assert ("NIC0", "CPU Affinity") not in cells  # nvidia-smi gives NIC rows no affinity either


def test_hgx_nic_legend_nearest_nics_and_ranks() -> None:
    assert nic_legend_lines(hgx()) == [
        "  NIC0: mlx5_0  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:1a:00.0  NUMA 0  ib0",
        "  NIC1: mlx5_1  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:3a:00.0  NUMA 0  ib1",
        "  NIC2: mlx5_2  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:5a:00.0  NUMA 1  ib2",
        "  NIC3: mlx5_3  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:7a:00.0  NUMA 1  ib3",
    ]
    assert nearest_nic_lines(hgx())[:3] == [
        "  GPU0  →  NIC0 mlx5_0 (PIX)",
        "  GPU1  →  NIC0 mlx5_0 (PIX)",
        "  GPU2  →  NIC1 mlx5_1 (PIX)",
    ]
    lines = node_lines(node("gpu-a", hgx()), three_nodes().placements, three_nodes().findings)
    assert lines[0] == "gpu-a  up  8 GPUs, 4 NICs"
    assert lines[2:15] == matrix_lines(hgx())
    assert section(lines, "NIC Legend") == nic_legend_lines(hgx())
    legend = section(lines, "Legend")
    assert legend[0] == "  X    = self"
    assert "  NV#  = a bonded set of # NVLinks" in legend
    assert "  -    = not discovered (NIC to NIC)" in legend
    assert not any(line.startswith("  ?") for line in legend)  # every link was discovered
    assert section(lines, "Nearest NICs") == nearest_nic_lines(hgx())
    assert section(lines, "Ranks") == [
        f"  train/{g}  →  GPU{g}  →  mlx5_{g // 2} (PIX)" for g in range(8)
    ]  # gpu-b's and login's ranks are not gpu-a's
    assert "CPU sockets: 2, NUMA nodes: 2" in lines
    assert "  NUMA 1:  CPUs 56-111,168-223" in lines
    assert section(lines, "Findings") == [f"  warning  train  {FINDING.message}"]  # it names gpu-a
    assert "Problems:" not in lines


def test_pcie_node_shows_what_discovery_missed() -> None:
    lines = node_lines(node("gpu-b", pcie()))
    cells = grid(lines[2 : 2 + 1 + 4 + 2])
    assert [cells["GPU0", f"GPU{g}"] for g in range(4)] == ["X", "PIX", "PHB", "PHB"]
    assert cells["GPU2", "GPU3"] == cells["GPU3", "GPU2"] == "?"  # not discovered: said, not guessed
    assert [cells[f"GPU{g}", "NIC0"] for g in range(4)] == ["PXB", "PXB", "PHB", "PHB"]
    assert {cells[f"GPU{g}", "NIC1"] for g in range(4)} == {"PHB"}
    assert cells["GPU0", "CPU Affinity"] == cells["GPU0", "NUMA Affinity"] == "N/A"
    assert "NV" not in "".join(cells.values())
    assert section(lines, "NIC Legend") == [
        "  NIC0: mlx5_0  roce      12.5GB/s (100Gb/s)  ACTIVE  pci 0000:45:00.0  NUMA 0  ens1np0",
        "  NIC1: eno1    ethernet  3.1GB/s (25Gb/s)    up      pci 0000:03:00.0  NUMA 0  eno1",
    ]
    assert "  ?    = not discovered" in section(lines, "Legend")
    # RDMA first: GPU 2 reaches the ethernet port as near (PHB), but NCCL would use the RoCE NIC.
    assert section(lines, "Nearest NICs")[2] == "  GPU2  →  NIC0 mlx5_0 (PHB)"
    assert section(lines, "Ranks") == ["  no ranks placed"]
    assert lines[-4:] == [
        "",
        "Problems:",
        "",
        "  nvml: NotSupported in nvmlDeviceGetTopologyCommonAncestor(2, 3)",
    ]


def test_gpu_less_node_lists_its_nics_and_numa_nodes() -> None:
    lines = node_lines(node("login", cpu_only()), three_nodes().placements)
    assert lines[0] == "login  up  0 GPUs, 2 NICs"
    assert "login has no GPUs." in lines
    assert not any("GPU0" in line for line in lines)
    assert "Legend:" not in lines  # no matrix, no link legend
    assert section(lines, "NIC Legend") == [
        "  NIC0: eth0  ethernet  12.5GB/s (100Gb/s)  up    pci 0000:01:00.0  NUMA 0    eth0",
        "  NIC1: eth1  ethernet  rate ?              down  pci 0000:01:00.1  NUMA N/A  eth1",
    ]
    assert "CPU sockets: 1, NUMA nodes: 1" in lines
    assert section(lines, "Ranks") == ["  etl/0  →  no GPU  →  NIC unknown"]


def test_a_node_that_sent_no_topology_says_so() -> None:
    lines = node_lines(node("old-agent", None))
    assert lines[:2] == ["old-agent  up", NOT_REPORTED]


def test_cluster_summary_counts_nvlink_domains_nics_and_ranks() -> None:
    lines = cluster_lines(three_nodes())
    table = [re.split(r" {2,}", line) for line in lines[: lines.index("")]]
    assert table[0] == ["NODE", "STATE", "GPUS", "NVLINK", "NICS", "SOCKETS/NUMA", "RANKS"]
    rows = {row[0]: dict(zip(table[0], row, strict=True)) for row in table[1:]}
    assert rows["gpu-a"] == {
        "NODE": "gpu-a",
        "STATE": "up",
        "GPUS": "8",
        "NVLINK": f"1{TIMES}8 NV18",
        "NICS": "4 infiniband 50.0GB/s",
        "SOCKETS/NUMA": "2/2",
        "RANKS": "train:0-7",
    }
    assert rows["gpu-b"]["NVLINK"] == "none"
    assert rows["gpu-b"]["NICS"] == "1 roce 12.5GB/s, 1 ethernet 3.1GB/s"  # RDMA first
    assert rows["gpu-b"]["RANKS"] == "train:8-9"
    assert rows["login"]["GPUS"] == "no GPUs"
    assert rows["login"]["NVLINK"] == "-"
    assert rows["login"]["RANKS"] == "etl:0"
    assert lines[lines.index("") :] == [
        "",
        "gpu-b: 1 discovery problem (clusterwatch topology --node gpu-b)",
        "",
        "Findings:",
        "",
        f"  warning  train  {FINDING.message}",
    ]


def test_nvlink_domains_of_other_shapes() -> None:
    # Two 4-GPU NVLink islands (12 links a pair in one, 6-12 in the other) joined by PCIe, plus a lone GPU.
    topology = node_pb2.NodeTopology(gpus=[node_pb2.TopologyGpu(index=g) for g in range(9)])
    for island, counts in ((range(4), (12,)), (range(4, 8), (6, 12))):
        members = list(island)
        for i, g in enumerate(members):
            for peer in members[i + 1 :]:
                topology.gpu_links.add(
                    gpu=g, peer_gpu=peer, link=NVLINK, nvlinks=counts[(g + peer) % len(counts)]
                )
    assert nvlink_summary(topology) == f"1{TIMES}4 NV12, 1{TIMES}4 NV6-12, 1{TIMES}1"
    unknown_count = node_pb2.NodeTopology(gpus=[node_pb2.TopologyGpu(index=g) for g in range(2)])
    unknown_count.gpu_links.add(gpu=0, peer_gpu=1, link=NVLINK)
    assert nvlink_summary(unknown_count) == f"1{TIMES}2 NV"
    assert nvlink_summary(pcie()) == "none"
    assert nvlink_summary(cpu_only()) == "-"


def test_summary_of_a_node_without_topology_and_no_findings() -> None:
    quiet = cluster_pb2.ClusterTopology(nodes=[node("gpu-a", hgx()), node("old-agent", None)])
    lines = cluster_lines(quiet)
    assert re.split(r" {2,}", lines[2]) == ["old-agent", "up", "?", "-", "-", "-", "-"]
    assert "topology not reported by 1 node: old-agent" in lines
    assert lines[-3:] == ["Findings:", "", "  no findings"]
    assert summary_rows([], []) == [["NODE", "STATE", "GPUS", "NVLINK", "NICS", "SOCKETS/NUMA", "RANKS"]]


def test_job_filter_keeps_its_ranks_findings_and_nodes() -> None:
    etl = for_job(three_nodes(), "etl")
    assert [s.node_id for s in etl.nodes] == ["login"]
    assert [(p.job, p.rank) for p in etl.placements] == [("etl", 0)]
    assert list(etl.findings) == []
    train = for_job(three_nodes(), "train")
    assert [s.node_id for s in train.nodes] == ["gpu-a", "gpu-b"]
    assert list(train.findings) == [FINDING]
    assert for_job(three_nodes(), "") == three_nodes()


def test_command_picks_the_node_view_for_one_node() -> None:
    address = "coordinator:50051"
    assert render(three_nodes(), "", "", address) == cluster_lines(three_nodes())
    assert render(three_nodes(), "gpu-b", "", address) == node_lines(
        node("gpu-b", pcie()), three_nodes().placements, three_nodes().findings
    )
    # --job etl: one node left, shown whole; a job placed nowhere says so.
    assert render(three_nodes(), "", "etl", address)[0] == "login  up  0 GPUs, 2 NICs"
    assert render(three_nodes(), "", "nothing", address) == [
        "no rank of job 'nothing' has reported where it runs"
    ]
    single = cluster_pb2.ClusterTopology(nodes=[node("gpu-a", hgx())], placements=hgx_placements())
    assert render(single, "", "", address) == node_lines(single.nodes[0], single.placements)
    assert render(cluster_pb2.ClusterTopology(), "", "", address) == [
        f"no nodes have reported to {address} yet"
    ]


def test_json_round_trips() -> None:
    original = three_nodes()
    document = json.loads(json.dumps(as_json(original)))
    assert document["placements"][0]["gpu"] == 0  # printed although proto3's default: jq sees it
    assert "gpu" not in document["placements"][-1]  # a CPU rank: unset, not 0
    assert document["nodes"][0]["topology"]["gpu_links"][0] == {
        "gpu": 0,
        "peer_gpu": 1,
        "link": "LINK_TYPE_NVLINK",
        "nvlinks": 18,
    }
    assert ParseDict(document, cluster_pb2.ClusterTopology()) == original


# -- the command against a real coordinator ----------------------------------


async def test_topology_command_against_a_coordinator(cluster: Cluster) -> None:
    coordinator = cluster.coordinator(unreachable_after=1000)  # one report, up all along
    async with AgentStream(coordinator.address, "gpu-a") as agent:
        ranks = [rank_report(r, job="train", world_size=8) for r in range(8)]
        await agent.report(*ranks, hardware=node_pb2.NodeReport(topology=hgx()))

        def placed() -> bool:
            with coordinator.client() as client:
                return len(client.topology(node="gpu-a").placements) == 8

        await poll_until(placed, 20, "8 ranks placed on gpu-a")
        flags = ("--coordinator", coordinator.address)
        shown = await asyncio.to_thread(run_cli, "topology", "--node", "gpu-a", *flags)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert grid(lines[2:15]) == grid(HGX_MATRIX.splitlines())
        assert section(lines, "Ranks")[3] == "  train/3  →  GPU3  →  mlx5_1 (PIX)"

        as_json = await asyncio.to_thread(run_cli, "topology", "--json", *flags)
        assert as_json.returncode == 0, as_json.stderr
        answer = ParseDict(json.loads(as_json.stdout), cluster_pb2.ClusterTopology())
        assert answer.nodes[0].topology.gpu_links == hgx().gpu_links

        summary = await asyncio.to_thread(run_cli, "topology", "--job", "train", *flags)
        assert summary.returncode == 0, summary.stderr
        assert summary.stdout.splitlines()[0] == "gpu-a  up  8 GPUs, 4 NICs"  # the job's only node

        unknown = await asyncio.to_thread(run_cli, "topology", "--node", "nowhere", *flags)
        assert unknown.returncode == 1
        assert unknown.stdout == ""
        assert len(unknown.stderr.strip().splitlines()) == 1
        assert "nowhere" in unknown.stderr
