"""Cause attribution: why a straggler is slow, and which nodes slow a job's collectives.

Pure domain code, like the detectors: reads a JobRecord and the cluster's
NodeRecords (latest and previous NodeReport), never does I/O or reads a
clock, so the same state always gives the same cause. Run it when a detector
raises a finding, not on every tick.

A straggler is compared with its *peers*: the job's other running ranks,
less those the caller knows are slow too (``slow_ranks``: every rank the
straggler detector flags). The rules, in order; the first that explains the
straggler names the cause:

1. GPU (the straggler's own GPU: ``RankIdentity.gpu_uuid`` in its node's latest
   report). A clock-event reason group set on its GPU but on fewer than half of
   the peers' GPUs (``sw_power_cap`` is routine on every busy GPU, so a reason
   the peers share explains nothing), unless its SM clock is known and no lower
   than the peers' median; or its SM clock below ``sm_clock_below_peers_ratio``
   x the peers' median. Groups, strongest first: thermal (SW/HW thermal
   slowdown) -> ``gpu_thermal``; power (SW power cap, HW power brake) ->
   ``gpu_power``; HW slowdown, or a low clock with no reason -> ``gpu_clock``.
2. Host: memory pressure (available < ``memory_available_below_ratio`` of
   total, or swap use growing by ``swap_growth_bytes_per_s``) -> ``host_memory``,
   else CPU saturation (utilization >= ``cpu_utilization_ratio`` or load1 per
   CPU >= ``load_per_cpu_ratio``) -> ``host_cpu``. Memory comes first because
   swapping also shows as CPU load. A node-wide signal only explains a
   straggler whose node differs from the healthy ranks' nodes: when a peer runs
   on the straggler's node this rule is skipped, and it does not count when most
   peer nodes (with data) show the same signal.
3. Network (its node; with the node's topology and the rank's GPU known, only
   the NICs nearest that GPU, clusterwatch/topology.py): a link down (an InfiniBand port not ACTIVE, a NIC not up,
   that was up in the previous report or is up on most of the job's other
   nodes that have it), InfiniBand or NIC errors or link flaps at
   >= ``errors_min_per_s``, InfiniBand transmit wait >= ``transmit_wait_min_per_s``
   and >= ``transmit_wait_above_peers_ratio`` x the peers' nodes' median, or its
   node's ranks' bus bandwidth below ``bus_bandwidth_below_peers_ratio`` x the
   peers' (for the op that moves the most bytes in the job) -> ``network``.
4. Otherwise ``compute``: the node looks like its peers', so the rank itself
   computes slower (data loading, code path, input).

A job-level communication slowdown (``network_cause``) names the
hosting nodes whose network stands out from the job's other nodes by the same
network rules (each node compared with the others); with none, the cause is
``communication`` with no node: the fabric or the job's communication as a
whole.

Missing data is normal (an unset optional field, a CPU rank, a node without a
previous report or without InfiniBand): the rule that needs it is skipped.
Counter rates come from ``NodeRecord.previous`` -> ``NodeRecord.report`` by
the one per-device rule (coordinator/model/rates.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal, NamedTuple, TypeVar

from clusterwatch.coordinator.detection.topology_advice import Placement, place
from clusterwatch.coordinator.model.jobs import JobRecord, RankRecord
from clusterwatch.coordinator.model.rates import counter_rate, nic_key, port_key
from clusterwatch.coordinator.model.state import NodeRecord
from clusterwatch.errors import ConfigError
from clusterwatch.gpu_reasons import CLOCK_EVENT_REASONS
from clusterwatch.topology import link_name
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
    """

    name: str
    detail: str
    evidence: dict[str, float]
    nodes: tuple[str, ...] = ()


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

_REASON_BITS = dict(CLOCK_EVENT_REASONS)
# Reason groups, strongest explanation first: HW slowdown is also asserted
# when thermal or power-brake limits hit, so it only names gpu_clock alone.
_GPU_REASON_GROUPS: tuple[tuple[CauseName, int], ...] = (
    (CauseName.GPU_THERMAL, _REASON_BITS["sw_thermal_slowdown"] | _REASON_BITS["hw_thermal_slowdown"]),
    (CauseName.GPU_POWER, _REASON_BITS["sw_power_cap"] | _REASON_BITS["hw_power_brake_slowdown"]),
    (CauseName.GPU_CLOCK, _REASON_BITS["hw_slowdown"]),
)
_IB_ACTIVE = "ACTIVE"

_GpuField = Literal[
    "sm_clock_hertz", "sm_clock_max_hertz", "temperature_celsius", "power_watts", "power_limit_watts"
]
_IbCounter = Literal[
    "transmit_wait_total", "symbol_errors_total", "receive_errors_total", "link_downed_total"
]
_GPU_EVIDENCE: tuple[_GpuField, ...] = (
    "sm_clock_max_hertz",
    "temperature_celsius",
    "power_watts",
    "power_limit_watts",
)
_IB_ERRORS: tuple[_IbCounter, ...] = ("symbol_errors_total", "receive_errors_total")


def straggler_cause(
    job: JobRecord,
    rank: int,
    nodes: Mapping[str, NodeRecord],
    *,
    slow_ranks: Collection[int] = (),
    settings: CauseSettings = DEFAULT_SETTINGS,
) -> Cause:
    """The likely cause of one straggling rank (the rules are in the module docstring).

    Args:
        job: the straggler's job as the store holds it (read only).
        rank: the straggling rank (``StragglerFinding.rank``).
        nodes: ``ClusterState.nodes``.
        slow_ranks: the job's other slow ranks (every rank the straggler
            detector flags); they are not used as healthy peers.
        settings: thresholds.

    Returns:
        The first rule's cause that explains it, else ``compute``.
    """
    record = job.ranks.get(rank)
    if record is None:
        return Cause(CauseName.COMPUTE, f"job {job.job} has no rank {rank}: nothing to compare", {})
    slow = set(slow_ranks)
    peers = [r for r in job.running_ranks() if r.rank != rank and r.rank not in slow]
    gpus = _GpuIndex(nodes)
    return (
        _gpu_cause(record, peers, gpus, settings)
        or _host_cause(record, peers, nodes, settings)
        or _network_cause(job, record, slow, nodes, settings)
        or _compute_cause(record, peers, gpus, settings)
    )


def network_cause(
    job: JobRecord, nodes: Mapping[str, NodeRecord], *, settings: CauseSettings = DEFAULT_SETTINGS
) -> Cause:
    """The job's nodes whose network stands out, for a communication-bound job slowdown.

    Every hosting node is compared with the job's other nodes: a link down,
    InfiniBand/NIC errors or link flaps, an outlying InfiniBand transmit wait,
    or its ranks' bus bandwidth clearly below the other nodes'.

    Args:
        job: the job as the store holds it (read only).
        nodes: ``ClusterState.nodes``.
        settings: thresholds.

    Returns:
        ``network`` with the culprit nodes (worst first; the evidence is the
        first one's), or ``communication`` with no node when none stands out.
    """
    reports = {
        node_id: (node, report)
        for node_id in job.hosting_nodes()
        if (node := nodes.get(node_id)) is not None and (report := node.report) is not None
    }
    hosting = list(reports)
    census = _LinkCensus(nodes, hosting)
    networks = {node_id: _node_network(node, report, census) for node_id, (node, report) in reports.items()}
    op = _dominant_op(job)
    busbw = _busbw_by_node(job, op) if op is not None else {}
    waits = sorted(w for n in networks.values() if (w := n.transmit_wait_per_s) is not None)
    bandwidths = sorted(busbw.values())
    culprits: list[_Culprit] = []
    for node_id in hosting:
        net = networks[node_id]
        # Each node against the others: the median without its own value.
        peer_wait = _median_without(waits, net.transmit_wait_per_s)
        peer_busbw = _median_without(bandwidths, busbw.get(node_id))
        signals = _network_signals(net, peer_wait, busbw.get(node_id), peer_busbw, settings)
        if signals.reasons:
            culprits.append(_Culprit(node_id, signals))
    if culprits:
        culprits.sort(key=lambda c: (c.signals.level, -c.signals.magnitude, c.node_id))
        named = "; ".join(f"{c.node_id}: {', '.join(c.signals.reasons)}" for c in culprits)
        return Cause(
            CauseName.NETWORK,
            f"job {job.job} communicates slower and {len(culprits)} of its {len(hosting)} nodes "
            f"stand out: {named}",
            culprits[0].signals.evidence,
            tuple(c.node_id for c in culprits),
        )
    evidence: dict[str, float] = {}
    _put(evidence, "bus_bandwidth_bytes_per_second", _median(busbw.values()))
    _put(evidence, "ib_transmit_wait_per_second", _median(n.transmit_wait_per_s for n in networks.values()))
    return Cause(
        CauseName.COMMUNICATION,
        f"job {job.job} communicates slower but none of its {len(hosting)} nodes stands out "
        "(links up, no errors, transmit wait and bus bandwidth alike): the fabric or the "
        "job's communication as a whole",
        evidence,
    )


# --- GPU ---------------------------------------------------------------------------------------


class _GpuIndex:
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
            report = _report(self._nodes.get(record.node_id))
            by_uuid = self._by_node[record.node_id] = (
                {g.uuid: g for g in report.gpus} if report is not None else {}
            )
        return by_uuid.get(uuid)


def _gpu_cause(
    record: RankRecord, peers: Sequence[RankRecord], gpus: _GpuIndex, settings: CauseSettings
) -> Cause | None:
    gpu = gpus.gpu(record)
    if gpu is None:
        return None
    peer_gpus = _peer_gpus(gpu.uuid, peers, gpus)
    clock_hz = _optional_value(gpu, "sm_clock_hertz")
    peer_clock_hz = _median(_optional_value(g, "sm_clock_hertz") for g in peer_gpus)
    mask = gpu.clocks_event_reasons if gpu.HasField("clocks_event_reasons") else 0
    peer_masks = [g.clocks_event_reasons for g in peer_gpus if g.HasField("clocks_event_reasons")]
    name = _gpu_cause_name(clock_hz, peer_clock_hz, mask, peer_masks, settings)
    if name is None:
        return None
    evidence: dict[str, float] = {}
    _put(evidence, "sm_clock_hertz", clock_hz)
    _put(evidence, "peer_sm_clock_hertz", peer_clock_hz)
    for field in _GPU_EVIDENCE:
        _put(evidence, field, _optional_value(gpu, field))
    _put(
        evidence,
        "peer_temperature_celsius",
        _median(_optional_value(g, "temperature_celsius") for g in peer_gpus),
    )
    if gpu.HasField("clocks_event_reasons"):
        evidence["clocks_event_reasons"] = float(mask)
    head = f"rank {record.rank}'s GPU {gpu.uuid} on {record.node_id}"
    if clock_hz is not None and peer_clock_hz is not None:
        head += (
            f" runs its SM clock at {clock_hz / 1e9:.2f} GHz vs {peer_clock_hz / 1e9:.2f} GHz on its "
            f"peers' GPUs ({clock_hz / peer_clock_hz:.2f}x)"
        )
    elif clock_hz is not None:
        head += f" runs its SM clock at {clock_hz / 1e9:.2f} GHz"
    parts = [head]
    if "temperature_celsius" in evidence:
        parts.append(f"at {evidence['temperature_celsius']:.0f} °C")
    if "power_watts" in evidence:
        limit = f" of {evidence['power_limit_watts']:.0f} W" if "power_limit_watts" in evidence else ""
        parts.append(f"drawing {evidence['power_watts']:.0f} W{limit}")
    reasons = [reason for reason, bit in CLOCK_EVENT_REASONS if mask & bit and reason != "gpu_idle"]
    parts.append(f"with {', '.join(reasons)} set" if reasons else "with no clock-event reason set")
    return Cause(name, ", ".join(parts), evidence, (record.node_id,))


def _gpu_cause_name(
    clock_hz: float | None,
    peer_clock_hz: float | None,
    mask: int,
    peer_masks: Sequence[int],
    settings: CauseSettings,
) -> CauseName | None:
    """Which GPU cause (if any) the clocks and clock-event reasons point at (module docstring, rule 1)."""
    groups_set = [(name, bits) for name, bits in _GPU_REASON_GROUPS if mask & bits]
    # A reason most peers share (sw_power_cap on every busy GPU) does not single this GPU out.
    distinctive = [
        name
        for name, bits in groups_set
        if not peer_masks or 2 * sum(1 for m in peer_masks if m & bits) < len(peer_masks)
    ]
    if clock_hz is None or peer_clock_hz is None:
        return distinctive[0] if distinctive else None
    if distinctive and clock_hz < peer_clock_hz:  # ...and a reason whose clock is no lower explains nothing
        return distinctive[0]
    if clock_hz < settings.sm_clock_below_peers_ratio * peer_clock_hz:
        return groups_set[0][0] if groups_set else CauseName.GPU_CLOCK
    return None


def _peer_gpus(own_uuid: str, peers: Sequence[RankRecord], gpus: _GpuIndex) -> list[node_pb2.GpuSample]:
    seen = {own_uuid}
    found = []
    for peer in peers:
        gpu = gpus.gpu(peer)
        if gpu is not None and gpu.uuid not in seen:
            seen.add(gpu.uuid)
            found.append(gpu)
    return found


# --- host --------------------------------------------------------------------------------------


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
    report = _report(node)
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


def _host_cause(
    record: RankRecord, peers: Sequence[RankRecord], nodes: Mapping[str, NodeRecord], settings: CauseSettings
) -> Cause | None:
    if any(peer.node_id == record.node_id for peer in peers):
        return None  # healthy ranks share the node: a node-wide signal cannot single this one out
    own = _host_signals(nodes.get(record.node_id))
    if own is None:
        return None
    peer_nodes = sorted({peer.node_id for peer in peers})
    peer_signals = [s for s in map(_host_signals, map(nodes.get, peer_nodes)) if s is not None]
    where = f"{record.node_id}, where rank {record.rank} runs,"
    if own.memory_pressure(settings) and _not_shared(peer_signals, lambda s: s.memory_pressure(settings)):
        evidence: dict[str, float] = {}
        _put(evidence, "host_memory_available_ratio", own.memory_available_ratio)
        _put(
            evidence,
            "peer_host_memory_available_ratio",
            _median(s.memory_available_ratio for s in peer_signals),
        )
        _put(evidence, "host_swap_used_bytes", own.swap_used_bytes)
        _put(evidence, "host_swap_growth_bytes_per_second", own.swap_growth_bytes_per_s)
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
    if own.cpu_saturated(settings) and _not_shared(peer_signals, lambda s: s.cpu_saturated(settings)):
        evidence = {}
        _put(evidence, "host_cpu_utilization_ratio", own.cpu_utilization_ratio)
        _put(
            evidence,
            "peer_host_cpu_utilization_ratio",
            _median(s.cpu_utilization_ratio for s in peer_signals),
        )
        _put(evidence, "host_load1_per_cpu_ratio", own.load_per_cpu_ratio)
        _put(evidence, "peer_host_load1_per_cpu_ratio", _median(s.load_per_cpu_ratio for s in peer_signals))
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


# --- network -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _NodeNetwork:
    """One node's network over its latest report interval (rates None when unknown)."""

    transmit_wait_per_s: float | None
    ib_errors_per_s: float | None
    ib_link_downed_per_s: float | None
    nic_errors_per_s: float | None
    links_down: tuple[str, ...]


class _NetworkSignals(NamedTuple):
    """What makes one node's network stand out.

    Attributes:
        reasons: for people, one per signal; empty when nothing stands out.
        level / magnitude: to sort culprits, worst first: the kind of the worst
            signal (0 link down, 1 errors, 2 transmit wait, 3 bus bandwidth) and
            how far out it is.
    """

    reasons: list[str]
    evidence: dict[str, float]
    level: int
    magnitude: float


class _Culprit(NamedTuple):
    node_id: str
    signals: _NetworkSignals


class _LinkCensus:
    """Which links (``mlx5_0/1``, ``eth0``) are up on the job's nodes, to tell a
    broken link from one that is simply not cabled anywhere.

    Taken on the first question only: most nodes have no link down to ask about.
    """

    def __init__(self, nodes: Mapping[str, NodeRecord], node_ids: Iterable[str]) -> None:
        self._nodes = nodes
        self._node_ids = node_ids
        self._up: dict[str, set[str]] | None = None
        self._reported: dict[str, set[str]] = {}

    def mostly_up_elsewhere(self, name: str, node_id: str) -> bool:
        if self._up is None:
            self._up = {}
            for other in self._node_ids:
                report = _report(self._nodes.get(other))
                for link, up in _links(report) if report is not None else ():
                    self._reported.setdefault(link, set()).add(other)
                    if up:
                        self._up.setdefault(link, set()).add(other)
        reported_count = len(self._reported.get(name, set()) - {node_id})
        up_count = len(self._up.get(name, set()) - {node_id})
        return 2 * up_count > reported_count


def _links(report: node_pb2.NodeReport) -> list[tuple[str, bool]]:
    """(name, up) of every InfiniBand port with a state and every NIC with a link flag."""
    links = [(f"{p.device}/{p.port}", p.state == _IB_ACTIVE) for p in report.ib_ports if p.state]
    links.extend((n.device, n.up) for n in report.nics if n.device != "lo" and n.HasField("up"))
    return links


def _node_network(
    node: NodeRecord, report: node_pb2.NodeReport, census: _LinkCensus, devices: frozenset[str] | None = None
) -> _NodeNetwork:
    """The node's network; with ``devices``, only those NICs' links and error counters."""
    node_id = node.node_id
    previous = node.previous
    elapsed_s = report.timestamp_unix_seconds - previous.timestamp_unix_seconds if previous else 0.0
    was_up = dict(_links(previous)) if previous is not None else {}
    down = tuple(
        name
        for name, up in _links(report)
        if not up
        and (devices is None or name.partition("/")[0] in devices)
        and (was_up.get(name, False) or census.mostly_up_elsewhere(name, node_id))
    )
    if previous is None or elapsed_s <= 0:
        return _NodeNetwork(None, None, None, None, down)
    ports_now, ports_before = _only(report.ib_ports, devices), _only(previous.ib_ports, devices)
    ib_errors = [
        counter_rate(ports_before, ports_now, port_key, _optional(field), elapsed_s) for field in _IB_ERRORS
    ]
    return _NodeNetwork(
        transmit_wait_per_s=_transmit_wait_per_s(node),
        ib_errors_per_s=_sum(ib_errors),
        ib_link_downed_per_s=counter_rate(
            ports_before, ports_now, port_key, _optional("link_downed_total"), elapsed_s
        ),
        nic_errors_per_s=counter_rate(
            _only(previous.nics, devices),
            _only(report.nics, devices),
            nic_key,
            lambda n: n.receive_errors_total + n.transmit_errors_total,
            elapsed_s,
        ),
        links_down=down,
    )


_Device = TypeVar("_Device", node_pb2.IbPortSample, node_pb2.NicSample)


def _only(samples: Iterable[_Device], devices: frozenset[str] | None) -> list[_Device]:
    """The samples of ``devices`` (all when None)."""
    return [s for s in samples if devices is None or s.device in devices]


def _nearest_devices(placement: Placement) -> frozenset[str] | None:
    """The rank's nearest NICs and their interfaces; None when its GPU or NICs are unknown."""
    if not placement.nics:
        return None
    return frozenset(name for nic in placement.nics for name in (nic.device, *nic.interfaces))


def _transmit_wait_per_s(node: NodeRecord | None) -> float | None:
    """A node's InfiniBand transmit wait over its latest interval; None when unknown."""
    report, previous = _report(node), node.previous if node is not None else None
    if report is None or previous is None:
        return None
    elapsed_s = report.timestamp_unix_seconds - previous.timestamp_unix_seconds
    if elapsed_s <= 0:
        return None
    return counter_rate(
        previous.ib_ports, report.ib_ports, port_key, _optional("transmit_wait_total"), elapsed_s
    )


def _network_signals(
    net: _NodeNetwork,
    peer_wait_per_s: float | None,
    busbw: float | None,
    peer_busbw: float | None,
    settings: CauseSettings,
) -> _NetworkSignals:
    """What makes one node's network stand out (no reasons: nothing)."""
    reasons: list[str] = []
    severities: list[tuple[int, float]] = []
    evidence: dict[str, float] = {}
    if net.links_down:
        reasons.append(f"{', '.join(net.links_down)} down")
        severities.append((0, float(len(net.links_down))))
        evidence["links_down"] = float(len(net.links_down))
    for key, label, rate in (
        ("ib_errors_per_second", "InfiniBand errors", net.ib_errors_per_s),
        ("ib_link_downed_per_second", "InfiniBand link flaps", net.ib_link_downed_per_s),
        ("nic_errors_per_second", "NIC errors", net.nic_errors_per_s),
    ):
        if rate is not None and rate >= settings.errors_min_per_s:
            reasons.append(f"{label} at {rate:.1f}/s")
            severities.append((1, rate))
            evidence[key] = rate
    wait, peer_wait = net.transmit_wait_per_s, peer_wait_per_s
    # Transmit wait is routine under load: it only stands out against other nodes.
    if (
        wait is not None
        and peer_wait is not None
        and wait >= settings.transmit_wait_min_per_s
        and wait >= settings.transmit_wait_above_peers_ratio * peer_wait
    ):
        times = f" ({wait / peer_wait:.0f}x)" if peer_wait > 0 else ""
        reasons.append(f"InfiniBand transmit wait {wait:.3g}/s vs {peer_wait:.3g}/s on the others{times}")
        severities.append((2, wait / peer_wait if peer_wait > 0 else wait))
        evidence["ib_transmit_wait_per_second"] = wait
        evidence["peer_ib_transmit_wait_per_second"] = peer_wait
    if (
        busbw is not None
        and peer_busbw is not None
        and peer_busbw > 0
        and busbw < settings.bus_bandwidth_below_peers_ratio * peer_busbw
    ):
        reasons.append(
            f"bus bandwidth {busbw / 1e9:.2f} GB/s vs {peer_busbw / 1e9:.2f} GB/s on the others "
            f"({busbw / peer_busbw:.2f}x)"
        )
        severities.append((3, peer_busbw / max(busbw, 1.0)))
        evidence["bus_bandwidth_bytes_per_second"] = busbw
        evidence["peer_bus_bandwidth_bytes_per_second"] = peer_busbw
    level, magnitude = min(severities, key=lambda s: (s[0], -s[1])) if severities else (4, 0.0)
    return _NetworkSignals(reasons, evidence, level, magnitude)


def _network_cause(
    job: JobRecord,
    record: RankRecord,
    slow: Collection[int],
    nodes: Mapping[str, NodeRecord],
    settings: CauseSettings,
) -> Cause | None:
    node = nodes.get(record.node_id)
    report = _report(node)
    if node is None or report is None:
        return None
    running = job.running_ranks()
    census = _LinkCensus(nodes, {r.node_id for r in running} | {record.node_id})
    # With the node's topology, only the NICs next to the rank's GPU speak for it:
    # a port down elsewhere on the node carries other GPUs' traffic.
    placement = place(record, nodes)
    devices = _nearest_devices(placement)
    net = _node_network(node, report, census, devices)
    healthy_elsewhere = [
        r for r in running if r.node_id != record.node_id and r.rank not in slow and r.rank != record.rank
    ]
    peer_nodes = sorted({r.node_id for r in healthy_elsewhere})
    peer_waits = [_transmit_wait_per_s(nodes.get(node_id)) for node_id in peer_nodes]
    op = _dominant_op(job)
    busbw = peer_busbw = None
    if op is not None:
        busbw = _median(r.bus_bandwidth_bytes_per_s.get(op) for r in running if r.node_id == record.node_id)
        peer_busbw = _median(r.bus_bandwidth_bytes_per_s.get(op) for r in healthy_elsewhere)
    signals = _network_signals(net, _median(peer_waits), busbw, peer_busbw, settings)
    if not signals.reasons:
        return None
    where = ""
    if devices is not None:
        nics = ", ".join(nic.device for nic in placement.nics)
        where = f" on {nics}, the NIC nearest its GPU {placement.gpu} ({link_name(placement.nic_link)})"
    return Cause(
        CauseName.NETWORK,
        f"{record.node_id}, where rank {record.rank} runs, has network trouble{where}: "
        f"{'; '.join(signals.reasons)}",
        signals.evidence,
        (record.node_id,),
    )


def _dominant_op(job: JobRecord) -> str | None:
    """The collective op that moved the most bytes in the job (ties: by name)."""
    moved = [(totals.bytes_total, op) for op, totals in job.collectives.items() if totals.bytes_total > 0]
    return max(moved, key=lambda m: (m[0], m[1]))[1] if moved else None


def _busbw_by_node(job: JobRecord, op: str) -> dict[str, float]:
    """Median bus bandwidth of each hosting node's running ranks for ``op``."""
    by_node: dict[str, list[float]] = {}
    for record in job.running_ranks():
        value = record.bus_bandwidth_bytes_per_s.get(op)
        if value is not None:
            by_node.setdefault(record.node_id, []).append(value)
    return {node_id: statistics.median(values) for node_id, values in by_node.items()}


# --- compute -----------------------------------------------------------------------------------


def _compute_cause(
    record: RankRecord, peers: Sequence[RankRecord], gpus: _GpuIndex, settings: CauseSettings
) -> Cause:
    window = settings.compute_window_steps
    compute_s = _mean_compute_s(record, window)
    peer_compute_s = _median(_mean_compute_s(peer, window) for peer in peers)
    evidence: dict[str, float] = {}
    _put(evidence, "compute_seconds", compute_s)
    _put(evidence, "peer_compute_seconds", peer_compute_s)
    gpu = gpus.gpu(record)
    if gpu is not None and gpu.HasField("sm_clock_hertz"):
        evidence["sm_clock_hertz"] = gpu.sm_clock_hertz
        peer_gpus = _peer_gpus(gpu.uuid, peers, gpus)
        _put(
            evidence, "peer_sm_clock_hertz", _median(_optional_value(g, "sm_clock_hertz") for g in peer_gpus)
        )
    if compute_s is not None and peer_compute_s is not None and peer_compute_s > 0:
        numbers = (
            f"computes {compute_s:.3f} s per step vs {peer_compute_s:.3f} s on its peers "
            f"({compute_s / peer_compute_s:.2f}x) and "
        )
    else:
        numbers = ""
    return Cause(
        CauseName.COMPUTE,
        f"rank {record.rank} on {record.node_id} {numbers}nothing on its node sets it apart from its "
        "peers' (GPU clocks, host, network): the rank itself is slower (data loading, code path or input)",
        evidence,
    )


def _mean_compute_s(record: RankRecord, window: int) -> float | None:
    values = record.steps.compute_s[-window:]
    return sum(values) / len(values) if values else None


# --- helpers -----------------------------------------------------------------------------------


def _report(node: NodeRecord | None) -> node_pb2.NodeReport | None:
    return node.report if node is not None else None


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_without(ordered: Sequence[float], value: float | None) -> float | None:
    """The median of ``ordered`` (ascending) with one ``value`` taken out (none when None); O(log n)."""
    if value is None:
        return statistics.median(ordered) if ordered else None
    n = len(ordered) - 1
    if n <= 0:
        return None
    removed = bisect.bisect_left(ordered, value)

    def at(k: int) -> float:
        return ordered[k if k < removed else k + 1]

    h = n // 2
    return at(h) if n % 2 else (at(h - 1) + at(h)) / 2


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _put(evidence: dict[str, float], key: str, value: float | None) -> None:
    if value is not None:
        evidence[key] = float(value)


def _optional_value(message: node_pb2.GpuSample, field: _GpuField) -> float | None:
    """An optional field of a GPU sample: None when unset."""
    return float(getattr(message, field)) if message.HasField(field) else None


def _optional(field: _IbCounter) -> Callable[[node_pb2.IbPortSample], int | None]:
    """Reads an optional counter of an InfiniBand port: None when unset."""
    return lambda port: getattr(port, field) if port.HasField(field) else None
