"""Reading a node's topology: link names as ``nvidia-smi topo -m`` writes them, and nearest NICs.

Shared by the coordinator (placements, advice, metrics), the agent's own
/metrics and the ``topology`` command, so every view ranks links the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from clusterwatch.v1 import node_pb2, training_pb2

LinkType = node_pb2.LinkType

# nvidia-smi topo -m's legend; NVLink is written NV<count>.
_LINK_NAMES: dict[int, str] = {
    node_pb2.LINK_TYPE_UNSPECIFIED: "?",
    node_pb2.LINK_TYPE_PIX: "PIX",
    node_pb2.LINK_TYPE_PXB: "PXB",
    node_pb2.LINK_TYPE_PHB: "PHB",
    node_pb2.LINK_TYPE_NODE: "NODE",
    node_pb2.LINK_TYPE_SYS: "SYS",
}

LEGEND: tuple[tuple[str, str], ...] = (
    ("X", "self"),
    ("SYS", "across the interconnect between NUMA nodes (CPU sockets)"),
    ("NODE", "between PCIe host bridges within one NUMA node"),
    ("PHB", "through a PCIe host bridge (the CPU)"),
    ("PXB", "through several PCIe bridges, not a host bridge"),
    ("PIX", "through at most one PCIe bridge"),
    ("NV#", "a bonded set of # NVLinks"),
)

# NICs that can carry NCCL's inter-node traffic without the kernel's TCP stack.
RDMA_KINDS = frozenset({"infiniband", "roce"})


def link_name(link: int, nvlinks: int = 0) -> str:
    """``NV18``, ``PIX``, ``SYS``...; ``NV`` when NVLink with an unknown count; ``?`` when unknown."""
    if link == node_pb2.LINK_TYPE_NVLINK:
        return f"NV{nvlinks}" if nvlinks else "NV"
    return _LINK_NAMES.get(link, "?")


def link_rank(link: int) -> int:
    """Lower is nearer; an unknown link sorts after every known one."""
    return link if link != node_pb2.LINK_TYPE_UNSPECIFIED else len(_LINK_NAMES) + 1


def gpu_link(topology: node_pb2.NodeTopology, gpu: int, peer_gpu: int) -> node_pb2.GpuLink | None:
    """The link between two GPUs of the node (either order); None when not discovered."""
    low, high = min(gpu, peer_gpu), max(gpu, peer_gpu)
    for link in topology.gpu_links:
        if link.gpu == low and link.peer_gpu == high:
            return link
    return None


def nearest_nics(
    topology: node_pb2.NodeTopology, gpu: int
) -> tuple[list[node_pb2.TopologyNic], node_pb2.LinkType.ValueType]:
    """The NICs ``gpu`` reaches with its nearest link, best first, and that link type.

    Best first: RDMA (InfiniBand, RoCE) before ethernet, then the faster,
    then by name. Empty (and LINK_TYPE_UNSPECIFIED) when the node has no NIC
    or no link of that GPU was discovered.
    """
    nics = {nic.device: nic for nic in topology.nics}
    links = [
        (link.link, nics[link.nic]) for link in topology.gpu_nics if link.gpu == gpu and link.nic in nics
    ]
    if not links:
        return [], node_pb2.LINK_TYPE_UNSPECIFIED
    # An RDMA NIC a step further away still beats an ethernet port next to the GPU:
    # NCCL picks RDMA devices first, so nearest is judged among the best kind present.
    best_kind = [pair for pair in links if pair[1].kind in RDMA_KINDS] or links
    nearest = min(link_rank(link) for link, _ in best_kind)
    chosen = [nic for link, nic in best_kind if link_rank(link) == nearest]
    chosen.sort(key=lambda nic: (-nic_rate(nic), nic.device))
    return chosen, min(link for link, _ in best_kind if link_rank(link) == nearest)


def nic_rate(nic: node_pb2.TopologyNic) -> float:
    """The NIC's rate in bytes per second; 0 when unknown."""
    return nic.rate_bytes_per_second if nic.HasField("rate_bytes_per_second") else 0.0


def nvlink_domains(topology: node_pb2.NodeTopology) -> list[set[int]]:
    """GPUs joined by NVLink (directly or through NVSwitches), as sets; single GPUs included."""
    parent = {gpu.index: gpu.index for gpu in topology.gpus}

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for link in topology.gpu_links:
        if link.link == node_pb2.LINK_TYPE_NVLINK and link.gpu in parent and link.peer_gpu in parent:
            parent[root(link.gpu)] = root(link.peer_gpu)
    domains: dict[int, set[int]] = {}
    for index in parent:
        domains.setdefault(root(index), set()).add(index)
    return sorted(domains.values(), key=min)


def gpu_by_uuid(topology: node_pb2.NodeTopology, uuid: str) -> node_pb2.TopologyGpu | None:
    """The node's GPU with this NVML UUID; None when empty or not on the node."""
    if not uuid:
        return None
    return next((gpu for gpu in topology.gpus if gpu.uuid == uuid), None)


@dataclasses.dataclass(frozen=True, slots=True)
class Wiring:
    """What placements and advice read from a node's topology, worked out once per topology.

    Attributes:
        topology: as the agent sent it.
        gpu_by_uuid: GPU index by NVML UUID.
        nearest: per GPU index, ``nearest_nics`` of it.
        domains: ``nvlink_domains``.
    """

    topology: node_pb2.NodeTopology
    gpu_by_uuid: dict[str, int]
    nearest: dict[int, tuple[tuple[node_pb2.TopologyNic, ...], node_pb2.LinkType.ValueType]]
    domains: list[set[int]]

    @classmethod
    def of(cls, topology: node_pb2.NodeTopology) -> Wiring:
        nearest = {}
        for gpu in topology.gpus:
            nics, link = nearest_nics(topology, gpu.index)
            nearest[gpu.index] = (tuple(nics), link)
        return cls(
            topology,
            {gpu.uuid: gpu.index for gpu in topology.gpus if gpu.uuid},
            nearest,
            nvlink_domains(topology),
        )


def format_ranks(ranks: Iterable[int]) -> str:
    """``0-3,8,10-11``: sorted, runs collapsed."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in ordered:
        if previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(_run(start, previous))
        start = previous = rank
    if start is not None:
        parts.append(_run(start, previous))
    return ",".join(parts)


def _run(start: int, end: int | None) -> str:
    return str(start) if end is None or end == start else f"{start}-{end}"


def members(group: training_pb2.ProcessGroupMembership) -> list[int]:
    """Global ranks of a process group: the listed ones, else the progression."""
    if group.ranks:
        return list(group.ranks)
    stride = group.stride or 1
    return [group.first_rank + i * stride for i in range(group.size)]
