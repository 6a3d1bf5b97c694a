"""Where a job's ranks sit on the wiring, and what that means for its parallelism.

Placement: rank -> node (the agent that reports it) -> GPU
(``RankIdentity.gpu_uuid`` found in the node's topology) -> the NICs that GPU
reaches with its nearest link (clusterwatch/wire/topology.py).

Advice comes from the process groups each rank reports (``Heartbeat.process_groups``),
their role read from the group's description, as DeviceMesh (``mesh_tp``),
Megatron (``TENSOR_MODEL_PARALLEL_GROUP``) and most users name them:

* a tensor-parallel group should stay inside one NVLink domain: its
  all-reduces run once or more per layer. One that spans nodes, or sits on
  one node but reaches a member GPU only over PCIe, gets a warning;
* a pipeline group's stage boundaries that cross nodes should leave each
  node through its fastest NIC, next to the sending GPU: a boundary whose
  rank's nearest NIC is slower than the node's fastest gets a warning, and
  one whose nearest NIC is across CPU sockets (SYS) an info.

A group is judged only once every member is placed (during start-up some
ranks have not reported yet). Findings are statements, not orders: the
layout may be a deliberate trade.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence

from clusterwatch.coordinator.model.jobs import JobRecord, RankRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.text.humanize import bandwidth
from clusterwatch.v1 import cluster_pb2, node_pb2, training_pb2
from clusterwatch.wire import topology


class GroupRole(enum.StrEnum):
    TENSOR = "tensor-parallel"
    PIPELINE = "pipeline"


class FindingKind(enum.StrEnum):
    TENSOR_PARALLEL_SPANS_NODES = "tensor_parallel_spans_nodes"
    TENSOR_PARALLEL_OUTSIDE_NVLINK = "tensor_parallel_outside_nvlink"
    PIPELINE_SLOW_NIC = "pipeline_slow_nic"
    PIPELINE_NIC_ACROSS_SOCKETS = "pipeline_nic_across_sockets"


WARNING = "warning"
INFO = "info"

_TOKEN = re.compile(r"[a-z]+")
_TENSOR_WORDS = frozenset({"tp", "tensor"})
_PIPELINE_WORDS = frozenset({"pp", "pipe", "pipeline"})


def group_role(description: str) -> GroupRole | None:
    """The role a group's description names: ``mesh_tp``, ``TENSOR_MODEL_PARALLEL_GROUP``, ``pp``...; None: other."""
    words = set(_TOKEN.findall(description.lower()))
    if words & _TENSOR_WORDS:
        return GroupRole.TENSOR
    if words & _PIPELINE_WORDS:
        return GroupRole.PIPELINE
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank runs; gpu and NICs None/empty when unknown."""

    rank: int
    node_id: str
    gpu: int | None
    nics: tuple[node_pb2.TopologyNic, ...]
    nic_link: node_pb2.LinkType.ValueType

    def to_proto(self, job: str) -> cluster_pb2.RankPlacement:
        placement = cluster_pb2.RankPlacement(
            job=job,
            rank=self.rank,
            node_id=self.node_id,
            nearest_nics=[nic.device for nic in self.nics],
            nic_link=self.nic_link,
        )
        if self.gpu is not None:
            placement.gpu = self.gpu
        return placement


def node_topology(node: NodeRecord | None) -> node_pb2.NodeTopology | None:
    return node.topology if node is not None else None


def place(record: RankRecord, nodes: Mapping[str, NodeRecord]) -> Placement:
    """Where ``record`` runs, as far as its node's topology tells."""
    node = nodes.get(record.node_id)
    wiring = node.wiring if node is not None else None
    gpu = wiring.gpu_by_uuid.get(record.identity.gpu_uuid) if wiring is not None else None
    if wiring is None or gpu is None:
        return Placement(record.rank, record.node_id, None, (), node_pb2.LINK_TYPE_UNSPECIFIED)
    nics, link = wiring.nearest[gpu]
    return Placement(record.rank, record.node_id, gpu, nics, link)


def job_placements(job: JobRecord, nodes: Mapping[str, NodeRecord]) -> dict[int, Placement]:
    """Every running rank of the job, placed."""
    return {record.rank: place(record, nodes) for record in job.running_ranks()}


def job_groups(job: JobRecord) -> list[training_pb2.ProcessGroupMembership]:
    """The job's process groups as its running ranks report them, by name (the lowest member's copy).

    A group whose members do not include the reporting rank, or lie beyond the
    world size, is left out: it cannot be that rank's group.
    """
    groups: dict[str, training_pb2.ProcessGroupMembership] = {}
    for record in sorted(job.running_ranks(), key=lambda r: r.rank):
        if record.heartbeat is None:
            continue
        for group in record.heartbeat.process_groups:
            if group.group_name in groups:
                continue
            members = topology.members(group)
            # Only a member's honest account counts (the agent checks the same against the world size).
            if record.rank in members and max(members) < job.world_size:
                groups[group.group_name] = group
    return [groups[name] for name in sorted(groups, key=_name_order)]


def job_findings(
    job: JobRecord, nodes: Mapping[str, NodeRecord], placements: Mapping[int, Placement] | None = None
) -> list[cluster_pb2.TopologyFinding]:
    """What the job's tensor-parallel and pipeline groups meet on the wiring (see the module docstring).

    Args:
        placements: ``job_placements(job, nodes)`` when the caller has them already.
    """
    if placements is None:
        placements = job_placements(job, nodes)
    findings: list[cluster_pb2.TopologyFinding] = []
    for group in job_groups(job):
        role = group_role(group.description)
        members = topology.members(group)
        if role is None or not members or any(rank not in placements for rank in members):
            continue
        judged = _Judged(job.job, group, role, [placements[rank] for rank in members])
        if role is GroupRole.TENSOR:
            finding = _tensor_finding(judged, nodes)
            findings.extend([finding] if finding is not None else [])
        else:
            findings.extend(_pipeline_findings(judged, nodes))
    return findings


def _tensor_finding(judged: _Judged, nodes: Mapping[str, NodeRecord]) -> cluster_pb2.TopologyFinding | None:
    placed = judged.placed
    by_node = _ranks_by_node(placed)
    name = judged.label
    if len(by_node) > 1:
        spread = "; ".join(
            f"{node_id}: ranks {topology.format_ranks(ranks)}" for node_id, ranks in by_node.items()
        )
        per_node = _gpus_per_node(by_node, nodes)
        room = (
            f"; each of these nodes has {per_node} GPUs, so a tensor-parallel size up to {per_node} fits in one"
            if per_node
            else ""
        )
        return judged.finding(
            FindingKind.TENSOR_PARALLEL_SPANS_NODES,
            WARNING,
            placed,
            f"{name} spans {len(by_node)} nodes ({spread}): its all-reduces, one or more per layer, "
            f"cross the network instead of staying inside a node{room}",
        )
    (node_id,) = by_node
    node = nodes.get(node_id)
    wiring = node.wiring if node is not None else None
    gpus = [p.gpu for p in placed]
    if wiring is None or any(gpu is None for gpu in gpus) or not wiring.topology.gpu_links:
        return None
    topo = wiring.topology
    known = [gpu for gpu in gpus if gpu is not None]
    domains = wiring.domains
    if any(set(known) <= domain for domain in domains):
        return None
    worst = _worst_link(topo, known)
    if worst is None:
        return None
    link, a, b = worst
    # With an NVLink domain that could hold the group, the placement is the problem: warn.
    # On a node without one, only a path across host bridges or sockets is worth saying.
    fits = max(map(len, domains), default=0) >= len(set(known))
    if not fits and link not in (node_pb2.LINK_TYPE_NODE, node_pb2.LINK_TYPE_SYS):
        return None
    return judged.finding(
        FindingKind.TENSOR_PARALLEL_OUTSIDE_NVLINK,
        WARNING if fits else INFO,
        placed,
        f"{name} stays on {node_id} but not inside one NVLink domain: GPUs {a} and {b} are joined by "
        f"{topology.link_name(link)} ({_legend(link)})"
        + (
            f", while {node_id} has NVLink domains of {max(map(len, domains))} GPUs"
            if fits
            else f"; {node_id} has no NVLink, but GPUs that share a PCIe switch are closer"
        ),
    )


def _pipeline_findings(judged: _Judged, nodes: Mapping[str, NodeRecord]) -> list[cluster_pb2.TopologyFinding]:
    findings: list[cluster_pb2.TopologyFinding] = []
    seen: set[int] = set()
    for sender, receiver in itertools.pairwise(judged.placed):
        if sender.node_id == receiver.node_id:
            continue
        boundary = f"the stage boundary rank {sender.rank} ({sender.node_id}) -> rank {receiver.rank} ({receiver.node_id})"
        for side in (sender, receiver):
            if side.rank in seen or not side.nics:
                continue
            seen.add(side.rank)
            findings.extend(_nic_findings(judged, boundary, side, nodes))
    return findings


def _nic_findings(
    judged: _Judged, boundary: str, side: Placement, nodes: Mapping[str, NodeRecord]
) -> list[cluster_pb2.TopologyFinding]:
    findings: list[cluster_pb2.TopologyFinding] = []
    nic = side.nics[0]
    topo = node_topology(nodes.get(side.node_id))
    fastest = _fastest_nic(topo, nic.kind) if topo is not None else None
    rate = topology.nic_rate(nic)
    if fastest is not None and rate > 0 and topology.nic_rate(fastest) > rate:
        findings.append(
            judged.finding(
                FindingKind.PIPELINE_SLOW_NIC,
                WARNING,
                [side],
                f"{judged.label}: at {boundary}, rank {side.rank} (GPU {side.gpu}) is nearest {nic.device} at "
                f"{bandwidth(rate)}, while {side.node_id}'s fastest NIC, {fastest.device}, runs at "
                f"{bandwidth(topology.nic_rate(fastest))}",
            )
        )
    if side.nic_link == node_pb2.LINK_TYPE_SYS:
        findings.append(
            judged.finding(
                FindingKind.PIPELINE_NIC_ACROSS_SOCKETS,
                INFO,
                [side],
                f"{judged.label}: at {boundary}, rank {side.rank}'s GPU {side.gpu} on {side.node_id} reaches its "
                f"nearest NIC, {nic.device}, only across CPU sockets (SYS)",
            )
        )
    return findings


def _fastest_nic(topo: node_pb2.NodeTopology, kind: str) -> node_pb2.TopologyNic | None:
    """The node's fastest NIC of the same class (RDMA or not) as ``kind``."""
    rdma = kind in topology.RDMA_KINDS
    same = [nic for nic in topo.nics if (nic.kind in topology.RDMA_KINDS) == rdma]
    return max(same, key=topology.nic_rate, default=None)


def _worst_link(topo: node_pb2.NodeTopology, gpus: Sequence[int]) -> tuple[int, int, int] | None:
    """(link, gpu, peer) of the farthest pair among ``gpus``."""
    worst: tuple[int, int, int] | None = None
    for i, a in enumerate(gpus):
        for b in gpus[i + 1 :]:
            link = topology.gpu_link(topo, a, b)
            kind = link.link if link is not None else node_pb2.LINK_TYPE_UNSPECIFIED
            if kind == node_pb2.LINK_TYPE_NVLINK:
                continue
            if worst is None or topology.link_rank(kind) > topology.link_rank(worst[0]):
                worst = (kind, min(a, b), max(a, b))
    return worst


def _legend(link: int) -> str:
    return dict(topology.LEGEND).get(topology.link_name(link), "")


def _ranks_by_node(placed: Iterable[Placement]) -> dict[str, list[int]]:
    by_node: dict[str, list[int]] = {}
    for p in placed:
        by_node.setdefault(p.node_id, []).append(p.rank)
    return by_node


def _gpus_per_node(by_node: Mapping[str, object], nodes: Mapping[str, NodeRecord]) -> int:
    """The fewest GPUs any of these nodes has (0 when a topology is missing)."""
    counts = [len(topo.gpus) if (topo := node_topology(nodes.get(node_id))) else 0 for node_id in by_node]
    return min(counts, default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class _Judged:
    """One group of one job being judged; makes its findings."""

    job: str
    group: training_pb2.ProcessGroupMembership
    role: GroupRole
    placed: Sequence[Placement]

    @property
    def label(self) -> str:
        ranks = topology.format_ranks(p.rank for p in self.placed)
        return f"{self.role} group {self.group.description or self.group.group_name!r} (ranks {ranks})"

    def finding(
        self, kind: FindingKind, severity: str, placed: Sequence[Placement], message: str
    ) -> cluster_pb2.TopologyFinding:
        return cluster_pb2.TopologyFinding(
            job=self.job,
            kind=kind.value,
            severity=severity,
            group_name=self.group.group_name,
            group_description=self.group.description,
            ranks=[p.rank for p in placed],
            nodes=sorted({p.node_id for p in placed}),
            message=message,
        )


def _name_order(name: str) -> tuple[int, str]:
    """Numeric group names ("0", "1", "10") in number order, others after."""
    return (int(name), "") if name.isdigit() else (1 << 62, name)
