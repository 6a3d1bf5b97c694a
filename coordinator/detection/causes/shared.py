"""What every cause rule shares: the Cause it returns, its names and settings, and small helpers.

Pure, like the rules (coordinator/detection/causes/__init__.py says which rule runs when).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import statistics
from collections.abc import Collection, Iterable, Mapping
from typing import Literal

from clusterwatch.coordinator.model.jobs import JobRecord, RankRecord
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.errors import ConfigError
from clusterwatch.v1 import node_pb2


class CauseName(enum.StrEnum):
    """What ``Cause.name`` can be (the ``cause`` of an incident)."""

    GPU_THERMAL = "gpu_thermal"
    GPU_POWER = "gpu_power"
    GPU_CLOCK = "gpu_clock"
    HOST_CPU = "host_cpu"
    HOST_MEMORY = "host_memory"
    NETWORK = "network"
    COMMUNICATION = "communication"
    COMPUTE = "compute"


@dataclasses.dataclass(frozen=True)
class Cause:
    """The likely cause of a finding.

    Attributes:
        name: one of CauseName's values.
        detail: one sentence for people, with the numbers.
        evidence: the numbers behind it, by name with unit suffix
            (``sm_clock_hertz``, ``peer_sm_clock_hertz``...); peers' values
            are medians.
        nodes: the nodes at fault, when the cause is node-specific; empty otherwise.
        interfaces: (node, interface) at fault, when a network cause can tell.
    """

    name: str
    detail: str
    evidence: dict[str, float]
    nodes: tuple[str, ...] = ()
    interfaces: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class CauseSettings:
    """Thresholds of cause attribution (see the module docstring for the rules).

    Attributes:
        sm_clock_below_peers_ratio: an SM clock below this x the peers' median is low.
        cpu_utilization_ratio: host CPU this busy (0-1) is saturated.
        load_per_cpu_ratio: ...as is a 1-minute load average this high per CPU.
        memory_available_below_ratio: available memory below this share of
            the total is memory pressure.
        swap_growth_bytes_per_s: ...as is swap use growing this fast.
        errors_min_per_s: InfiniBand symbol/receive errors, link flaps or NIC
            errors at this rate point at the network.
        transmit_wait_min_per_s: InfiniBand transmit wait (ticks per second)
            below this never stands out...
        transmit_wait_above_peers_ratio: ...above it, it does when this many
            times the other nodes' median.
        bus_bandwidth_below_peers_ratio: a node's ranks' bus bandwidth below
            this x the other nodes' ranks' median is low.
        compute_window_steps: a rank's newest steps averaged for the compute
            evidence (``compute_seconds``).
    """

    sm_clock_below_peers_ratio: float = 0.9
    cpu_utilization_ratio: float = 0.95
    load_per_cpu_ratio: float = 1.0
    memory_available_below_ratio: float = 0.05
    swap_growth_bytes_per_s: float = float(1 << 20)
    errors_min_per_s: float = 1.0
    transmit_wait_min_per_s: float = 1000.0
    transmit_wait_above_peers_ratio: float = 4.0
    bus_bandwidth_below_peers_ratio: float = 0.7
    compute_window_steps: int = 20

    def __post_init__(self) -> None:
        for key in (
            "sm_clock_below_peers_ratio",
            "bus_bandwidth_below_peers_ratio",
            "cpu_utilization_ratio",
            "memory_available_below_ratio",
        ):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"detection.cause_{key}", f"must be in (0, 1], got {value}")
        for key in ("load_per_cpu_ratio", "swap_growth_bytes_per_s", "errors_min_per_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(f"detection.cause_{key}", f"must be > 0, got {value}")
        if not self.transmit_wait_min_per_s >= 0:
            raise ConfigError(
                "detection.cause_transmit_wait_min_per_s", f"must be >= 0, got {self.transmit_wait_min_per_s}"
            )
        if not self.transmit_wait_above_peers_ratio >= 1:
            raise ConfigError(
                "detection.cause_transmit_wait_above_peers_ratio",
                f"must be >= 1, got {self.transmit_wait_above_peers_ratio}",
            )
        if self.compute_window_steps < 1:
            raise ConfigError(
                "detection.cause_compute_window_steps", f"must be >= 1, got {self.compute_window_steps}"
            )


DEFAULT_SETTINGS = CauseSettings()

GpuField = Literal[
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "temperature_celsius",
    "power_watts",
    "power_limit_watts",
    "tensor_active_ratio",
]


class GpuIndex:
    """GPU samples by UUID per node, built once per node asked about."""

    def __init__(self, nodes: Mapping[str, NodeRecord]) -> None:
        self._nodes = nodes
        self._by_node: dict[str, dict[str, node_pb2.GpuSample]] = {}

    def gpu(self, record: RankRecord) -> node_pb2.GpuSample | None:
        uuid = record.identity.gpu_uuid
        if not uuid:
            return None
        by_uuid = self._by_node.get(record.node_id)
        if by_uuid is None:
            report = report_of(self._nodes.get(record.node_id))
            by_uuid = self._by_node[record.node_id] = (
                {g.uuid: g for g in report.gpus} if report is not None else {}
            )
        return by_uuid.get(uuid)


class Peers:
    """The healthy ranks that a job's stragglers are compared with, gathered once per job and round.

    They are the job's running ranks less ``excluded`` (the stragglers asked
    about and the other slow ranks): the same for every straggler of the job.
    So each rule sums them up once (``GpuPeers``, ``HostPeers``,
    ``NetworkPeers``, ``ComputePeers``) and takes out of the sums what a
    straggler shares with them (its GPU, its node) per straggler, instead of
    reading every peer again for each straggler: O(ranks + stragglers), not
    O(ranks x stragglers), which at 1,600 ranks with a tenth straggling took
    0.8 s of a detection round that runs every 0.5 s.
    """

    def __init__(self, job: JobRecord, nodes: Mapping[str, NodeRecord], excluded: Collection[int]) -> None:
        self.job = job
        self.nodes = nodes
        self.running = job.running_ranks()
        self.ranks = [r for r in self.running if r.rank not in excluded]
        self.gpus = GpuIndex(nodes)

    @functools.cached_property
    def node_ids(self) -> frozenset[str]:
        """The nodes the peers run on."""
        return frozenset(r.node_id for r in self.ranks)


def report_of(node: NodeRecord | None) -> node_pb2.NodeReport | None:
    """A node's latest report; None for an unknown node or one that has not reported."""
    return node.report if node is not None else None


def median(values: Iterable[float | None]) -> float | None:
    """The median of the known values; None when none is known."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def put(evidence: dict[str, float], key: str, value: float | None) -> None:
    """``evidence[key] = value``, when the value is known."""
    if value is not None:
        evidence[key] = float(value)


def optional_value(message: node_pb2.GpuSample, field: GpuField) -> float | None:
    """An optional field of a GPU sample: None when unset."""
    return float(getattr(message, field)) if message.HasField(field) else None
