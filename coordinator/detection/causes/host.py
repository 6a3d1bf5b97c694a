"""Rule 2, host: memory pressure or CPU saturation on the straggler's node that its peers' nodes do not share.

The rule's thresholds and order are in coordinator/detection/causes/__init__.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from clusterwatch.coordinator.detection.causes.shared import (
    Cause,
    CauseName,
    CauseSettings,
    Peers,
    median,
    put,
    report_of,
)
from clusterwatch.coordinator.model.jobs import RankRecord
from clusterwatch.coordinator.model.state import NodeRecord


@dataclasses.dataclass(frozen=True, slots=True)
class _HostSignals:
    cpu_utilization_ratio: float | None
    load_per_cpu_ratio: float | None
    memory_available_ratio: float | None
    swap_growth_bytes_per_s: float | None
    swap_used_bytes: int | None

    def cpu_saturated(self, settings: CauseSettings) -> bool:
        return (
            self.cpu_utilization_ratio is not None
            and self.cpu_utilization_ratio >= settings.cpu_utilization_ratio
        ) or (self.load_per_cpu_ratio is not None and self.load_per_cpu_ratio >= settings.load_per_cpu_ratio)

    def memory_pressure(self, settings: CauseSettings) -> bool:
        return (
            self.memory_available_ratio is not None
            and self.memory_available_ratio < settings.memory_available_below_ratio
        ) or (
            self.swap_growth_bytes_per_s is not None
            and self.swap_growth_bytes_per_s >= settings.swap_growth_bytes_per_s
        )


def _host_signals(node: NodeRecord | None) -> _HostSignals | None:
    report = report_of(node)
    if report is None or not report.HasField("host"):
        return None
    host = report.host
    load_per_cpu = host.load1 / host.cpu_count if host.HasField("load1") and host.cpu_count > 0 else None
    available = None
    if host.HasField("memory_available_bytes") and host.HasField("memory_total_bytes"):
        total = host.memory_total_bytes
        available = host.memory_available_bytes / total if total > 0 else None
    swap_used = host.swap_used_bytes if host.HasField("swap_used_bytes") else None
    swap_growth = None
    previous = node.previous if node is not None else None
    if (
        swap_used is not None
        and previous is not None
        and previous.HasField("host")
        and previous.host.HasField("swap_used_bytes")
    ):
        elapsed_s = report.timestamp_unix_seconds - previous.timestamp_unix_seconds
        if elapsed_s > 0:
            swap_growth = (swap_used - previous.host.swap_used_bytes) / elapsed_s
    return _HostSignals(
        host.cpu_utilization_ratio if host.HasField("cpu_utilization_ratio") else None,
        load_per_cpu,
        available,
        swap_growth,
        swap_used,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class PeerHostFigures:
    """What the rule reads of the peers' nodes' hosts (medians of the nodes that report them).

    Attributes:
        memory_pressure_shared / cpu_saturation_shared: half of the peer
            nodes with data or more show it (false with none).
    """

    memory_available_ratio: float | None
    cpu_utilization_ratio: float | None
    load_per_cpu_ratio: float | None
    memory_pressure_shared: bool
    cpu_saturation_shared: bool


class HostPeers:
    """The peers' nodes' host signals, read once for all of a job's stragglers (rule 2).

    A straggler's node is never among them where they count: a peer on its node rules the rule out.
    """

    def __init__(self, peers: Peers, settings: CauseSettings) -> None:
        self.nodes = peers.nodes
        self._peers = peers
        self._settings = settings

    def on_node(self, node_id: str) -> bool:
        """Whether a peer runs on the node."""
        return node_id in self._peers.node_ids

    @functools.cached_property
    def figures(self) -> PeerHostFigures:
        nodes, settings = self._peers.nodes, self._settings
        signals = [s for s in map(_host_signals, map(nodes.get, self._peers.node_ids)) if s is not None]
        return PeerHostFigures(
            median(s.memory_available_ratio for s in signals),
            median(s.cpu_utilization_ratio for s in signals),
            median(s.load_per_cpu_ratio for s in signals),
            not _not_shared(signals, lambda s: s.memory_pressure(settings)),
            not _not_shared(signals, lambda s: s.cpu_saturated(settings)),
        )


def host_cause(record: RankRecord, peers: HostPeers, settings: CauseSettings) -> Cause | None:
    """The host cause of a straggler (rule 2), or None when its node does not explain it."""
    if peers.on_node(record.node_id):
        return None  # healthy ranks share the node: a node-wide signal cannot single this one out
    own = _host_signals(peers.nodes.get(record.node_id))
    if own is None:
        return None
    figures = peers.figures
    where = f"{record.node_id}, where rank {record.rank} runs,"
    if own.memory_pressure(settings) and not figures.memory_pressure_shared:
        evidence: dict[str, float] = {}
        put(evidence, "host_memory_available_ratio", own.memory_available_ratio)
        put(evidence, "peer_host_memory_available_ratio", figures.memory_available_ratio)
        put(evidence, "host_swap_used_bytes", own.swap_used_bytes)
        put(evidence, "host_swap_growth_bytes_per_second", own.swap_growth_bytes_per_s)
        parts = []
        if own.memory_available_ratio is not None:
            parts.append(f"has {own.memory_available_ratio * 100:.1f} % of its memory available")
        if own.swap_growth_bytes_per_s is not None and own.swap_growth_bytes_per_s > 0:
            parts.append(f"swap use growing by {own.swap_growth_bytes_per_s / (1 << 20):.1f} MiB/s")
        return Cause(
            CauseName.HOST_MEMORY,
            f"{where} is short of memory: {' and '.join(parts)}",
            evidence,
            (record.node_id,),
        )
    if own.cpu_saturated(settings) and not figures.cpu_saturation_shared:
        evidence = {}
        put(evidence, "host_cpu_utilization_ratio", own.cpu_utilization_ratio)
        put(evidence, "peer_host_cpu_utilization_ratio", figures.cpu_utilization_ratio)
        put(evidence, "host_load1_per_cpu_ratio", own.load_per_cpu_ratio)
        put(evidence, "peer_host_load1_per_cpu_ratio", figures.load_per_cpu_ratio)
        parts = []
        if own.cpu_utilization_ratio is not None:
            parts.append(f"CPU {own.cpu_utilization_ratio * 100:.0f} % busy")
        if own.load_per_cpu_ratio is not None:
            parts.append(f"load {own.load_per_cpu_ratio:.2f} per CPU")
        peer_cpu = evidence.get("peer_host_cpu_utilization_ratio")
        contrast = f" while its peers' nodes are at {peer_cpu * 100:.0f} %" if peer_cpu is not None else ""
        return Cause(
            CauseName.HOST_CPU,
            f"{where} is CPU-saturated ({', '.join(parts)}){contrast}",
            evidence,
            (record.node_id,),
        )
    return None


def _not_shared(peer_signals: Sequence[_HostSignals], signal: Callable[[_HostSignals], bool]) -> bool:
    """Whether fewer than half of the peer nodes with data show the signal too (true with none)."""
    return not peer_signals or 2 * sum(1 for s in peer_signals if signal(s)) < len(peer_signals)
