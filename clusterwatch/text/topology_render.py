"""A node's wiring and the cluster's placements as text: ``clusterwatch topology`` and the TUI's node detail.

Pure functions from the API's messages to lines, so the command and ``top``
print the same thing. A node's matrix follows ``nvidia-smi topo -m``: a row
per GPU and per NIC, ``X`` on the diagonal, the link names of
:func:`clusterwatch.wire.topology.link_name`, then the NIC and link legends.
"""

from __future__ import annotations

from collections.abc import Iterable

from clusterwatch.text.humanize import bandwidth, columns, node_state
from clusterwatch.v1 import cluster_pb2, node_pb2
from clusterwatch.wire.topology import (
    LEGEND,
    RDMA_KINDS,
    format_ranks,
    gpu_link,
    link_name,
    nearest_nics,
    nic_rate,
    nvlink_domains,
)

NodeState = cluster_pb2.NodeState

NOT_DISCOVERED = "-"
"""A matrix cell the agent does not discover: NIC to NIC."""
UNKNOWN_LINK = "?"
"""A GPU pair or GPU x NIC pair whose link was not discovered (see the node's problems)."""
TIMES = "\N{MULTIPLICATION SIGN}"
"""The multiplication sign, between a count and a size: one NVLink domain of eight GPUs."""
ARROW = "→"
NOT_REPORTED = "topology not reported (an older agent, or discovery is off)"
_EXTRA_LEGEND = ((UNKNOWN_LINK, "not discovered"), (NOT_DISCOVERED, "not discovered (NIC to NIC)"))


# -- one node -----------------------------------------------------------------


def nic_labels(topology: node_pb2.NodeTopology) -> dict[str, str]:
    """``mlx5_0`` -> ``NIC0``, in the order the agent listed the NICs (as nvidia-smi numbers them)."""
    return {nic.device: f"NIC{i}" for i, nic in enumerate(topology.nics)}


def _gpu_nic_cell(topology: node_pb2.NodeTopology, gpu: int, nic: str) -> str:
    for link in topology.gpu_nics:
        if link.gpu == gpu and link.nic == nic:
            return link_name(link.link)
    return UNKNOWN_LINK


def _gpu_gpu_cell(topology: node_pb2.NodeTopology, gpu: int, peer: int) -> str:
    if gpu == peer:
        return "X"
    link = gpu_link(topology, gpu, peer)
    return UNKNOWN_LINK if link is None else link_name(link.link, link.nvlinks)


def matrix_lines(topology: node_pb2.NodeTopology) -> list[str]:
    """The ``nvidia-smi topo -m`` matrix: GPU rows (with CPU and NUMA affinity), then NIC rows.

    Header: ``GPU0 .. GPUn NIC0 .. NICm CPU Affinity NUMA Affinity``; cells
    are link names, ``X`` on the diagonal, ``?`` for a link not discovered and
    ``-`` NIC to NIC (not discovered by the agent). An affinity not known is
    ``N/A``. Empty when the node has neither GPUs nor NICs.
    """
    gpus = [gpu.index for gpu in topology.gpus]
    nics = [nic.device for nic in topology.nics]
    if not gpus and not nics:
        return []
    labels = nic_labels(topology)
    header = ["", *(f"GPU{g}" for g in gpus), *(labels[n] for n in nics)]
    rows: list[list[str]] = []
    for gpu in topology.gpus:
        rows.append(
            [
                f"GPU{gpu.index}",
                *(_gpu_gpu_cell(topology, gpu.index, peer) for peer in gpus),
                *(_gpu_nic_cell(topology, gpu.index, nic) for nic in nics),
                gpu.local_cpus or "N/A",
                str(gpu.numa_node) if gpu.HasField("numa_node") else "N/A",
            ]
        )
    for nic in nics:
        rows.append(
            [
                labels[nic],
                *(_gpu_nic_cell(topology, gpu, nic) for gpu in gpus),
                *("X" if peer == nic else NOT_DISCOVERED for peer in nics),
            ]
        )
    if gpus:
        header += ["CPU Affinity", "NUMA Affinity"]
    return columns([header, *rows], gap="  ")


def nic_legend_lines(topology: node_pb2.NodeTopology) -> list[str]:
    """``NIC0: mlx5_0  infiniband  50.0GB/s (400Gb/s)  ACTIVE  pci 0000:0c:00.0  NUMA 0  ib0``, a line per NIC."""
    labels = nic_labels(topology)
    rows = [
        [
            f"{labels[nic.device]}: {nic.device}",
            nic.kind or "?",
            _rate(nic),
            nic.state or "?",
            f"pci {nic.pci_bus_id or '?'}",
            f"NUMA {nic.numa_node}" if nic.HasField("numa_node") else "NUMA N/A",
            ",".join(nic.interfaces),
        ]
        for nic in topology.nics
    ]
    return columns(rows, indent="  ")


def _rate(nic: node_pb2.TopologyNic) -> str:
    """Bytes per second as everywhere in clusterwatch, and bits as links are sold (``400Gb/s``)."""
    rate = nic_rate(nic)
    if not rate:
        return "rate ?"
    gbit = rate * 8 / 1e9
    return f"{bandwidth(rate)} ({gbit:.0f}Gb/s)" if gbit >= 1 else bandwidth(rate)


def legend_lines(cells: Iterable[str] = ()) -> list[str]:
    """The link legend; ``?`` and ``-`` are explained only when ``cells`` hold them."""
    shown = set(cells)
    entries = [*LEGEND, *(entry for entry in _EXTRA_LEGEND if entry[0] in shown)]
    width = max(len(name) for name, _ in entries)
    return [f"  {name.ljust(width)} = {meaning}" for name, meaning in entries]


def nearest_nic_lines(topology: node_pb2.NodeTopology) -> list[str]:
    """``GPU0 → NIC0 mlx5_0 (PIX)``: each GPU's nearest NICs, best first (RDMA, then faster)."""
    labels = nic_labels(topology)
    rows = []
    for gpu in topology.gpus:
        nics, link = nearest_nics(topology, gpu.index)
        target = (
            ", ".join(f"{labels[n.device]} {n.device}" for n in nics) + f" ({link_name(link)})"
            if nics
            else "no NIC link discovered"
        )
        rows.append([f"GPU{gpu.index}", ARROW, target])
    return columns(rows, indent="  ")


def placement_lines(placements: Iterable[cluster_pb2.RankPlacement]) -> list[str]:
    """``train/3 → GPU3 → mlx5_1 (PIX)``: each rank on the node, by job and rank."""
    rows = []
    for p in sorted(placements, key=lambda p: (p.job, p.rank)):
        gpu = f"GPU{p.gpu}" if p.HasField("gpu") else "no GPU"
        nics = f"{', '.join(p.nearest_nics)} ({link_name(p.nic_link)})" if p.nearest_nics else "NIC unknown"
        rows.append([f"{p.job}/{p.rank}", ARROW, gpu, ARROW, nics])
    return columns(rows, indent="  ")


def numa_lines(topology: node_pb2.NodeTopology) -> list[str]:
    """Sockets and NUMA nodes, with their CPUs."""
    sockets = topology.cpu_sockets
    lines = [f"CPU sockets: {sockets if sockets else '?'}, NUMA nodes: {len(topology.numa_nodes) or '?'}"]
    lines += columns([[f"NUMA {n.id}:", f"CPUs {n.cpus or '?'}"] for n in topology.numa_nodes], indent="  ")
    return lines


def finding_lines(findings: Iterable[cluster_pb2.TopologyFinding]) -> list[str]:
    """``warning  train  <message>``, a line each; ``no findings`` when none."""
    rows = [[f.severity or "info", f.job or "-", f.message or f.kind] for f in findings]
    return columns(rows, indent="  ") if rows else ["  no findings"]


def node_lines(
    status: cluster_pb2.NodeTopologyStatus,
    placements: Iterable[cluster_pb2.RankPlacement] = (),
    findings: Iterable[cluster_pb2.TopologyFinding] = (),
) -> list[str]:
    """Everything ``clusterwatch topology --node`` prints about one node.

    The header, the matrix and its legends, each GPU's nearest NICs, the ranks
    placed there (``placements`` of other nodes are left out), the findings
    naming the node (or no node), sockets and NUMA nodes, and what discovery could not
    find. A node without GPUs shows its NICs and NUMA nodes; one that sent no
    topology says so.
    """
    on_node = [p for p in placements if p.node_id == status.node_id]
    about_node = [f for f in findings if status.node_id in f.nodes or not f.nodes]
    header = f"{status.node_id}  {node_state(status.state)}"
    if not status.HasField("topology"):
        return [header, NOT_REPORTED, *_ranks_section(on_node)]
    topology = status.topology
    gpus, nics = len(topology.gpus), len(topology.nics)
    header += f"  {gpus} GPU{'s' if gpus != 1 else ''}, {nics} NIC{'s' if nics != 1 else ''}"
    lines = [header, ""]
    matrix = matrix_lines(topology)
    if not topology.gpus:
        lines.append(f"{status.node_id} has no GPUs.")
        lines.append("")
    if topology.gpus:
        lines += matrix
        lines.append("")
    if topology.nics:
        lines += [*section("NIC Legend", nic_legend_lines(topology)), ""]
    else:
        lines += ["no NICs discovered", ""]
    if topology.gpus:
        cells = {cell for row in matrix[1:] for cell in row.split()}
        lines += [*section("Legend", legend_lines(cells)), ""]
        lines += [*section("Nearest NICs", nearest_nic_lines(topology)), ""]
    lines += numa_lines(topology)
    lines += _ranks_section(on_node)
    if about_node:
        lines += ["", *section("Findings", finding_lines(about_node))]
    if topology.problems:
        lines += ["", *section("Problems", [f"  {problem}" for problem in topology.problems])]
    return lines


def _ranks_section(on_node: list[cluster_pb2.RankPlacement]) -> list[str]:
    return ["", *section("Ranks", placement_lines(on_node) if on_node else ["  no ranks placed"])]


def section(title: str, lines: list[str]) -> list[str]:
    """``Title:``, a blank line, the lines: how nvidia-smi sets out its legends."""
    return [f"{title}:", "", *lines]


# -- the cluster --------------------------------------------------------------


def nvlink_summary(topology: node_pb2.NodeTopology) -> str:
    """The node's NVLink domains: how many, of how many GPUs, with how many NVLinks per GPU pair.

    Written ``<domains>x<GPUs> NV<links>``, the x being :data:`TIMES`: one
    domain of eight GPUs all joined by 18 NVLinks is "1x8 NV18", two of four
    "2x4 NV12". Domains of different shapes are listed biggest first, single
    GPUs last ("1x4 NV12, 4x1"); a pair count that varies in a domain is a
    range ("NV12-18"). ``none`` when no two GPUs share NVLink, ``-`` without GPUs.
    """
    if not topology.gpus:
        return "-"
    shapes: dict[tuple[int, str], int] = {}
    for domain in nvlink_domains(topology):
        counts = {
            link.nvlinks
            for link in topology.gpu_links
            if link.link == node_pb2.LINK_TYPE_NVLINK and link.gpu in domain and link.peer_gpu in domain
        }
        known = sorted(c for c in counts if c)
        if len(domain) == 1:
            label = ""
        elif not known:
            label = " NV"
        elif known[0] == known[-1]:
            label = f" NV{known[0]}"
        else:
            label = f" NV{known[0]}-{known[-1]}"
        shape = (len(domain), label)
        shapes[shape] = shapes.get(shape, 0) + 1
    if all(size == 1 for size, _ in shapes):
        return "none"
    ordered = sorted(shapes.items(), key=lambda item: (-item[0][0], item[0][1]))
    return ", ".join(f"{count}{TIMES}{size}{label}" for (size, label), count in ordered)


def nic_summary(topology: node_pb2.NodeTopology) -> str:
    """``4 infiniband 50.0GB/s``: how many NICs of each kind and the fastest, RDMA first; ``none``."""
    kinds: dict[str, list[float]] = {}
    for nic in topology.nics:
        kinds.setdefault(nic.kind or "?", []).append(nic_rate(nic))
    if not kinds:
        return "none"
    ordered = sorted(kinds.items(), key=lambda item: (item[0] not in RDMA_KINDS, -max(item[1]), item[0]))
    return ", ".join(
        f"{len(rates)} {kind}" + (f" {bandwidth(max(rates))}" if max(rates) else "")
        for kind, rates in ordered
    )


def summary_rows(
    nodes: Iterable[cluster_pb2.NodeTopologyStatus], placements: Iterable[cluster_pb2.RankPlacement]
) -> list[list[str]]:
    """The cluster summary as cells: a header, then a row per node, by node id."""
    ranks: dict[str, dict[str, list[int]]] = {}
    for p in placements:
        ranks.setdefault(p.node_id, {}).setdefault(p.job, []).append(p.rank)
    rows = [["NODE", "STATE", "GPUS", "NVLINK", "NICS", "SOCKETS/NUMA", "RANKS"]]
    for status in sorted(nodes, key=lambda s: s.node_id):
        placed = " ".join(
            f"{job}:{format_ranks(r)}" for job, r in sorted(ranks.get(status.node_id, {}).items())
        )
        if not status.HasField("topology"):
            rows.append([status.node_id, node_state(status.state), "?", "-", "-", "-", placed or "-"])
            continue
        t = status.topology
        sockets = f"{t.cpu_sockets or '?'}/{len(t.numa_nodes) or '?'}"
        rows.append(
            [
                status.node_id,
                node_state(status.state),
                str(len(t.gpus)) if t.gpus else "no GPUs",
                nvlink_summary(t),
                nic_summary(t),
                sockets,
                placed or "-",
            ]
        )
    return rows


def cluster_lines(cluster: cluster_pb2.ClusterTopology) -> list[str]:
    """Everything ``clusterwatch topology`` prints without ``--node``: the summary, then the findings."""
    lines = columns(summary_rows(cluster.nodes, cluster.placements)) if cluster.nodes else ["no nodes"]
    notes = []
    missing = sorted(s.node_id for s in cluster.nodes if not s.HasField("topology"))
    if missing:
        notes.append(f"topology not reported by {_count(len(missing), 'node')}: {', '.join(missing)}")
    for status in sorted(cluster.nodes, key=lambda s: s.node_id):
        if status.HasField("topology") and status.topology.problems:
            problems = _count(len(status.topology.problems), "discovery problem")
            notes.append(f"{status.node_id}: {problems} (clusterwatch topology --node {status.node_id})")
    if notes:
        lines += ["", *notes]
    return [*lines, "", *section("Findings", finding_lines(cluster.findings))]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def for_job(cluster: cluster_pb2.ClusterTopology, job: str) -> cluster_pb2.ClusterTopology:
    """Only ``job``'s placements and findings, and only the nodes its ranks are placed on; all when empty."""
    if not job:
        return cluster
    placements = [p for p in cluster.placements if p.job == job]
    findings = [f for f in cluster.findings if f.job == job]
    used = {p.node_id for p in placements} | {n for f in findings for n in f.nodes}
    nodes = [s for s in cluster.nodes if s.node_id in used]
    return cluster_pb2.ClusterTopology(nodes=nodes, placements=placements, findings=findings)
